import pytest

from gpu_scheduler.core import NodeFree, Request, schedule


def node(name="n1", gpus=0, cpus=8.0, memory=64 * 2**30):
    return NodeFree(name, gpus, cpus, memory, list(range(gpus)))


def request(job_id, *, learners=1, gpus=0, cpus=1.0, memory=2**30, priority="normal", order=0):
    return Request(job_id, learners, gpus, cpus, memory, priority, order)


@pytest.mark.parametrize("requests, nodes, admitted", [
    ([request("a"), request("b", order=1)], [node()], ["a", "b"]),
    ([request("a", cpus=6), request("b", cpus=6, order=1)], [node()], ["a"]),
    # head-of-line blocking: a small job does not overtake a big one that waits
    ([request("big", cpus=9), request("small", order=1)], [node()], []),
    ([request("low", priority="low"), request("high", priority="high", order=1, cpus=8)], [node()], ["high"]),
    # gang: both learners or neither
    ([request("gang", learners=2, gpus=2)], [node(gpus=2), node("n2", gpus=1)], []),
    ([request("gang", learners=2, gpus=2)], [node(gpus=2), node("n2", gpus=2)], ["gang"]),
])
def test_it_admits_in_order_and_as_gangs(requests, nodes, admitted):
    assert list(schedule(requests, nodes).admitted) == admitted


def test_it_assigns_distinct_gpus():
    decisions = schedule([request("a", gpus=1), request("b", gpus=1, order=1)], [node(gpus=2)])
    ids = [p.gpu_ids for job in ("a", "b") for p in decisions.admitted[job]]
    assert sorted(ids) == [(0,), (1,)]


def test_it_says_why_a_job_waits():
    decisions = schedule([request("a", gpus=4), request("b", order=1)], [node(gpus=2)])
    assert decisions.waiting["a"] == "waiting: needs 4 GPUs on one node; largest free block is 2"
    assert decisions.waiting["b"] == "2nd in queue, behind a"
