"""Elastic jobs on the platform: the per-attempt environment, the allocation timeline, resizes."""
import pytest
from django.utils import timezone

from jobs.lifecycle import deploy_spec
from jobs.models import Allocation, Job, Learner, MetricPoint, ResourceSample, Status
from jobs.states import transition
from tests.support.builders import ELASTIC_MANIFEST as ELASTIC, job, member, torn_down

pytestmark = pytest.mark.django_db


def elastic_job(tenant="team-a", username="alice", **fields):
    fields.setdefault("learners", 2)
    return job(member(tenant, username), manifest_yaml=ELASTIC, gpus=1, **fields)


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


# --- admission and resizes -----------------------------------------------------------------------
@pytest.fixture
def cluster(monkeypatch):
    """cluster(gpus=4): the backend reports one node of this many GPUs to the scheduler."""
    from types import SimpleNamespace

    from jobs import admission
    from jobs.backends.base import Capacity, Node

    def make(gpus=4):
        capacity = Capacity(nodes=(Node("local", gpus, 64.0, 256 * 2**30),))
        monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
    return make


@pytest.fixture
def sent(monkeypatch):
    from tests.support.builders import record_sends
    return record_sends(monkeypatch)


def running(row, learners=None, gpus=None):
    """Admit the job on the given GPUs (or the first `learners`) and have every learner run."""
    from tests.support.builders import running_on
    return running_on(row, gpus if gpus is not None else list(range(learners)))


def learners_stop(row, *, reasons=()):
    """Every learner of the current attempt exits 0 (or as `reasons` say); the attempt is finished."""
    from jobs import lifecycle
    for learner in Learner.objects.filter(job=row, attempt=row.attempt):
        learner.state, learner.exit_code = Learner.State.EXITED, 0
        learner.reason = dict(enumerate(reasons)).get(learner.index, "")
        learner.save()
    lifecycle.finish_attempt(row.id, row.attempt)
    return Job.objects.get(pk=row.pk)


def test_an_elastic_job_starts_smaller_when_its_start_size_does_not_fit(cluster, sent):
    from jobs import admission
    cluster(gpus=4)
    busy = job(member(), gpus=3, learners=1)
    admission.run_cycle()
    elastic = elastic_job(learners=2)
    admission.run_cycle()
    elastic.refresh_from_db()
    assert Job.objects.get(pk=busy.pk).status == Status.PENDING
    assert (elastic.status, elastic.learners, len(elastic.placement)) == (Status.PENDING, 1, 1)
    assert "admitted with 1 of its 2 learners" in elastic.status_reason
    assert Allocation.objects.get(job=elastic, attempt=1).learners == 1


def test_a_resize_goes_on_as_the_next_attempt_without_the_queue(sent):
    from jobs import lifecycle
    from tenants.models import UsageRecord
    row = running(elastic_job(learners=1), gpus=[0])
    MetricPoint.objects.create(job=row, attempt=1, learner=0, name="samples", value=640, time=timezone.now())
    placement = [{"node": "local", "gpu_ids": [g]} for g in (0, 1, 2)]
    pending = lifecycle.resize(row, learners=3, placement=placement, why="idle GPUs", actor="autoscaler")
    assert pending.reason == "resized 1→3 learners, batch 64→63: idle GPUs"
    row.refresh_from_db()
    assert row.status == Status.HALTING and row.learners == 1
    assert row.placement == placement  # the new GPUs are held for it while it checkpoints
    row = learners_stop(row)
    assert (row.status, row.attempt, row.learners, row.placement) == (Status.PENDING, 2, 3, placement)
    statuses = list(row.events.values_list("to_status", flat=True))
    assert statuses[-3:] == [Status.HALTING, Status.STORING, Status.PENDING] and Status.QUEUED not in statuses[1:]
    assert row.events.last().reason.startswith("resized 1→3 learners, batch 64→63: idle GPUs (")
    from tests.support.builders import open_follow_ups
    assert {("teardown", 1), ("deploy", 2)} <= set(open_follow_ups(row))
    spec = deploy_spec(row)
    assert [lr.env["WORLD_SIZE"] for lr in spec.learners] == ["3"] * 3
    assert (spec.env["TRAINYARD_GLOBAL_BATCH_SIZE"], spec.env["TRAINYARD_LOCAL_BATCH_SIZE"]) == ("63", "21")
    for index in range(3):
        Learner.objects.create(job=row, attempt=2, index=index, state=Learner.State.RUNNING)
    transition(row.id, Status.PROCESSING, actor="lifecycle-manager", reason="training")
    first, second = Allocation.objects.filter(job=row).order_by("attempt")
    assert first.ended_at is not None and first.samples_end == 640
    assert second.samples_start == 640 and second.resize_cost_s >= 0 and second.started_at is not None
    usage = list(UsageRecord.objects.filter(job=row).order_by("attempt").values_list("attempt", "gpus", "ended_at"))
    assert [(a, g) for a, g, _ in usage] == [(1, 1), (2, 3)] and usage[0][2] and usage[1][2] is None


