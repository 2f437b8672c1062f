"""The elastic simulator (bench/simulator/elastic.py): small seeded traces, every policy."""
import pytest

from gpu_scheduler.elastic import POLICIES, ElasticPolicy
from bench.simulator.elastic import elastic_trace, run_elastic

NODES = {f"n{i}": 4 for i in range(4)}


@pytest.fixture(scope="module")
def trace():
    return elastic_trace(30, seed=5, cluster_gpus=16, load=1.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_it_completes_every_admitted_job(trace, policy):
    result = run_elastic(trace, NODES, policy=ElasticPolicy(policy), admission_limit=100)
    assert result.dropped() == 0
    assert all(r.finished_s is not None and r.finished_s >= r.spec.arrival_s for r in result.records)


def test_it_drops_arrivals_beyond_the_admission_limit(trace):
    result = run_elastic(trace, NODES, policy=ElasticPolicy("fixed"), admission_limit=2)
    assert result.dropped() > 0
    assert all(r.finished_s is None for r in result.records if r.dropped)


def test_it_never_restarts_fixed_jobs(trace):
    assert run_elastic(trace, NODES, policy=ElasticPolicy("fixed")).restarts_per_job() == 0


def test_it_makes_big_batches_cost_samples_with_the_efficiency_model(trace):
    on = run_elastic(trace, NODES, policy=ElasticPolicy("paper"), efficiency_model=True)
    off = run_elastic(trace, NODES, policy=ElasticPolicy("paper"), efficiency_model=False)
    assert on.mean_jct_s() > off.mean_jct_s()


def test_it_is_deterministic_for_a_seed(trace):
    runs = [run_elastic(trace, NODES, policy=ElasticPolicy("trainyard"), seed=3).mean_jct_s() for _ in range(2)]
    assert runs[0] == runs[1]
