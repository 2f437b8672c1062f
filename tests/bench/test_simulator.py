"""The simulator: traces in and out, the synthetic generator's shape, and runs small enough to check
by hand."""
import statistics

import pytest

from gpu_scheduler import Policy
from bench.simulator import (Simulation, TraceError, TraceJob, equal_quotas, jain_index, read_csv,
                                     summarise, synthetic_trace, write_csv)
from tests.support.scheduler_builders import node, nodes

GIB = 2**30


def trace_job(job_id, arrival, duration, *, learners=1, gpus=8, priority="normal", tenant="t"):
    return TraceJob(job_id, arrival, tenant, "u", learners, gpus, 4.0 * gpus, 16 * GIB * gpus, duration, priority)


def run(trace, cluster, policy=None, **kwargs):
    return Simulation(trace, cluster, policy=policy or Policy.full(), **kwargs).run()


def finished(result):
    return {j.spec.job_id: j.finished_s for j in result.jobs}


# --- hand-checked runs -------------------------------------------------------------------------------
def test_it_runs_jobs_one_after_another_when_they_do_not_fit_together():
    result = run([trace_job("a", 0, 100), trace_job("b", 0, 50)], [node()])
    assert finished(result) == {"a": 100, "b": 150}
    assert {j.spec.job_id: j.queue_s for j in result.jobs} == {"a": 0, "b": 100}
    figures = summarise(result)
    assert figures["mean_jct_s"] == 125
    assert figures["utilization"] == pytest.approx(1.0)


def test_a_preempted_job_loses_only_the_work_since_its_last_checkpoint():
    trace = [trace_job("low", 0, 3000, priority="low"), trace_job("high", 1000, 100, priority="high")]
    result = run(trace, [node()], checkpoint_interval_s=600, halt_seconds=60)
    low = next(j for j in result.jobs if j.spec.job_id == "low")
    # halted at 1000 (600 s checkpointed, 400 s lost), stopped at 1060; high runs 1060-1160;
    # low resumes with 2400 s left and ends at 3560
    assert finished(result) == {"low": 3560, "high": 1160}
    assert low.preemptions == 1 and low.lost_gpu_s == 400 * 8


def test_the_pod_by_pod_baseline_partly_places_a_gang_and_idles_its_gpus():
    trace = [trace_job("a", 0, 1000, gpus=1), trace_job("g", 1, 100, learners=2), trace_job("c", 2, 500)]
    baseline = run(trace, nodes(2), Policy.fifo_spread())
    gang = run(trace, nodes(2), Policy.full())
    # baseline: g's first learner holds n2 from t=1 while its second waits for a to end; c cannot start
    assert baseline.partial_gangs == 1 and finished(baseline) == {"a": 1000, "g": 1100, "c": 1600}
    # gang: g waits whole, so c runs on n2 meanwhile
    assert gang.partial_gangs == 0 and finished(gang) == {"a": 1000, "c": 502, "g": 1100}
    assert summarise(baseline)["utilization_while_waiting"] < summarise(gang)["utilization_while_waiting"]


def test_every_cycle_goes_through_the_real_scheduler():
    seen = []
    run([trace_job("a", 0, 10), trace_job("b", 5, 10)], [node()],
        observer=lambda snapshot, queued, decisions: seen.append([w.job_id for w in queued]))
    assert seen == [["a"], ["b"], ["b"]]  # a arrives; b arrives while a runs; a ends


def test_equal_quotas_split_the_cluster_between_the_traces_tenants():
    quotas = equal_quotas([trace_job("a", 0, 1, tenant="x"), trace_job("b", 0, 1, tenant="y")], nodes(2))
    assert {name: policy.quota.gpus for name, policy in quotas.items()} == {"x": 8, "y": 8}
    assert all(policy.can_borrow for policy in quotas.values())


# --- metrics ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, expected", [([1, 1, 1], 1.0), ([1, 0], 0.5), ([0.5, 1.0], 0.9)])
def test_jain_index(values, expected):
    assert jain_index(values) == pytest.approx(expected)


