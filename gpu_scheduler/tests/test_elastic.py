"""The elastic optimizer (gpu_scheduler/elastic.py) and its throughput model: table-driven cases with
small builders, and hypothesis invariants (capacity, quotas, per-job bounds, whole learners on one
node, the DP equal to brute force)."""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_scheduler.elastic import (POLICIES, ElasticCluster, ElasticJob, ElasticPolicy, FreeGPUs, allocate, backtrack,
                                   knapsack, optimize, place_learners)
from gpu_scheduler.throughput import FFDL_RESNET, GENERIC_PRIOR, efficiency, fit, noise_scale

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def ejob(job_id, *, tenant="t1", lo=1, hi=4, per=1, base=256, requested=1, noise=2000.0, **extra):
    """An elastic job (FfDL's ResNet scaling, batch 32-4,096); pass learners/batch/placement to run it."""
    return ElasticJob(job_id, tenant, lo, hi, per, base, 32, 4096, requested_learners=requested,
                      model=FFDL_RESNET, noise_scale=noise, **extra)


def cluster(*gpus, **quotas):
    return ElasticCluster({f"n{i + 1}": g for i, g in enumerate(gpus)}, quotas)


# --- throughput model ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus,nodes,rate", [(1, 1, 313), (2, 1, 539), (4, 1, 929)])
def test_it_reproduces_ffdl_measurements(gpus, nodes, rate):
    assert FFDL_RESNET.throughput(gpus, nodes, 32 * gpus) == pytest.approx(rate, rel=1e-6)


def test_it_reproduces_ffdl_two_learner_scaling():
    one, two = FFDL_RESNET.throughput(4, 1, 128), FFDL_RESNET.throughput(8, 2, 256)
    assert two / one == pytest.approx(1752 / 1040, rel=1e-3)


def test_it_fits_observations_over_the_prior():
    observed = [(g, n, m, FFDL_RESNET.step_time(g, n, m)) for g, n in [(1, 1), (2, 1), (4, 1), (8, 2), (16, 4)]
                for m in (16, 64)]
    model = fit(observed, GENERIC_PRIOR)
    for g, n, m in [(1, 1, 32), (4, 1, 128), (8, 2, 512)]:
        assert model.throughput(g, n, m) == pytest.approx(FFDL_RESNET.throughput(g, n, m), rel=0.05)


def test_it_keeps_the_prior_without_observations():
    assert fit([], GENERIC_PRIOR) == GENERIC_PRIOR


@pytest.mark.parametrize("batch,noise,expected", [(256, 2000.0, 1.0), (512, 256.0, 0.5 * 512 / 384),
                                                  (4096, None, 1.0)])
def test_it_discounts_large_batches_by_the_noise_scale(batch, noise, expected):
    assert efficiency(batch, 256, noise) == pytest.approx((noise + 256) / (noise + batch) if noise else expected)


@pytest.mark.parametrize("true_sq,trace", [(1.0, 500.0), (0.01, 40.0), (4.0, 4000.0)])
def test_it_estimates_the_noise_scale_from_two_batch_sizes(true_sq, trace):
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B: the estimator inverts it exactly on expected values.
    small, big = 32, 256
    estimate = noise_scale(small, true_sq + trace / small, big, true_sq + trace / big)
    assert estimate == pytest.approx(trace / true_sq)


def test_it_has_no_noise_scale_while_the_estimate_is_not_positive():
    assert noise_scale(32, 1.0, 256, 2.0) is None


# --- policies ----------------------------------------------------------------------------------------
def test_it_keeps_fixed_jobs_at_their_request_in_submission_order():
    targets = optimize([ejob("a", requested=3, order=0), ejob("b", requested=2, order=1),
                        ejob("c", requested=1, order=2)], cluster(4), ElasticPolicy("fixed"))
    assert [targets[j].learners for j in "abc"] == [3, 0, 1]  # c backfills


def test_it_never_changes_the_batch_under_gpu_only():
    targets = optimize([ejob("a", hi=8), ejob("b", hi=8)], cluster(8, 8), ElasticPolicy("gpu_only"))
    assert {t.batch for t in targets.values()} == {256}
    assert sum(t.learners for t in targets.values()) == 16


def test_it_grows_the_batch_for_throughput_under_paper():
    targets = optimize([ejob("a", hi=8)], cluster(8), ElasticPolicy("paper"))
    assert targets["a"].batch == 4096


def test_it_keeps_a_small_noise_scale_job_near_its_batch_under_trainyard():
    targets = optimize([ejob("a", hi=8, noise=64.0)], cluster(8), ElasticPolicy("trainyard"))
    assert targets["a"].batch <= 512


