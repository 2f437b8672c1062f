"""Celery tasks of the lifecycle manager, thin on purpose. A message only wakes a worker: what to do
is a row in the database (jobs.outbox). Messages are sent by name (jobs.dispatch), so nothing imports
this module but the worker. Scheduling cycles are not a task: the scheduling loop runs them
(jobs.scheduler_loop), and work that frees resources wakes it.

A broker may deliver twice and a worker may die mid-task: `follow_up` claims its row by
compare-and-swap (a second delivery finds it taken or done), and the reconcile pass sends again
every row nobody works on.
"""
from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from jobs import autoscaler, deletion, dispatch, idle, lifecycle, outbox, reconcile as reconciling, retention
from jobs.backends import get_backend
from jobs.models import FollowUp
from learner_agent import address
from tenants import people

Kind = FollowUp.Kind
HANDLERS = {Kind.DEPLOY: lifecycle.deploy, Kind.HALT: lifecycle.halt_learners,
            Kind.FINISH: lifecycle.finish_attempt, Kind.TEARDOWN: lifecycle.teardown}
# Work after which resources may be free for queued jobs.
RELEASES = {Kind.FINISH, Kind.TEARDOWN}


@worker_ready.connect
def start_spare_agents(**_):
    """The local backend's agents learn where the platform is now (the address may have changed
    since they were deployed: learner_agent.address), and its first deploy finds a spare agent too
    (learner_agent.spare), one of the code this worker runs."""
    if settings.BACKEND == "local":
        backend = get_backend()
        backend.announce(lifecycle.ingest_url(address.JOB_ID))
        backend.restart_spares()


@shared_task(name="jobs.tasks.spare_agents", ignore_result=True)
def spare_agents():
    """Top the local backend's spare agents up (sent by its deploys, a moment after their learners)."""
    get_backend().replenish_spares()


@shared_task(name="jobs.tasks.autoscale", ignore_result=True)
def autoscale():
    # Celery beat's periodic pass (the scheduling loop runs one after each cycle too); under the
    # admission lock (jobs.autoscaler.run): never interleaved with a cycle.
    autoscaler.run()


@shared_task(name="jobs.tasks.follow_up", ignore_result=True)
def follow_up(row_id):
    done = outbox.run(row_id, HANDLERS)
    if done is not None and done.kind in RELEASES:
        dispatch.wake_scheduler()


@shared_task(name="jobs.tasks.reconcile", ignore_result=True)
def reconcile():
    reconciling.reconcile()


@shared_task(name="jobs.tasks.sweep_storage", ignore_result=True)
def sweep_storage():
    """Celery beat's pass over storage: what killed processes left there (jobs.reconcile.sweep_storage)."""
    reconciling.sweep_storage()


@shared_task(name="jobs.tasks.purge_deleted", ignore_result=True)
def purge_deleted():
    """Celery beat's pass over deleted jobs: their files, logs and metrics go (jobs.deletion.purge_pass)."""
    deletion.purge_pass()


@shared_task(name="jobs.tasks.prune_samples", ignore_result=True)
def prune_samples():
    """Celery beat's pass over resource samples past their retention (jobs.retention.prune_pass)."""
    retention.prune_pass()


@shared_task(name="jobs.tasks.prune_people", ignore_result=True)
def prune_people():
    """Celery beat's pass over API tokens and invitations long ended (tenants.people.prune)."""
    people.prune()


@shared_task(name="jobs.tasks.idle_gpus", ignore_result=True)
def idle_gpus():
    """Celery beat's pass over the tenants' idle-GPU policies (jobs.idle)."""
    idle.run()