# --- CSV -----------------------------------------------------------------------------------------------------
def test_a_trace_survives_a_csv_round_trip(tmp_path):
    trace = synthetic_trace(50, seed=3, cluster_gpus=64)
    write_csv(trace, tmp_path / "trace.csv")
    again = read_csv(tmp_path / "trace.csv")
    assert [(j.job_id, j.learners, j.gpus, j.priority, j.tenant) for j in again] == \
        [(j.job_id, j.learners, j.gpus, j.priority, j.tenant) for j in trace]
    assert [j.duration_s for j in again] == pytest.approx([j.duration_s for j in trace])


def test_a_minimal_csv_takes_defaults(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("job_id,arrival_s,tenant,gpus_per_learner,duration_s\nj1,0,lab,2,60\n")
    (job,) = read_csv(path)
    assert (job.learners, job.cpus, job.memory_bytes, job.priority, job.user) == (1, 8.0, 32 * GIB, "normal", "lab")


@pytest.mark.parametrize("text, message", [
    ("job_id,tenant\nj1,lab\n", "missing column\\(s\\) arrival_s, gpus_per_learner, duration_s"),
    ("job_id,arrival_s,tenant,gpus_per_learner,duration_s\nj1,0,lab,two,60\n",
     "line 2: column 'gpus_per_learner' must be int, got 'two'"),
    ("job_id,arrival_s,tenant,gpus_per_learner,duration_s\nj1,0,lab,1,0\n", "line 2: .*duration_s must be > 0"),
    ("job_id,arrival_s,tenant,gpus_per_learner,duration_s,priority\nj1,0,lab,1,5,urgent\n",
     "line 2: .*priority must be low, normal or high"),
    ("job_id,arrival_s,tenant,gpus_per_learner,duration_s\nj1,0,lab,1,5\nj1,1,lab,1,5\n",
     "line 3: job_id 'j1' appears twice"),
])
def test_a_bad_csv_is_rejected_naming_the_line_and_column(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        read_csv(path)


# --- the synthetic generator ------------------------------------------------------------------------------------
def test_the_synthetic_trace_has_ffdls_shape():
    trace = synthetic_trace(4000, seed=1, cluster_gpus=256)
    single = sum(j.learners == 1 for j in trace) / len(trace)
    one_gpu = sum(j.gpus == 1 for j in trace) / len(trace)
    durations = sorted(j.duration_s for j in trace)
    median, p99 = statistics.median(durations), durations[int(0.99 * len(durations))]
    assert 0.75 < single < 0.85 and 0.45 < one_gpu < 0.55
    assert 900 < median < 1500 and p99 > 20 * median  # heavy tail
    assert trace == synthetic_trace(4000, seed=1, cluster_gpus=256)
    assert trace != synthetic_trace(4000, seed=2, cluster_gpus=256)


def test_the_synthetic_trace_offers_the_requested_load():
    trace = synthetic_trace(3000, seed=5, cluster_gpus=128, load=0.8, sweep_fraction=0.0)
    span = trace[-1].arrival_s - trace[0].arrival_s
    offered = sum(j.gpu_seconds for j in trace) / (128 * span)
    assert offered == pytest.approx(0.8, rel=0.1)


def test_sweeps_submit_batches_at_one_instant():
    trace = synthetic_trace(2000, seed=9, cluster_gpus=128, sweep_fraction=0.5)
    batch_sizes = statistics.Counter(j.arrival_s for j in trace)
    in_batches = sum(size for size in batch_sizes.values() if size > 1) / len(trace)
    assert 0.4 < in_batches < 0.6


def test_a_small_trace_completes_under_every_policy():
    trace = synthetic_trace(60, seed=4, cluster_gpus=32, load=1.2)
    cluster = nodes(4)
    for policy in (Policy.fifo_spread(), Policy.kueue_like(), Policy.full()):
        figures = summarise(run(trace, cluster, policy, tenants=equal_quotas(trace, cluster)))
        assert figures["unfinished"] == 0, policy.name
        assert 0 < figures["utilization"] <= 1
