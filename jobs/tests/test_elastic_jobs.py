"""Elastic jobs on the platform: the per-attempt environment, the allocation timeline, resizes."""
import pytest
from django.utils import timezone

from jobs.lifecycle import deploy_spec
from jobs.models import Allocation, MetricPoint, Status
from jobs.states import transition
from jobs.tests.builders import job, member

ELASTIC = """
name: elastic
learners: 2
gpus: 1
cpus: 1
memory: 1GiB
framework: {name: custom, command: sh run.sh}
elastic: {min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256}, lr_scaling: sqrt}
"""
pytestmark = pytest.mark.django_db


def elastic_job(**fields):
    fields.setdefault("learners", 2)
    return job(member(), manifest_yaml=ELASTIC, gpus=1, **fields)


def admit(row, placement=None):
    placement = placement or [{"node": "local", "gpu_ids": [i]} for i in range(row.learners)]
    return transition(row.id, Status.PENDING, actor="scheduler", reason="admitted", placement=placement)


def test_an_elastic_attempt_gets_its_batch_sizes_and_lr_factor():
    row = admit(elastic_job(learners=2))
    spec = deploy_spec(row)
    assert (spec.env["TRAINYARD_GLOBAL_BATCH_SIZE"], spec.env["TRAINYARD_LOCAL_BATCH_SIZE"]) == ("64", "32")
    assert spec.env["TRAINYARD_LR_SCALE"] == "1.0"
    assert [learner.env["WORLD_SIZE"] for learner in spec.learners] == ["2", "2"]


def test_the_environment_follows_the_allocation_the_attempt_was_given():
    row = admit(elastic_job(learners=3))  # 64 is no multiple of 3: rounded down to 63
    spec = deploy_spec(row)
    assert (spec.env["TRAINYARD_GLOBAL_BATCH_SIZE"], spec.env["TRAINYARD_LOCAL_BATCH_SIZE"]) == ("63", "21")
    assert float(spec.env["TRAINYARD_LR_SCALE"]) == pytest.approx((63 / 64) ** 0.5)  # lr_scaling: sqrt


def test_a_fixed_job_gets_no_elastic_variables():
    row = job(member(), learners=2)
    row = transition(row.id, Status.PENDING, actor="scheduler", placement=[])
    assert not any(name.startswith("TRAINYARD_") and "BATCH" in name or name == "TRAINYARD_LR_SCALE"
                   for name in deploy_spec(row).env)


def test_each_attempt_opens_an_allocation_row_that_ends_with_its_samples():
    row = admit(elastic_job(learners=2))
    allocation = Allocation.objects.get(job=row, attempt=1)
    assert (allocation.learners, allocation.global_batch, allocation.local_batch, allocation.reason) == (
        2, 64, 32, "admitted")
    assert allocation.placement == [{"node": "local", "gpu_ids": [0]}, {"node": "local", "gpu_ids": [1]}]
    assert allocation.started_at is None
    transition(row.id, Status.PROCESSING, actor="lifecycle-manager", reason="training")
    now = timezone.now()
    for samples in (0, 640, 1280):
        MetricPoint.objects.create(job=row, attempt=1, learner=0, name="samples", value=samples, time=now)
    MetricPoint.objects.create(job=row, attempt=1, learner=1, name="samples", value=99999, time=now)
    transition(row.id, Status.STORING, actor="lifecycle-manager")
    transition(row.id, Status.COMPLETED, actor="lifecycle-manager")
    allocation.refresh_from_db()
    assert allocation.started_at is not None and allocation.ended_at >= allocation.started_at
    assert (allocation.samples_start, allocation.samples_end) == (0, 1280)


def test_a_fixed_job_has_a_timeline_too():
    row = job(member(), learners=1)
    transition(row.id, Status.PENDING, actor="scheduler", placement=[{"node": "local", "gpu_ids": []}])
    allocation = Allocation.objects.get(job=row, attempt=1)
    assert (allocation.learners, allocation.global_batch, allocation.lr_scale) == (1, None, 1.0)
