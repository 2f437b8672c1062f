"""Celery tasks of the lifecycle manager, thin on purpose. A message only wakes a worker: what to do
is a row in the database (jobs.outbox) or the queue the scheduler reads. Messages are sent by name
(jobs.dispatch), so nothing imports this module but the worker.

A broker may deliver twice and a worker may die mid-task: `follow_up` claims its row by
compare-and-swap (a second delivery finds it taken or done), and the reconcile pass sends again
every row nobody works on.
"""
import time

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from jobs import admission, autoscaler, dispatch, lifecycle, outbox, reconcile as reconciling
from jobs.backends import get_backend
from jobs.models import FollowUp
from learner_agent import address

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


@shared_task(name="jobs.tasks.schedule", ignore_result=True)
def schedule():
    # Serialised by the admission lock inside run_cycle (jobs.admission): no second lock here.
    rest = dispatch.rest_left("schedule")  # paced (jobs.dispatch): the last cycle's rest is not over
    if rest > 0:
        dispatch.defer("schedule", rest)
        return
    dispatch.starting("schedule")  # coalesced (jobs.dispatch): later requests need a run of their own
    started = time.monotonic()
    with dispatch.held("follow_up") as written:
        admission.run_cycle()
    took = time.monotonic() - started
    _first_here(written)
    dispatch.ran("schedule", took)
    if autoscaler.may_resize():
        dispatch.send("autoscale")  # elastic jobs grow onto what the cycle left idle


def _first_here(written):
    """The follow-ups a cycle wrote (its admissions' deploys, its preemptions' halts): the first is
    done here and now, the rest go to every worker. Sent, the first waited for a worker to wake for
    it (about 10 ms here: "admitted → deploy claimed" of bench frameworks' fixed_cost_s), while
    this worker is awake already; a burst's other deploys still run side by side."""
    for args in written[1:]:
        dispatch.send("follow_up", *args)
    if written:
        _follow_up(*written[0])


@shared_task(name="jobs.tasks.autoscale", ignore_result=True)
def autoscale():
    # Under the admission lock too (jobs.autoscaler.run): never interleaved with a cycle.
    dispatch.starting("autoscale")  # coalesced like schedule (jobs.dispatch)
    autoscaler.run()


@shared_task(name="jobs.tasks.follow_up", ignore_result=True)
def follow_up(row_id):
    _follow_up(row_id)


def _follow_up(row_id):
    done = outbox.run(row_id, HANDLERS)
    if done is not None and done.kind in RELEASES:
        dispatch.send("schedule")


@shared_task(name="jobs.tasks.reconcile", ignore_result=True)
def reconcile():
    reconciling.reconcile()