@pytest.mark.parametrize("running", [False, True])
def test_it_never_gives_a_job_without_a_noise_scale_a_larger_batch_under_trainyard(running):
    # Without a noise scale its efficiency reads 1: throughput alone would take the largest batch (4,096).
    shape = dict(learners=1, batch=256, placement=("n1",), started_s=0.0) if running else {}
    targets = optimize([ejob("a", hi=8, noise=None, **shape)], cluster(8), ElasticPolicy("trainyard"), now=10**6)
    assert targets["a"].learners == 8 and targets["a"].batch <= 256


def test_a_job_without_a_noise_scale_scales_its_gpus_at_its_own_batch_among_others():
    targets = optimize([ejob("a", hi=8, noise=None), ejob("b", hi=8, noise=None)], cluster(8, 8),
                       ElasticPolicy("trainyard"))
    assert all(t.batch <= 256 for t in targets.values()) and sum(t.learners for t in targets.values()) == 16


def test_a_large_noise_scale_lets_the_batch_grow_under_trainyard():
    small = optimize([ejob("a", hi=8, noise=32.0)], cluster(8), ElasticPolicy("trainyard"))["a"]
    large = optimize([ejob("a", hi=8, noise=10**6)], cluster(8), ElasticPolicy("trainyard"))["a"]
    assert small.batch <= 256 < large.batch


def test_it_admits_a_waiting_job_before_growing_a_running_one_under_trainyard():
    running = ejob("a", hi=8, learners=8, batch=256, placement=("n1",) * 8, started_s=0.0)
    targets = optimize([running, ejob("b", hi=8)], cluster(8), ElasticPolicy("trainyard"), now=10.0)
    assert targets["b"].learners >= 1 and targets["a"].learners >= 1


def test_it_does_not_resize_a_young_job_for_a_small_gain():
    running = ejob("a", hi=2, learners=1, batch=256, placement=("n1",), started_s=0.0, restart_s=10**6)
    targets = optimize([running], cluster(8), ElasticPolicy("trainyard"), now=1.0)
    assert (targets["a"].learners, targets["a"].batch) == (1, 256)


@pytest.mark.parametrize("live,batch_moves", [(False, False), (True, True)])
def test_a_batch_change_at_its_size_costs_a_job_that_changes_it_live_no_restart(live, batch_moves):
    # A young job whose restart costs more than any gain: it keeps its shape, unless its learners change
    # their batch while they run, when the better batch at its size is free to take.
    running = ejob("a", hi=1, learners=1, batch=256, placement=("n1",), started_s=0.0, restart_s=10**6,
                   noise=10**6, live_batch=live)
    target = optimize([running], cluster(8), ElasticPolicy("trainyard"), now=1.0)["a"]
    assert target.learners == 1 and (target.batch != 256) == batch_moves


def test_it_keeps_a_running_job_at_least_at_its_minimum():
    big = ejob("a", lo=2, hi=8, learners=2, batch=256, placement=("n1", "n1"))
    targets = optimize([big] + [ejob(f"q{i}") for i in range(6)], cluster(4), ElasticPolicy("paper"))
    assert targets["a"].learners >= 2


def test_it_waits_rather_than_splits_a_learner():
    targets = optimize([ejob("a", per=4, hi=1)], cluster(2, 2), ElasticPolicy("paper"))
    assert targets["a"].learners == 0


# --- the DP against brute force -------------------------------------------------------------------------
def brute_force(option_lists, tenant_of, quotas, capacity):
    best = None
    for combo in itertools.product(*[range(len(o)) for o in option_lists.values()]):
        chosen = dict(zip(option_lists, combo))
        gpus = sum(option_lists[j][i][0] for j, i in chosen.items())
        per_tenant = {}
        for j, i in chosen.items():
            per_tenant[tenant_of[j]] = per_tenant.get(tenant_of[j], 0) + option_lists[j][i][0]
        if gpus > capacity or any(quotas.get(t) is not None and g > quotas[t] for t, g in per_tenant.items()):
            continue
        value = sum(option_lists[j][i][1] for j, i in chosen.items())
        best = value if best is None else max(best, value)
    return best


option = st.tuples(st.integers(0, 5), st.floats(-5, 5, allow_nan=False).map(lambda v: round(v, 3)))


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from("xy"), st.lists(option, min_size=1, max_size=3)), min_size=1, max_size=4),
       st.integers(0, 10), st.one_of(st.none(), st.integers(0, 8)))
