"""The utilisation series on /metrics (jobs.prometheus_series.utilisation_gauges): allocated and used GPUs,
CPUs and memory by tenant and node from each learner's latest fresh sample of the current attempt, every
tenant with jobs and every node of the cluster present (0 included), and the jobs flagged idle."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import prometheus_series
from jobs.models import ResourceSample, Status
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def cluster(monkeypatch):
    monkeypatch.setattr(prometheus_series, "cluster_nodes", lambda: ["node-a", "node-b", "node-c"])
    monkeypatch.setattr(prometheus_series, "_nodes_cache", (0.0, ()))


def sample(target, learner, *, busy, cores, memory, attempt=1, age_s=1.0):
    ResourceSample.objects.create(job=target, attempt=attempt, learner=learner,
                                  time=timezone.now() - timedelta(seconds=age_s), cpu_cores=cores,
                                  memory_bytes=memory, memory_peak_bytes=memory, gpus_busy=busy,
                                  gpu_utilization=None if busy is None else busy * 100)


def gauges():
    return {family.name: {tuple(s.labels[k] for k in ("tenant", "node") if k in s.labels): s.value
                          for s in family.samples}
            for family in prometheus_series.utilisation_gauges()}


def test_it_reports_allocated_and_used_by_tenant_and_node():
    alice, eve = member(), member("team-b", "eve")
    wide = job(alice, status=Status.PROCESSING, gpus=2, cpus=4, learners=2, attempt=2,
               placement=[{"node": "node-a", "gpu_ids": [0, 1]}, {"node": "node-b", "gpu_ids": [0, 1]}])
    sample(wide, 0, busy=0.2, cores=9.0, memory=5, attempt=1)  # the attempt before
    sample(wide, 0, busy=1.5, cores=3.0, memory=2**30, attempt=2, age_s=20)
    sample(wide, 0, busy=1.8, cores=3.5, memory=2**31, attempt=2)  # the latest counts
    sample(wide, 1, busy=0.9, cores=1.0, memory=2**30, attempt=2, age_s=3600)  # stale: not counted
    quiet = job(eve, status=Status.PROCESSING, gpus=1, cpus=1,
                placement=[{"node": "node-a", "gpu_ids": [2]}], gpus_idle_since=timezone.now(), gpus_idle_attempt=1)
    sample(quiet, 0, busy=0.0, cores=0.01, memory=2**20)
    job(eve, status=Status.COMPLETED, gpus=8, placement=[{"node": "node-c", "gpu_ids": list(range(8))}])
    series = gauges()
    assert series["trainyard_gpus_allocated"][("team-a", "node-a")] == 2
    assert series["trainyard_gpus_busy"][("team-a", "node-a")] == 1.8
    assert series["trainyard_cpus_used"][("team-a", "node-a")] == 3.5
    assert series["trainyard_memory_used_bytes"][("team-a", "node-a")] == 2**31
    assert series["trainyard_cpus_allocated"][("team-a", "node-b")] == 4
    assert series["trainyard_gpus_busy"][("team-a", "node-b")] == 0  # its only sample is stale
    assert series["trainyard_gpus_allocated"][("team-b", "node-a")] == 1
    assert series["trainyard_gpus_allocated"][("team-b", "node-c")] == 0  # a finished job holds nothing
    assert set(series["trainyard_gpus_busy"]) == {(t, n) for t in ("team-a", "team-b")
                                                  for n in ("node-a", "node-b", "node-c")}
    assert series["trainyard_idle_gpu_jobs"] == {("team-a",): 0, ("team-b",): 1}


def test_a_backend_that_does_not_answer_leaves_the_nodes_jobs_run_on(monkeypatch):
    def down():
        raise RuntimeError("connection refused")
    monkeypatch.setattr(prometheus_series, "cluster_nodes", down)
    job(member(), status=Status.PROCESSING, gpus=1, placement=[{"node": "node-z", "gpu_ids": [0]}])
    assert gauges()["trainyard_gpus_allocated"] == {("team-a", "node-z"): 1}
