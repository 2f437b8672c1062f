from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class JobsConfig(AppConfig):
    name = "jobs"

    def ready(self):
        from jobs import dispatch, elastic_timeline, live, prometheus_series, sharing, states, transfers
        from jobs import prometheus as exposition
        from jobs.models import ACTIVE, JobEvent
        from tenants import quotas
        from tenants.models import Membership, Quota

        def account_usage(job, *, before, when):
            # Inside the transition's transaction: accounting never disagrees with the job's history.
            quotas.on_transition(job, holding_before=before in ACTIVE, holding_after=job.status in ACTIVE, when=when)

        def reschedule(sender, instance, **kwargs):
            dispatch.wake_scheduler_on_commit()  # a quota change takes effect at once

        states.listen(account_usage)
        states.listen(elastic_timeline.on_transition)
        states.listen(live.on_status_change)
        post_save.connect(reschedule, sender=Quota, weak=False, dispatch_uid="quota-change-reschedules")
        post_delete.connect(sharing.on_membership_deleted, sender=Membership, dispatch_uid="jobs.unshare-on-leave")
        # Every final transition writes a JobEvent: that is when a job's data-store credentials go.
        post_save.connect(transfers.on_job_event, sender=JobEvent, dispatch_uid="jobs.forget_credentials")
        # Open websockets check their access again whenever something that grants it changes.
        live.connect_access_signals()
        exposition.register(prometheus_series.COLLECTOR)  # Trainyard's series on /metrics
        prometheus_series.cluster_nodes = _cluster_nodes  # every node gets the utilisation series


def _cluster_nodes():
    from jobs.backends import get_backend
    return [node.name for node in get_backend().capacity().nodes]
