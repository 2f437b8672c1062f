"""Pollux's traces as job physics (bench/simulator/pollux.py), Tiresias' 2D-LAS (bench/simulator/tiresias.py) and a
short replay (bench/simulator/pollux_replay.py). Expected values are read off the trace files by hand."""

import pytest

from bench.simulator import pollux, tiresias
from bench.simulator.pollux_replay import REPLAY_POLICIES, RESTART_S, replay

needs_data = pytest.mark.skipif(not pollux.available(), reason="Pollux's data (../shared/pollux) is not here")


# --- step time ------------------------------------------------------------------------------------
@needs_data
@pytest.mark.parametrize("app, counts, batch, expected", [
    ("cifar10", (1,), 32, 0.0427886962890625),  # placements.csv "1", local 32
    ("cifar10", (1, 1), 90, 0.1080667495727539),  # "11", local 45
    ("cifar10", (2, 2), 128, 0.147501540184021),  # "22", local 32
    ("cifar10", (4,), 180, 0.06267681121826171),  # "4", local 45
    ("cifar10", (1, 1), 77, (0.1038327932357788 + 0.1080667495727539) / 2),  # local 38.5: halfway 32-45
    ("cifar10", (1,), 8, 0.0427886962890625),  # below the smallest local batch: no cheaper than it
    ("bert", (1,), 12, 0.9215156733989716),
    # local 24 > 12 fits no GPU: 2 micro-steps of 12, each paying the compute part, one sync
    ("bert", (1,), 24, 2 * (0.9215156733989716 - 0.013695754051208497) + 0.013695754051208497),
])
def test_it_reads_step_times_back_from_the_traces(app, counts, batch, expected):
    assert pollux.application(app).step_time(counts, batch) == pytest.approx(expected, rel=1e-9)


@needs_data
def test_it_reads_a_placement_by_its_gpus_per_node_not_their_order():
    app = pollux.application("cifar10")
    assert app.step_time((2, 2, 1, 1), 512) == app.step_time((1, 1, 2, 2), 512) == app.step_time((1, 2, 1, 2), 512)


@needs_data
def test_it_interpolates_shapes_beyond_four_nodes_between_measured_ones():
    app = pollux.application("cifar10")
    five = app.step_time((4,) * 5, 2048)
    four, six = app.step_time((4,) * 4, 2048), app.step_time((4,) * 6, 2048)
    assert min(four, six) <= five <= max(four, six)


# --- statistical efficiency -------------------------------------------------------------------------
def steps_to_target(app, batch):
    """Steps a job at `batch` takes to reach the target, summed over the trace's intervals."""
    ends, gains = app.segments(batch)
    steps, done = 0.0, 0.0
    for end, gain in zip(ends, gains):
        stop = min(end, app.target)
        steps += (stop - done) / gain
        done = stop
        if done >= app.target:
            break
    return steps


@needs_data
@pytest.mark.parametrize("app, batch, iterations", [  # the last row of validation-<batch>.csv
    ("cifar10", 128, 39062), ("cifar10", 1024, 5722), ("imagenet", 3200, 42123), ("yolov3", 128, 8075),
    ("deepspeech2", 320, 2264), ("bert", 96, 1885), ("ncf", 8192, 6122),
])
def test_it_takes_as_many_steps_to_the_target_as_the_trace_did(app, batch, iterations):
    assert steps_to_target(pollux.application(app), batch) == pytest.approx(iterations, rel=0.02)


@needs_data
def test_it_measures_the_noise_scale_only_over_intervals_already_finished():
    app = pollux.application("cifar10")  # validation-512.csv: first interval ends at 392.46
    first = 8.914520446545186 / 8.220063889732206
    assert app.measured_phi(512, 100.0) is None
    assert app.measured_phi(512, 500.0) == pytest.approx(first)
    assert app.measured_phi(512, 392.4631172197553) == pytest.approx(first)  # just finished


@needs_data
@pytest.mark.parametrize("app, batch", [("cifar10", 128), ("cifar10", 1024), ("cifar10", 1500), ("bert", 48),
                                        ("imagenet", 1000), ("yolov3", 100)])
def test_it_gains_at_most_linearly_from_a_bigger_batch(app, batch):
    physics = pollux.application(app)
    _, gains = physics.segments(batch)
    assert all(1.0 - 1e-9 <= g <= batch / physics.b0 * 1.01 for g in gains)


@needs_data
def test_it_interpolates_the_gain_between_traced_batches():
    app = pollux.application("cifar10")
    below, between, above = (app.segments(b)[1][-1] for b in (1024, 1448, 2048))
    assert below < between < above


# --- Tiresias -------------------------------------------------------------------------------------
HOUR = 3600.0