def test_a_learner_that_ignores_the_resize_signal_is_killed_and_named(sent):
    from jobs import lifecycle
    row = running(elastic_job(learners=2), gpus=[0, 1])
    lifecycle.resize(row, learners=1, placement=[{"node": "local", "gpu_ids": [0]}], why="test", actor="autoscaler")
    row = learners_stop(Job.objects.get(pk=row.pk), reasons=["", "killed: ignored SIGTERM for 1s"])
    assert row.status == Status.PENDING and row.learners == 1
    assert "learner 1 ignored the signal and was killed after the grace period" in row.status_reason


def test_a_resize_of_a_job_that_stopped_running_changes_nothing(sent):
    from jobs import lifecycle
    row = running(elastic_job(learners=1), gpus=[0])
    transition(row.id, Status.TERMINATED, actor="alice")
    assert lifecycle.resize(row, learners=2, placement=[{"node": "local", "gpu_ids": [g]} for g in (0, 1)],
                            why="idle GPUs", actor="autoscaler") is None
    assert not Allocation.objects.filter(job=row, attempt=2).exists()


def test_queued_work_shrinks_an_elastic_job_before_anything_is_preempted(cluster, sent):
    from jobs import admission
    cluster(gpus=4)
    alice = member()
    elastic = running(elastic_job(learners=3), gpus=[0, 1, 2])
    fixed = running(job(alice, gpus=1, learners=1, priority="low"), gpus=[3])
    urgent = job(alice, gpus=1, learners=2, priority="high")
    admission.run_cycle()
    elastic.refresh_from_db()
    assert Job.objects.get(pk=fixed.pk).status == Status.PROCESSING  # not preempted
    assert elastic.status == Status.HALTING
    assert Allocation.objects.get(job=elastic, attempt=2).learners == 1
    assert f"making room for job {urgent.id}" in elastic.status_reason
    waiting = Job.objects.get(pk=urgent.pk)
    assert waiting.status == Status.QUEUED and f"for elastic job {elastic.id} to shrink" in waiting.wait_reason
    learners_stop(elastic)
    admission.run_cycle()
    assert Job.objects.get(pk=urgent.pk).status == Status.PENDING
    elastic.refresh_from_db()
    assert (elastic.learners, elastic.attempt) == (1, 2)


def test_another_tenants_wait_reason_does_not_name_the_elastic_job(cluster, sent):
    from jobs import admission
    cluster(gpus=4)
    elastic = running(elastic_job(learners=4), gpus=[0, 1, 2, 3])
    other = job(member("team-b", "bob"), gpus=1, learners=1)
    admission.run_cycle()
    reason = Job.objects.get(pk=other.pk).wait_reason
    assert elastic.id not in reason and "a job of another tenant" in reason
    assert other.id not in Job.objects.get(pk=elastic.pk).status_reason


# --- the autoscaler ------------------------------------------------------------------------------
@pytest.fixture
def four_gpus(cluster, monkeypatch, settings):
    from types import SimpleNamespace

    from jobs import admission, autoscaler
    cluster(gpus=4)
    monkeypatch.setattr(autoscaler, "get_backend", admission.get_backend)
    settings.ELASTIC_HORIZON_S, settings.ELASTIC_MIN_INTERVAL_S, settings.ELASTIC_RESIZE_COST_S = 600.0, 300.0, 20.0
    settings.ELASTIC_GROW_SETTLE_S = 0.0  # the settle window has its own tests
    return SimpleNamespace(run=autoscaler.run, settings=settings)


def reports(row, *points, attempt=None):
    """Learner 0's cumulative `samples` at (seconds ago, samples)."""
    now = timezone.now()
    for ago, samples in points:
        MetricPoint.objects.create(job=row, attempt=attempt or row.attempt, learner=0, name="samples", value=samples,
                                   time=now - timezone.timedelta(seconds=ago))


