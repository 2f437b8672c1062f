"""What one learner's credential can cost the platform through ingest: status records that move
nothing cost nothing, its metric points are capped like its log, and its `system` lines are few."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import credentials, lifecycle, logcap
from jobs.models import Learner, LogLine, MetricPoint
from tests.support.builders import job, member, post

pytestmark = pytest.mark.django_db
T = 1763726400.0


def status(seq, state, **fields):
    return {"seq": seq, "kind": "status", "state": state, "time": T + seq, **fields}


def metric(seq, name, value=1.0):
    return {"seq": seq, "kind": "metric", "name": name, "value": value, "step": seq, "time": T + seq}


def logs(start, count):
    return [{"seq": s, "kind": "log", "stream": "stdout", "time": T, "line": f"line {s}"}
            for s in range(start, start + count)]


def system_lines(target):
    return list(LogLine.objects.filter(job=target, stream="system").order_by("seq").values_list("line", flat=True))


def queries_of(target, records):
    with CaptureQueriesContext(connection) as queries:
        response = post(target, records)
    assert response.status_code == 200, response.content
    return len(queries)


# --- status records ------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["preparing", "running"])
def test_it_acks_a_flood_of_one_status_for_what_one_record_costs(running_job, state):
    one = queries_of(running_job, [status(1, state)])
    flood = queries_of(running_job, [status(seq, state) for seq in range(2, 2002)])
    assert flood <= one
    assert Learner.objects.get(job=running_job).acked_seq == 2001


def test_it_applies_each_status_once_and_never_a_step_back(running_job):
    records = [status(1, "preparing"), status(2, "running"), status(3, "preparing"), status(4, "running"),
               status(5, "exited", exit_code=3, reason="first"), status(6, "running"),
               status(7, "exited", exit_code=0, reason="second")]
    assert post(running_job, records).json() == {"acked": 7}
    learner = Learner.objects.get(job=running_job)
    assert (learner.state, learner.exit_code, learner.reason) == ("exited", 3, "first")
    assert list(running_job.events.values_list("to_status", flat=True)) == ["DOWNLOADING", "PROCESSING"]
    flood = queries_of(running_job, [status(seq, "running") for seq in range(8, 1008)])
    assert flood <= queries_of(running_job, [status(1008, "exited", exit_code=0)])


def test_a_recorded_exit_is_not_rewritten(running_job):
    post(running_job, [status(1, "running"), status(2, "exited", exit_code=137, reason="memory limit 4GiB exceeded")])
    post(running_job, [status(3, "running"), status(4, "exited", exit_code=0, reason="")])
    learner = Learner.objects.get(job=running_job)
    assert (learner.state, learner.exit_code, learner.reason) == ("exited", 137, "memory limit 4GiB exceeded")


@pytest.mark.parametrize("ended", [Learner.State.EXITED, Learner.State.LOST])
def test_learner_running_leaves_an_ended_learner_as_it_is(running_job, ended):
    learner = Learner.objects.create(job=running_job, attempt=1, index=0, state=ended, exit_code=137)
    lifecycle.learner_running(running_job, learner, None)
    learner.refresh_from_db()
    assert (learner.state, learner.exit_code) == (ended, 137)


# --- system lines past the log cap ---------------------------------------------------------------
def test_repeated_exits_past_the_log_cap_store_one_summary(running_job, settings):
    settings.LOG_MAX_LINES_PER_LEARNER = 10
    logcap._caps.clear()
    post(running_job, logs(1, 20))
    post(running_job, [status(21, "exited", exit_code=0)])
    post(running_job, [status(seq, "exited", exit_code=0) for seq in range(22, 522)])
    lines = system_lines(running_job)
    assert len(lines) == 2 and "log cap reached" in lines[0] and "10 lines" in lines[1]


def test_refused_records_are_noted_up_to_the_limit_then_counted(running_job):
    from jobs.ingest import MAX_REFUSED_NOTES
    for seq in range(1, MAX_REFUSED_NOTES + 11):
        response = post(running_job, [{"seq": seq, "kind": "nonsense"}])
        assert response.json()["rejected"][0]["seq"] == seq  # the agent still hears of each one
    lines = system_lines(running_job)
    assert len(lines) == MAX_REFUSED_NOTES and "the last such note" in lines[-1]
    assert Learner.objects.get(job=running_job).ingest_state["refused"] == {"notes": MAX_REFUSED_NOTES, "unnoted": 10}


# --- metric points -------------------------------------------------------------------------------
def test_a_learner_stores_its_cap_of_points_and_counts_the_rest(running_job, settings):
    settings.METRIC_POINTS_PER_LEARNER = 5
    post(running_job, [metric(seq, "loss") for seq in range(1, 11)])
    post(running_job, [metric(seq, "loss") for seq in range(11, 21)])
    assert MetricPoint.objects.filter(job=running_job).count() == 5
    assert Learner.objects.get(job=running_job).ingest_state["metrics"] == {"points": 5, "dropped": 15}
    lines = system_lines(running_job)
    assert len(lines) == 1 and lines[0].startswith("metric cap reached for learner 0")


def test_points_of_printed_metrics_past_the_log_cap_stop_at_the_metric_cap(running_job, settings):
    settings.LOG_MAX_LINES_PER_LEARNER, settings.METRIC_POINTS_PER_LEARNER = 10, 100
    logcap._caps.clear()
    records = []
    for i in range(1000):  # a learner printing TRAINYARD_METRIC lines: a log line and a point each
        records += [*logs(2 * i + 1, 1), metric(2 * i + 2, f"n{i:04d}")]
    assert post(running_job, records).status_code == 200
    assert LogLine.objects.filter(job=running_job, stream="stdout").count() == 10
    assert MetricPoint.objects.filter(job=running_job).count() == 100


def test_a_job_stores_its_cap_of_metric_names_over_all_learners(settings):
    settings.METRIC_NAMES_PER_JOB = 3
    target = job(member(), status="PENDING", learners=2)
    target.tokens = credentials.issue_for_attempt(target)
    post(target, [metric(1, "a"), metric(2, "b")], learner=0)
    logcap._job_names.clear()  # another process: it knows none of the job's names yet
    post(target, [metric(1, "c"), metric(2, "d"), metric(3, "a")], learner=1)
    post(target, [metric(3, "e"), metric(4, "b"), metric(5, "c")], learner=0)
    stored = sorted(MetricPoint.objects.filter(job=target).values_list("name", "learner"))
    assert stored == [("a", 0), ("a", 1), ("b", 0), ("b", 0), ("c", 0), ("c", 1)]
    assert len(system_lines(target)) == 2  # one for each learner that met the cap


def test_past_the_name_cap_a_new_name_costs_no_query(running_job, settings):
    settings.METRIC_NAMES_PER_JOB = 3
    post(running_job, [metric(1, "a"), metric(2, "b"), metric(3, "c")])
    known = queries_of(running_job, [metric(4, "a")])
    assert queries_of(running_job, [metric(seq, f"new{seq}") for seq in range(5, 1005)]) <= known
    assert MetricPoint.objects.filter(job=running_job).count() == 4