def candidate(name, arrival, gpus=1, attained=0.0, placement=None):
    return tiresias.Candidate(name, arrival, gpus, attained, placement or {})


@pytest.mark.parametrize("jobs, order", [
    ([candidate("a", 0), candidate("b", 10)], ["a", "b"]),  # FIFO inside queue 0
    ([candidate("a", 0, attained=16 * HOUR), candidate("b", 10)], ["b", "a"]),  # 16 GPU-hours: demoted
    ([candidate("a", 0, attained=16 * HOUR - 1), candidate("b", 10)], ["a", "b"]),  # just below: not yet
    ([candidate("a", 0, attained=20 * HOUR), candidate("b", 5, attained=40 * HOUR)], ["a", "b"]),  # FIFO in 1
    ([candidate("c", 9), candidate("a", 0, attained=17 * HOUR), candidate("b", 3)], ["b", "c", "a"]),
])
def test_it_orders_jobs_by_service_queue_then_arrival(jobs, order):
    assert [c.name for c in tiresias.queue_order(jobs)] == order


def test_it_preempts_a_demoted_job_for_a_new_one_and_backfills():
    nodes = {"n0": 4, "n1": 4}
    jobs = [candidate("old", 0, gpus=8, attained=20 * HOUR, placement={"n0": 4, "n1": 4}),
            candidate("new", 50, gpus=4), candidate("small", 60, gpus=2)]
    plan = tiresias.allocate(jobs, nodes)
    assert set(plan) == {"new", "small"}
    assert sum(plan["new"].values()) == 4 and len(plan["new"]) == 1  # packed on one node


def test_it_keeps_a_running_job_on_its_gpus():
    nodes = {"n0": 4, "n1": 4}
    jobs = [candidate("a", 0, gpus=2, placement={"n1": 2}), candidate("b", 5, gpus=4)]
    plan = tiresias.allocate(jobs, nodes)
    assert plan["a"] == {"n1": 2} and plan["b"] == {"n0": 4}


# --- the replay -----------------------------------------------------------------------------------
def lone_job_time(app, counts, batch):
    return steps_to_target(app, batch) * app.step_time(counts, batch)


@needs_data
def test_a_lone_tiresias_job_takes_its_physics_time_plus_one_restart():
    job = pollux.WorkloadJob("cifar10-0", 0.0, "cifar10", 4, 512)
    result = replay([job], "tiresias")
    expected = RESTART_S + lone_job_time(pollux.application("cifar10"), (4,), 512)
    assert result.jobs[0].jct_s == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def short_workload():
    if not pollux.available():
        pytest.skip("Pollux's data (../shared/pollux) is not here")
    # The first jobs of one workload without ImageNet (a full ImageNet run takes hours even alone).
    return [j for j in pollux.workload(1, "0.5") if j.app != "imagenet"][:12]


@needs_data
@pytest.mark.parametrize("policy", REPLAY_POLICIES)
def test_it_runs_every_job_to_its_target(short_workload, policy):
    result = replay(short_workload, policy)
    for job in result.jobs:
        assert job.finished_s is not None and job.progress == job.app.target
        # no faster than the job's whole run on the fastest shape it could have had
        assert job.jct_s >= RESTART_S


@needs_data
def test_trainyard_keeps_the_asked_batch_until_it_has_measured_a_noise_scale(short_workload):
    from bench.simulator.pollux_replay import ElasticDecider, ReplayJob
    decider = ElasticDecider("trainyard", {f"n{i}": 4 for i in range(16)}, RESTART_S)
    spec = short_workload[0]  # DeepSpeech2 at 320, below its largest traced batch (640)
    job = ReplayJob(spec.name, spec.arrival_s, pollux.application(spec.app), spec.gpus, spec.batch, 0)
    assert decider.elastic_job(job).batch_max == spec.batch and decider.elastic_job(job).noise_scale is None
    job.placement, job.batch, job.progress = {"n0": 4}, spec.batch, job.app.target / 2
    assert decider.elastic_job(job).noise_scale is not None
    assert decider.elastic_job(job).batch_max == job.app.max_batch


@needs_data
@pytest.mark.parametrize("policy", ["gpu_only", "paper"])
def test_skipping_a_decision_nothing_changed_for_gives_the_same_replay(short_workload, policy, monkeypatch):
    from bench.simulator import pollux_replay

    skipping = replay(short_workload, policy).jcts()

    class DecidingEveryTime(pollux_replay.ElasticDecider):
        def __call__(self, *args):
            self.last_state = None
            return super().__call__(*args)

    monkeypatch.setattr(pollux_replay, "ElasticDecider", DecidingEveryTime)
    assert replay(short_workload, policy).jcts() == skipping