def test_the_scheduling_loops_cycle_grows_an_elastic_job_onto_what_it_left_idle(four_gpus, sent):
    from jobs import scheduler_loop
    row = running(elastic_job(learners=1), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    scheduler_loop.run_cycle()  # nothing queued: the cycle admits nothing, the autoscaler's pass follows
    row.refresh_from_db()
    assert row.status == Status.HALTING and row.events.last().actor == "autoscaler"


def test_a_pass_without_an_elastic_job_running_reads_nothing_else(four_gpus, sent, django_assert_num_queries):
    running(job(member(), gpus=1), gpus=[0])
    with django_assert_num_queries(1):
        assert four_gpus.run() == []


def test_the_autoscaler_grows_an_elastic_job_onto_idle_gpus(four_gpus, sent):
    row = running(elastic_job(learners=2), gpus=[0, 1])
    reports(row, (20, 0), (0, 2000))  # 100 samples/s at two learners
    resized, = four_gpus.run()
    row.refresh_from_db()
    assert row.status == Status.HALTING and resized.learners == 4
    # It reports no noise scale: its learners change, its global batch stays the manifest's.
    assert resized.reason == "resized 2→4 learners, batch 64→64: idle GPUs"
    assert sorted(g for p in resized.placement for g in p["gpu_ids"]) == [0, 1, 2, 3]
    assert row.events.last().actor == "autoscaler"


def test_it_leaves_gpus_other_jobs_hold_alone(four_gpus, sent):
    row = running(elastic_job(learners=1), gpus=[0])
    running(job(member(), gpus=1, learners=2), gpus=[2, 3])
    reports(row, (20, 0), (0, 2000))
    resized, = four_gpus.run()
    assert resized.learners == 2 and resized.placement[1] == {"node": "local", "gpu_ids": [1]}


def test_it_does_not_resize_when_the_gain_does_not_beat_the_resize_cost(four_gpus, sent):
    four_gpus.settings.ELASTIC_HORIZON_S = 5.0  # even 4x the speed for 5 s cannot pay a 20 s restart
    row = running(elastic_job(learners=1), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    assert four_gpus.run() == []
    assert Job.objects.get(pk=row.pk).status == Status.PROCESSING


def test_it_does_not_resize_a_job_again_within_the_minimum_interval(four_gpus, sent):
    row = running(elastic_job(learners=1), gpus=[0])
    Allocation.objects.filter(job=row, attempt=1).update(resize_requested_at=timezone.now(), resize_cost_s=3.0)
    reports(row, (20, 0), (0, 2000))
    assert four_gpus.run() == []
    four_gpus.settings.ELASTIC_MIN_INTERVAL_S = 0.0
    assert [r.learners for r in four_gpus.run()] == [2]


def test_it_uses_the_measured_resize_cost(four_gpus, sent):
    from jobs import autoscaler
    row = running(elastic_job(learners=1), gpus=[0])
    assert autoscaler._resize_cost_s(row) == 20.0  # nothing measured yet: the configured guess
    Allocation.objects.filter(job=row, attempt=1).update(resize_cost_s=7.5)
    assert autoscaler._resize_cost_s(row) == 7.5


def test_a_grow_waits_until_gpus_stop_being_released_then_takes_them_all(four_gpus, sent):
    """Two jobs ending a moment apart: no grow onto the first one's GPU alone (a second restart for the
    other's, or an idle GPU for TRAINYARD_ELASTIC_MIN_INTERVAL), one grow onto both once it settles."""
    four_gpus.settings.ELASTIC_GROW_SETTLE_S = 10.0
    row = running(elastic_job(learners=1), gpus=[0, 1])
    first, second = (running(job(member(), gpus=1, learners=1), gpus=[g]) for g in (2, 3))
    reports(row, (20, 0), (0, 2000))
    transition(first.id, Status.TERMINATED, actor="alice", reason="terminated")
    torn_down(first)
    assert four_gpus.run() == []  # a GPU was released just now: the plan waits
    transition(second.id, Status.TERMINATED, actor="alice", reason="terminated")
    torn_down(second)
    assert four_gpus.run(now=timezone.now() + timezone.timedelta(seconds=5)) == []
    resized, = four_gpus.run(now=timezone.now() + timezone.timedelta(seconds=11))
    assert resized.learners == 4 and Job.objects.get(pk=row.pk).status == Status.HALTING


def test_a_job_that_held_no_gpu_does_not_hold_a_grow_back(four_gpus, sent):
    four_gpus.settings.ELASTIC_GROW_SETTLE_S = 3600.0
    row = running(elastic_job(learners=1), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    cpu_only = running(job(member(), gpus=0, learners=1), gpus=[])
    transition(cpu_only.id, Status.TERMINATED, actor="alice", reason="terminated")
    assert [r.learners for r in four_gpus.run()] == [2]


def noise_scales(row, *values, attempt=None):
    """Learner 0's `noise_scale` reports, oldest first."""
    for value in values:
        MetricPoint.objects.create(job=row, attempt=attempt or row.attempt, learner=0, name="noise_scale",
                                   value=value, time=timezone.now())


def test_it_grows_a_job_no_further_than_twice_its_largest_measured_shape(four_gpus, sent):
    row = running(elastic_job(learners=1), gpus=[0])
    assert four_gpus.run() == []  # nothing measured yet: nothing to extrapolate from
    reports(row, (20, 0), (0, 2000))
    resized, = four_gpus.run()
    assert resized.learners == 2  # four would be idle, but one learner is all it has measured


def test_a_job_without_a_noise_scale_keeps_its_batch_whatever_the_policy(four_gpus, sent):
    four_gpus.settings.ELASTIC_POLICY = "paper"  # throughput alone: the largest batch allowed, without the rule
    row = running(elastic_job(learners=2), gpus=[0, 1])
    reports(row, (20, 0), (0, 2000))
    resized, = four_gpus.run()
    assert (resized.learners, resized.global_batch, resized.local_batch) == (4, 64, 16)


@pytest.mark.parametrize("noise,bigger", [(8.0, False), (100_000.0, True)])
def test_the_batch_follows_the_measured_noise_scale(four_gpus, sent, noise, bigger):
    row = running(elastic_job(learners=2), gpus=[0, 1])
    reports(row, (20, 0), (0, 2000))
    noise_scales(row, noise / 10, noise, noise, noise)  # the median of the latest reports
    resized, = four_gpus.run()
    assert resized.learners > 2 and (resized.global_batch > 64) == bigger, resized.reason


def test_it_reestimates_the_noise_scale_as_training_goes(four_gpus, sent):
    from jobs import autoscaler
    row = running(elastic_job(learners=2), gpus=[0, 1])
    assert autoscaler.measured_noise_scale(row) is None
    noise_scales(row, 10.0, 12.0, 11.0)
    assert autoscaler.measured_noise_scale(row) == 11.0
    noise_scales(row, 900.0, 1000.0, 1100.0, 1000.0, 950.0)  # it grew as the loss fell
    assert autoscaler.measured_noise_scale(row) == 1000.0


def gpu_samples(row, *busy):
    """Each learner's resource samples with its GPU this busy (0-1), oldest first."""
    for value in busy:
        for learner in range(row.learners):
            ResourceSample.objects.create(
                job=row, attempt=row.attempt, learner=learner, time=timezone.now(), cpu_cores=1.0,
                memory_bytes=2**28, memory_peak_bytes=2**28, gpu_utilization=value * 100, gpus_busy=value * row.gpus,
                gpus=[{"index": 0, "utilization": value * 100}])


@pytest.mark.parametrize("busy,grown", [((0.9, 0.2, 0.2, 0.2), False), ((0.3, 0.9, 0.95, 0.85), True)])
def test_it_does_not_grow_a_job_that_leaves_its_gpus_idle(four_gpus, sent, busy, grown):
    from jobs import autoscaler
    row = running(elastic_job(learners=2), gpus=[0, 1])
    reports(row, (20, 0), (0, 2000))
    gpu_samples(row, *busy)
    assert autoscaler.measured_gpu_use(row) == pytest.approx(sum(busy) / len(busy))
    assert [r.learners for r in four_gpus.run()] == ([4] if grown else [])


def test_without_gpu_samples_or_with_the_rule_off_it_grows(four_gpus, sent):
    from jobs import autoscaler
    row = running(elastic_job(learners=2), gpus=[0, 1])
    reports(row, (20, 0), (0, 2000))
    assert autoscaler.measured_gpu_use(row) is None
    four_gpus.settings.ELASTIC_GROW_MIN_GPU_USE = 0.0
    gpu_samples(row, 0.1, 0.1)
    assert [r.learners for r in four_gpus.run()] == [4]


def test_it_never_grows_onto_gpus_a_queued_job_waits_for(four_gpus, sent):
    """A fixed job holds 2 GPUs, the elastic job 1; a queued job needs 3. The idle GPU is kept for it:
    once the fixed job ends (and its teardown confirms its learners gone) it is admitted in the next
    cycle, not after the elastic job shrinks back; nor does the elastic job grow onto the ended job's
    GPUs while the teardown is open."""
    from jobs import scheduler_loop
    row = running(elastic_job(learners=1), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    fixed = running(job(member(), gpus=1, learners=2), gpus=[1, 2])
    waiting = job(member(), gpus=1, learners=3)
    assert four_gpus.run() == []
    assert Job.objects.get(pk=row.pk).status == Status.PROCESSING
    transition(fixed.id, Status.TERMINATED, actor="alice", reason="terminated")
    scheduler_loop.run_cycle()
    assert Job.objects.get(pk=waiting.pk).status == Status.QUEUED
    assert Job.objects.get(pk=row.pk).learners == 1
    torn_down(fixed)
    scheduler_loop.run_cycle()
    assert Job.objects.get(pk=waiting.pk).status == Status.PENDING
    assert Job.objects.get(pk=row.pk).learners == 1


def test_a_queued_job_held_back_by_its_quota_does_not_stop_a_grow(four_gpus, sent):
    from tenants.models import Quota
    row = running(elastic_job(learners=1), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    other = member("team-b", "bob")
    Quota.objects.update_or_create(tenant=other.tenant, defaults={"gpus": 1, "can_borrow": False})
    running(job(other, gpus=1, learners=1), gpus=[3])
    job(other, gpus=1, learners=1)  # its tenant's one GPU is taken: it waits for that, not for capacity
    assert [r.learners for r in four_gpus.run()] == [2]


def test_a_running_job_whose_noise_scale_grows_gets_a_larger_batch_at_its_size(four_gpus, sent):
    four_gpus.settings.ELASTIC_MIN_INTERVAL_S = 0.0
    row = running(elastic_job(learners=2), gpus=[0, 1])
    running(job(member(), gpus=1, learners=2), gpus=[2, 3])  # no idle GPU: only the batch may change
    reports(row, (20, 0), (0, 2000))
    noise_scales(row, 40.0, 40.0, 40.0)
    assert four_gpus.run() == []  # small: no larger batch (and a smaller one alone is not worth a restart)
    noise_scales(row, *[100_000.0] * 5)  # it grew as training went on
    resized, = four_gpus.run()
    assert (resized.learners, resized.attempt) == (2, 2) and resized.global_batch > 64
    assert resized.reason.endswith(": its measured gradient noise scale") and resized.placement == row.placement


# --- batch changes inside the running attempt (learner_agent.batch_changes) ----------------------------
def listening(row):
    """Learner 0 said it applies batch changes while it runs (BatchChanges() reports it at start)."""
    MetricPoint.objects.create(job=row, attempt=row.attempt, learner=0, name="batch_changes", value=1,
                               time=timezone.now())


def no_idle_gpu(four_gpus):
    """A job of 2 learners runs on GPUs 0-1 and another fills 2-3: only the batch may change."""
    four_gpus.settings.ELASTIC_MIN_INTERVAL_S = 0.0
    row = running(elastic_job(learners=2), gpus=[0, 1])
    running(job(member(), gpus=1, learners=2), gpus=[2, 3])
    reports(row, (20, 0), (0, 2000))
    return row


def test_learners_that_listen_change_their_batch_inside_the_running_attempt(four_gpus, sent):
    row = no_idle_gpu(four_gpus)
    listening(row)
    noise_scales(row, *[100_000.0] * 5)
    change, = four_gpus.run()
    row.refresh_from_db()
    assert (change.kind, change.attempt, change.learners, change.started_at) == ("batch", 1, 2, None)
    assert change.global_batch > 64 and change.local_batch * 2 == change.global_batch
    assert change.reason == f"batch 64→{change.global_batch}, no restart: its measured gradient noise scale"
    assert (row.status, row.attempt) == (Status.PROCESSING, 1)  # no halt, no new attempt
    assert row.batch_request == {"id": change.id, "global_batch": change.global_batch,
                                 "local_batch": change.local_batch, "lr_scale": change.lr_scale}
    assert four_gpus.run() == []  # held while the change is on its way


def test_without_listening_learners_a_larger_batch_is_a_restart(four_gpus, sent):
    row = no_idle_gpu(four_gpus)
    noise_scales(row, *[100_000.0] * 5)
    resized, = four_gpus.run()
    assert (resized.kind, resized.attempt) == ("resize", 2)


def test_a_small_noise_scale_never_raises_the_batch_of_a_listening_job(four_gpus, sent):
    row = no_idle_gpu(four_gpus)
    listening(row)
    noise_scales(row, 8.0, 8.0, 8.0)
    changes = four_gpus.run()
    assert all(c.kind == "batch" and c.global_batch < 64 for c in changes)  # smaller, if anything: no restart


@pytest.fixture
def live_job(four_gpus, sent):
    """A running listening job with ingest credentials and a batch change asked of it."""
    from jobs import credentials
    row = no_idle_gpu(four_gpus)
    listening(row)
    noise_scales(row, *[100_000.0] * 5)
    change, = four_gpus.run()
    row = Job.objects.get(pk=row.pk)
    row.tokens = credentials.issue_for_attempt(row)
    row.change = change
    return row


def metric(seq, name, value, *, step=None, time=None):
    record = {"seq": seq, "kind": "metric", "name": name, "value": value, "time": time or timezone.now().timestamp()}
    return record if step is None else dict(record, step=step)


def test_ingest_hands_the_change_to_every_agent_until_learner_0_reports_it_applied(live_job):
    from tests.support.builders import post
    change = live_job.change
    asked = {"id": change.id, "global_batch": change.global_batch, "local_batch": change.local_batch,
             "lr_scale": change.lr_scale}
    assert post(live_job, [metric(1, "loss", 0.5)], learner=1).json() == {"acked": 1, "batch": asked}
    assert post(live_job, [metric(1, "samples", 2600)]).json() == {"acked": 1, "batch": asked}
    assert post(live_job, [metric(2, "batch_applied", change.id, step=40), metric(3, "samples", 2700)]).json() == {
        "acked": 3}  # applied: not asked again
    assert post(live_job, [metric(2, "loss", 0.4)], learner=1).json() == {"acked": 2}

    rows = list(Allocation.objects.filter(job=live_job).order_by("id"))
    assert [(r.attempt, r.kind, r.global_batch) for r in rows] == [(1, "start", 64), (1, "batch", change.global_batch)]
    before, after = rows
    assert before.ended_at == after.started_at and after.ended_at is None
    assert (before.samples_start, before.samples_end, after.samples_start) == (0, 2600, 2600)
    assert after.resize_cost_s >= 0
    live_job.refresh_from_db()
    assert live_job.batch_request is None and live_job.status == Status.PROCESSING


def test_a_report_naming_another_change_or_from_another_learner_applies_nothing(live_job):
    from tests.support.builders import post
    post(live_job, [metric(1, "batch_applied", live_job.change.id + 1)])
    post(live_job, [metric(1, "batch_applied", live_job.change.id)], learner=1)
    live_job.refresh_from_db()
    assert live_job.batch_request["id"] == live_job.change.id
    assert Allocation.objects.get(pk=live_job.change.pk).started_at is None


def test_a_change_not_yet_applied_is_dropped_when_the_attempt_stops_running(live_job):
    from jobs import lifecycle
    lifecycle.halt(live_job, actor="alice")
    live_job.refresh_from_db()
    assert live_job.batch_request is None
    assert not Allocation.objects.filter(pk=live_job.change.pk).exists()
    assert [r.kind for r in Allocation.objects.filter(job=live_job)] == ["start"]


def test_the_timeline_api_shows_both_kinds_and_the_job_its_shape_now(live_job):
    from django.test import Client

    from tests.support.builders import post
    post(live_job, [metric(1, "batch_applied", live_job.change.id)])
    client = Client()
    client.force_login(live_job.owner)
    rows = client.get(f"/api/v1/jobs/{live_job.id}/allocations/").json()["results"]
    assert [(r["attempt"], r["kind"]) for r in rows] == [(1, "start"), (1, "batch")]
    detail = client.get(f"/api/v1/jobs/{live_job.id}/").json()
    assert detail["elastic"]["global_batch"] == live_job.change.global_batch


def test_a_restart_holds_the_learners_but_not_a_batch_change_inside_them(four_gpus, sent):
    row = no_idle_gpu(four_gpus)
    four_gpus.settings.ELASTIC_MIN_INTERVAL_S = 600.0
    Allocation.objects.filter(job=row).update(resize_requested_at=timezone.now())  # as if just resized
    listening(row)
    noise_scales(row, *[100_000.0] * 5)
    change, = four_gpus.run()
    assert (change.kind, change.learners) == ("batch", 2)


def test_a_change_left_unapplied_is_withdrawn_and_the_attempt_asked_no_more(live_job):
    from datetime import timedelta

    from jobs import autoscaler
    change = live_job.change
    assert autoscaler.run() == []  # waiting for the learners
    later = change.resize_requested_at + timedelta(seconds=autoscaler.BATCH_CHANGE_PATIENCE_S + 1)
    resized, = autoscaler.run(now=later)  # withdrawn; the larger batch then goes through a restart
    assert (resized.kind, resized.attempt) == ("resize", 2)
    change.refresh_from_db()
    assert change.started_at is None and change.ended_at == later and "(withdrawn: not applied after" in change.reason
    live_job.refresh_from_db()
    assert live_job.batch_request is None and live_job.status == Status.HALTING
    assert Allocation.objects.filter(pk=change.pk).exists()  # the attempt's record keeps it


# --- what a job reports, and what its tenant may hold, bound a grow -------------------------------------
@pytest.mark.parametrize("value", [1e300, -5.0, 2.0 ** 63])
def test_a_samples_report_no_count_could_be_is_passed_over_and_the_job_still_ends(sent, value):
    row = running(elastic_job(learners=1), gpus=[0])
    reports(row, (20, 0), (10, 500), (0, value))
    ended = transition(row.id, Status.TERMINATED, actor="alice", reason="terminated")
    assert ended.status == Status.TERMINATED
    assert Allocation.objects.get(job=row).samples_end == 500


def test_one_jobs_hostile_reports_leave_the_other_tenants_grows_alone(four_gpus, sent):
    import sys
    good = running(elastic_job(tenant="team-b", username="bob", learners=1), gpus=[0])
    reports(good, (20, 0), (0, 2000))
    hostile = running(elastic_job(learners=1), gpus=[1])
    reports(hostile, (20, -sys.float_info.max), (10, 0), (0, sys.float_info.max))
    assert [(r.job_id, r.learners) for r in four_gpus.run()] == [(good.id, 2)]


def test_a_tenant_already_past_its_gpu_quota_is_held_at_its_size_and_the_others_grow(four_gpus, sent):
    from tenants.models import Quota
    over = running(elastic_job(learners=2), gpus=[0, 1])
    reports(over, (20, 0), (0, 2000))
    Quota.objects.update_or_create(tenant=over.tenant, defaults={"gpus": 1, "can_borrow": False})  # lowered since
    other = running(elastic_job(tenant="team-b", username="bob", learners=1), gpus=[2])
    reports(other, (20, 0), (0, 2000))
    assert [(r.job_id, r.learners) for r in four_gpus.run()] == [(other.id, 2)]
    assert Job.objects.get(pk=over.pk).status == Status.PROCESSING


@pytest.mark.parametrize("limits, fields", [
    ({"gpus_per_user": 1}, {}),
    ({"cpus": 1.0, "can_borrow": False}, {"cpus": 1.0}),
    ({"memory_bytes": 2**30, "can_borrow": False}, {"memory_bytes": 2**30}),
    ({"gpu_hours": 0.0, "budget_mode": "hard"}, {}),
])
def test_a_grow_keeps_what_admission_keeps_of_the_tenants_quota(four_gpus, sent, limits, fields):
    from tenants.models import Quota
    row = running(elastic_job(learners=1, **fields), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    Quota.objects.update_or_create(tenant=row.tenant, defaults=limits)
    assert four_gpus.run() == []


def test_a_grow_fits_the_cpus_the_nodes_have_free(four_gpus, sent, monkeypatch):
    from types import SimpleNamespace

    from jobs import autoscaler
    from jobs.backends.base import Capacity, Node
    capacity = Capacity(nodes=(Node("local", 4, 1.5, 256 * 2**30),))
    monkeypatch.setattr(autoscaler, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
    row = running(elastic_job(learners=1, cpus=1.0), gpus=[0])
    reports(row, (20, 0), (0, 2000))
    assert four_gpus.run() == []  # 3 GPUs idle, but half a CPU
