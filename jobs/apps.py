from django.apps import AppConfig
from django.db.models.signals import post_save


class JobsConfig(AppConfig):
    name = "jobs"

    def ready(self):
        from jobs import live, transfers
        from jobs.models import JobEvent
        # Every final transition writes a JobEvent: that is when a job's data-store credentials go.
        post_save.connect(transfers.on_job_event, sender=JobEvent, dispatch_uid="jobs.forget_credentials")
        # Open websockets check their access again whenever something that grants it changes.
        live.connect_access_signals()
