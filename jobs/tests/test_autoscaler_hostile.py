"""The autoscaler against a noisy neighbour: what one tenant queues or runs must not keep another
tenant's elastic jobs off idle GPUs, nor make them resize for nothing."""
from types import SimpleNamespace

import pytest
from django.utils import timezone

from jobs import admission, autoscaler
from jobs.backends.base import Capacity, Node
from jobs.models import Job, MetricPoint, Status
from tenants.models import Quota
from tests.support.builders import ELASTIC_MANIFEST, job, member, record_sends, running_on

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


@pytest.fixture
def four_gpus(monkeypatch, settings):
    """One node of 4 GPUs, for admission and the autoscaler; elastic settings that let a grow pay."""
    capacity = Capacity(nodes=(Node("local", 4, 64.0, 256 * 2**30),))
    backend = SimpleNamespace(capacity=lambda: capacity)
    monkeypatch.setattr(admission, "get_backend", lambda: backend)
    monkeypatch.setattr(autoscaler, "get_backend", lambda: backend)
    settings.ELASTIC_HORIZON_S, settings.ELASTIC_MIN_INTERVAL_S, settings.ELASTIC_RESIZE_COST_S = 600.0, 300.0, 20.0
    settings.ELASTIC_GROW_SETTLE_S = 0.0


def measured(row):
    """Learner 0 reported 100 samples/s over the last 20 s."""
    now = timezone.now()
    for ago, samples in ((20, 0), (0, 2000)):
        MetricPoint.objects.create(job=row, attempt=row.attempt, learner=0, name="samples", value=samples,
                                   time=now - timezone.timedelta(seconds=ago))


def hard_budget_spent(membership):
    Quota.objects.update_or_create(tenant=membership.tenant, defaults={"gpu_hours": 0.0})


@pytest.mark.parametrize("queue", [
    pytest.param(lambda other: job(other, gpus=64, learners=2), id="a-job-the-cluster-can-never-hold"),
    pytest.param(lambda other: (hard_budget_spent(other), job(other, gpus=1, learners=3)), id="a-spent-hard-budget"),
])
def test_a_queued_job_no_capacity_can_admit_does_not_hold_back_another_tenants_grow(four_gpus, sent, queue):
    """team-b queues a job the next cycle will not admit however many GPUs are idle; team-a's
    elastic job still grows onto them (and gives them back when a job that can start needs them)."""
    row = running_on(job(member("team-a", "alice"), manifest_yaml=ELASTIC_MANIFEST, gpus=1, learners=1), gpus=[0])
    measured(row)
    queue(member("team-b", "bob"))
    admission.run_cycle()
    assert [r.learners for r in autoscaler.run()] == [2]
    assert Job.objects.get(pk=row.pk).status == Status.HALTING


def test_a_pass_reads_no_more_for_every_other_job_running(four_gpus, sent, settings, monkeypatch):
    """One tenant's elastic job makes a pass run after every cycle; what the pass reads must not grow
    with the jobs the other tenants run (it holds the admission lock while it reads)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    backend = SimpleNamespace(capacity=lambda: Capacity(nodes=(Node("local", 64, 512.0, 2048 * 2**30),)))
    monkeypatch.setattr(autoscaler, "get_backend", lambda: backend)
    row = running_on(job(member("team-a", "alice"), manifest_yaml=ELASTIC_MANIFEST, gpus=1, learners=1), gpus=[0])
    measured(row)
    settings.ELASTIC_HORIZON_S = 0.0  # no grow pays: the pass reads, decides, and stops

    def queries_with(others):
        for index in range(others):
            running_on(job(member(f"team-{others}-{index}", f"user-{others}-{index}"), gpus=1, learners=1),
                    gpus=[1 + others + index])
        with CaptureQueriesContext(connection) as captured:
            autoscaler.run()
        return len(captured)

    few = queries_with(5)
    assert queries_with(20) - few < 5
    assert Job.objects.get(pk=row.pk).status == Status.PROCESSING
