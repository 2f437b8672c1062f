"""Admission against a noisy neighbour: what one tenant runs or queues must not keep another from its
guaranteed quota, its fair share or a cycle of its own."""
from types import SimpleNamespace

import pytest

from jobs import admission
from jobs.backends.base import Capacity, Node
from jobs.models import Job, Status
from jobs.states import transition
from tenants.models import Quota
from tests.support.builders import ELASTIC_MANIFEST, job, member, record_sends, running_on, torn_down

pytestmark = pytest.mark.django_db

# An elastic job that needs at least 2 learners of one GPU, and may grow to 4.
ELASTIC_MIN_2 = ELASTIC_MANIFEST.replace("min_learners: 1,", "min_learners: 2,")


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


@pytest.fixture
def one_node(monkeypatch):
    """The backend reports one node of 4 GPUs."""
    capacity = Capacity(nodes=(Node("local", 4, 64.0, 256 * 2**30),))
    monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))


@pytest.mark.parametrize("gpus", [[0, 1], [0, 1, 2]], ids=["at-its-minimum", "grown-past-it"])
def test_it_reclaims_a_guaranteed_quota_from_an_elastic_job_grown_past_its_minimum(one_node, sent, gpus):
    """team-a (1 GPU guaranteed, may borrow) runs an elastic job of at least 2 learners, at 2 or grown
    to 3 on idle GPUs; team-b's 4-GPU job fits in its own quota. Shrinking to the minimum is not room
    enough, so the borrowed job is reclaimed, whatever size it grew to."""
    borrower, owner = member("team-a", "alice"), member("team-b", "bob")
    Quota.objects.update_or_create(tenant=borrower.tenant, defaults={"gpus": 1, "can_borrow": True})
    Quota.objects.update_or_create(tenant=owner.tenant, defaults={"gpus": 4, "can_borrow": False})
    elastic = running_on(job(borrower, manifest_yaml=ELASTIC_MIN_2, gpus=1, learners=len(gpus)), gpus=gpus)
    guaranteed = job(owner, gpus=4, learners=1)
    admission.run_cycle()
    elastic.refresh_from_db()
    assert elastic.status == Status.HALTING and elastic.preempted_reason.startswith("reclaimed")
    waiting = Job.objects.get(pk=guaranteed.pk)
    assert waiting.status == Status.QUEUED and "being freed by preemption" in waiting.wait_reason


@pytest.mark.parametrize("end", ["terminated", "failed"])
def test_an_ended_jobs_gpus_stay_held_until_its_teardown_confirms_its_learners_gone(one_node, sent, end):
    """team-a's job on every GPU ends; its learners get a grace period and a kill, and the teardown row
    stays open until the backend says none runs. team-b's job must not start on a GPU that a learner of
    team-a's may still be using: it is admitted when the teardown is done, and the teardown's end is
    what wakes the loop (jobs.tasks.RELEASES)."""
    from jobs import lifecycle, tasks
    from jobs.models import FollowUp
    ended = running_on(job(member("team-a", "alice"), gpus=1, learners=4), gpus=[0, 1, 2, 3])
    if end == "terminated":
        lifecycle.terminate(ended, actor="alice")
    else:
        transition(ended.id, Status.FAILED, actor="lifecycle-manager", reason="learner 0 exited 1")
    waiting = job(member("team-b", "bob"), gpus=2, learners=1)
    assert admission.run_cycle() == []
    assert Job.objects.get(pk=waiting.pk).status == Status.QUEUED
    assert FollowUp.objects.filter(job_id=ended.id, kind=FollowUp.Kind.TEARDOWN, done_at=None).exists()
    assert FollowUp.Kind.TEARDOWN in tasks.RELEASES
    assert admission.used_resources()["local"]["gpu_ids"] == {0, 1, 2, 3}  # the cluster view agrees
    torn_down(ended)
    assert admission.used_resources() == {}
    assert admission.run_cycle() == [waiting.id]


ELASTIC_MIN_1 = ELASTIC_MIN_2.replace("min_learners: 2", "min_learners: 1")


@pytest.mark.parametrize("elastic", [False, True], ids=["a-fixed-job", "an-elastic-job-past-its-minimum"])
def test_a_job_that_waited_long_keeps_its_held_node_while_an_elastic_job_could_shrink(one_node, sent, elastic):
    """team-b's 4-GPU job has waited past the reservation age; the node is held for it, so a later
    small job of another tenant does not take the GPU that is free. team-a's job on two of the GPUs
    being elastic (it could shrink to one) must not lift that hold."""
    from datetime import timedelta

    from django.utils import timezone
    manifest = {"manifest_yaml": ELASTIC_MIN_1} if elastic else {}
    neighbour = running_on(job(member("team-a", "alice"), gpus=1, learners=2, **manifest), gpus=[0, 1])
    running_on(job(member("team-c", "carol"), gpus=1, learners=1), gpus=[2])
    big = job(member("team-b", "bob"), gpus=4, learners=1)
    Job.objects.filter(pk=big.pk).update(updated_at=timezone.now() - timedelta(hours=5))
    small = job(member("team-d", "dave"), gpus=1, learners=1)
    admission.run_cycle()
    assert Job.objects.get(pk=small.pk).status == Status.QUEUED
    assert "held for it" in Job.objects.get(pk=big.pk).wait_reason
    assert Job.objects.get(pk=neighbour.pk).status == Status.PROCESSING


@pytest.mark.parametrize("held", [[3], [0]], ids=["a-GPU-the-node-no-longer-reports", "a-GPU-another-job-holds"])
def test_a_placement_the_nodes_cannot_hold_costs_its_own_gpu_not_every_tenants_cycle(monkeypatch, sent, held, caplog):
    """The node reports 3 GPUs now (one failed, or its device plugin took it out), or two rows hold
    GPU 0: the scheduler refused the snapshot, and every cycle failed for every tenant until that job
    ended. The cycle goes on without that GPU, saying so; what each job holds elsewhere stays held."""
    capacity = Capacity(nodes=(Node("local", 3, 64.0, 256 * 2**30),))
    monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    first = running_on(job(alice, gpus=1, learners=1), gpus=[0])
    odd = running_on(job(alice, gpus=1, learners=1), gpus=[1])
    Job.objects.filter(pk=odd.pk).update(placement=[{"node": "local", "gpu_ids": held}])
    waiting = job(bob, gpus=1, learners=1)
    two = job(bob, gpus=2, learners=1)
    assert admission.run_cycle() == [waiting.id]  # onto a GPU nobody holds
    waiting.refresh_from_db()
    assert waiting.placement[0]["gpu_ids"] in ([1], [2]) and waiting.placement[0]["gpu_ids"] != held
    assert Job.objects.get(pk=two.pk).status == Status.QUEUED  # one GPU is left, not two
    # Of two rows holding one GPU, whichever the cycle read second is named.
    assert any(f"job {row.id} holds GPU(s) {held[0]} of node local" in caplog.text for row in (first, odd))
