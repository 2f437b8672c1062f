"""The worker's tasks (jobs.tasks): what a scheduling run does besides its cycle."""
import pytest
from django.core.cache import cache

from jobs import tasks
from jobs.models import FollowUp, Job, Status
from jobs.tests.builders import job, member, record_sends

pytestmark = pytest.mark.django_db


@pytest.fixture
def deploys(monkeypatch):
    """A node of 4 GPUs for the scheduler; the job ids the deploy work ran for, in order."""
    from types import SimpleNamespace

    from jobs import admission
    from jobs.backends.base import Capacity, Node
    capacity = Capacity(nodes=(Node("local", 4, 64.0, 256 * 2**30),))
    monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
    ran = []
    monkeypatch.setitem(tasks.HANDLERS, FollowUp.Kind.DEPLOY, lambda job_id, attempt: ran.append(job_id))
    cache.clear()  # no pacing rest left over from another test's cycle
    return ran


def test_a_cycle_that_admits_a_job_deploys_it_itself_without_waiting_for_its_message(deploys, monkeypatch):
    sent = record_sends(monkeypatch)
    queued = job(member())
    tasks.schedule()
    assert Job.objects.get(pk=queued.pk).status == Status.PENDING
    assert deploys == [queued.pk]
    row = FollowUp.objects.get(job=queued, kind=FollowUp.Kind.DEPLOY)
    assert row.done_at is not None
    # Its message still went out (whoever claims first runs it); the second delivery changes nothing.
    assert ("follow_up", (row.pk,)) in sent
    tasks.follow_up(row.pk)
    assert deploys == [queued.pk]


def test_a_cycle_that_admits_more_leaves_their_deploys_to_the_workers_processes(deploys, monkeypatch):
    record_sends(monkeypatch)
    alice = member()
    for _ in range(tasks.DEPLOY_HERE_MAX + 1):
        job(alice)
    tasks.schedule()
    assert Job.objects.filter(status=Status.PENDING).count() == tasks.DEPLOY_HERE_MAX + 1
    assert deploys == []
    assert FollowUp.objects.filter(kind=FollowUp.Kind.DEPLOY, done_at=None).count() == tasks.DEPLOY_HERE_MAX + 1