def test_it_finds_the_brute_force_optimum(items, capacity, quota_x):
    option_lists = {f"j{i}": [(0, 0.0)] + opts for i, (_, opts) in enumerate(items)}
    tenant_of = {f"j{i}": t for i, (t, _) in enumerate(items)}
    quotas = {"x": quota_x}
    picked = allocate(option_lists, tenant_of, quotas, capacity)
    value = sum(option_lists[j][i][1] for j, i in picked.items())
    assert value == pytest.approx(brute_force(option_lists, tenant_of, quotas, capacity), abs=1e-9)


def test_it_reports_infeasible_as_minus_infinity_in_the_table():
    table, _ = knapsack([[(3, 1.0)]], 2)
    assert table[2] < -1e17


@SETTINGS
@given(st.lists(st.lists(option, min_size=1, max_size=4), min_size=1, max_size=5), st.integers(0, 12))
def test_it_finds_the_same_optimum_and_choices_when_asked_at_one_budget(option_lists, capacity):
    full, full_steps = knapsack(option_lists, capacity)
    one, one_steps = knapsack(option_lists, capacity, only_at=capacity)
    assert one[capacity] == full[capacity]
    if full[capacity] > -1e17:
        assert backtrack(one_steps, capacity) == backtrack(full_steps, capacity)


@pytest.mark.parametrize("free,gpus,count,expected", [
    ({"a": 8, "b": 2, "c": 4}, 2, 3, ["b", "c", "c"]),  # fullest that fits first, then the next fullest
    ({"a": 4, "b": 4}, 4, 1, ["a"]),  # equals: by name
    ({"a": 1, "b": 3}, 2, 2, ["b"]),  # what does not fit is left out
])
def test_it_places_learners_best_fit(free, gpus, count, expected):
    assert place_learners(FreeGPUs(free), gpus, count) == expected


# --- invariants of whole plans ------------------------------------------------------------------------
@st.composite
def snapshots(draw):
    node_gpus = draw(st.lists(st.sampled_from([2, 4, 8]), min_size=1, max_size=4))
    nodes = {f"n{i}": g for i, g in enumerate(node_gpus)}
    free = dict(nodes)
    quotas = {t: draw(st.one_of(st.none(), st.integers(0, 16))) for t in ("t1", "t2")}
    used = {"t1": 0, "t2": 0}
    jobs = []
    for i in range(draw(st.integers(1, 6))):
        per = draw(st.sampled_from([1, 2, 4]))
        lo = draw(st.integers(1, 2))
        hi = lo + draw(st.integers(0, 4))
        tenant = draw(st.sampled_from(["t1", "t2"]))
        running = {}
        learners = draw(st.integers(0, hi))
        if learners >= lo:  # a consistent running job: placed whole, within its quota
            where = []
            for _ in range(learners):
                fitting = [n for n, f in free.items() if f >= per]
                if not fitting:
                    break
                free[fitting[0]] -= per
                where.append(fitting[0])
            q = quotas[tenant]
            if len(where) == learners and (q is None or used[tenant] + learners * per <= q):
                used[tenant] += learners * per
                running = dict(learners=learners, batch=256, placement=tuple(where), started_s=0.0)
            else:
                for n in where:
                    free[n] += per
        jobs.append(ejob(f"j{i}", tenant=tenant, lo=lo, hi=hi, per=per, requested=draw(st.integers(lo, hi)),
                         noise=draw(st.sampled_from([None, 100.0, 5000.0])), order=i, **running))
    return jobs, ElasticCluster(nodes, quotas), draw(st.sampled_from(POLICIES))


@SETTINGS
@given(snapshots())
def test_it_never_exceeds_capacity_quotas_or_job_bounds(case):
    jobs, clu, policy_name = case
    targets = optimize(jobs, clu, ElasticPolicy(policy_name), now=100.0)
    per_node, per_tenant = {}, {}
    for job in jobs:
        target = targets[job.job_id]
        assert len(target.placement) == target.learners  # each learner on exactly one node, whole
        if target.learners:
            assert job.min_learners <= target.learners <= max(job.max_learners, job.requested_learners)
            assert job.batch_min <= target.batch <= job.batch_max or target.batch == job.base_batch
            assert target.batch >= target.learners * job.gpus_per_learner
        if job.running:
            assert target.learners >= job.min_learners
        for node in target.placement:
            per_node[node] = per_node.get(node, 0) + job.gpus_per_learner
        per_tenant[job.tenant] = per_tenant.get(job.tenant, 0) + target.learners * job.gpus_per_learner
    assert all(per_node[n] <= clu.nodes[n] for n in per_node)
    assert all(clu.quotas.get(t) is None or g <= clu.quotas[t] for t, g in per_tenant.items())
