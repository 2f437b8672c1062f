"""A hostile queue must not make the cycle slow for everyone: what a job of a new shape costs the
cycle may not grow with the size of the cluster."""
import pytest

from gpu_scheduler import Policy, placement, schedule
from tests.support.scheduler_builders import job, nodes, running, snapshot

NODES, QUEUED = 400, 200


@pytest.fixture
def hosted_calls(monkeypatch):
    """How often the cycle asks how many learners of a shape a node's amounts hold."""
    calls = []
    real = placement.learners_hosted

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(placement, "learners_hosted", counting)
    return calls


@pytest.mark.parametrize("gpus", [1, 0], ids=["gpu-jobs", "cpu-only-jobs"])
def test_a_queue_of_jobs_each_of_its_own_shape_costs_no_scan_of_the_cluster_per_job(hosted_calls, gpus):
    """A full cluster of identical nodes; one tenant queues jobs that differ by a thousandth of a CPU
    (each a shape of its own, so nothing learnt of one serves the next)."""
    cluster = nodes(NODES)
    busy = [running(f"r{i}", (node.name, tuple(range(8))), cpus=60.0, tenant="busy") for i, node in enumerate(cluster)]
    queue = [job(f"q{i:04d}", tenant="hostile", gpus=gpus, cpus=8.0 + i / 1000, order=i) for i in range(QUEUED)]
    decisions = schedule(snapshot(cluster, *busy), queue, Policy.full())
    assert not decisions.admitted and len(decisions.waiting) == QUEUED
    # What may grow with the cluster is bounded per cycle: the preemption checks' tallies.
    per_cycle = Policy.full().preemption_checks * NODES
    assert len(hosted_calls) < QUEUED * 20 + per_cycle, "a node-by-node scan per queued job"
