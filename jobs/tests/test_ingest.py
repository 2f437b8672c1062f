"""The ingest protocol: exactly once, in order, whatever the agent resends."""
import pytest
from django.test import Client

from jobs import credentials
from jobs.models import Job, Learner, LogLine, MetricPoint
from tests.support.builders import job, member, post

pytestmark = pytest.mark.django_db


def logs(start, count):
    return [{"seq": s, "kind": "log", "stream": "stdout", "time": 1.0 + s, "line": f"line {s}"}
            for s in range(start, start + count)]


def test_it_stores_lines_in_order_with_dense_job_seq(running_job):
    assert post(running_job, logs(1, 5)).json() == {"acked": 5}
    assert list(LogLine.objects.order_by("seq").values_list("seq", "line")) == [(i, f"line {i}") for i in range(1, 6)]


def test_it_drops_resends_and_overlaps(running_job):
    post(running_job, logs(1, 5))
    assert post(running_job, logs(1, 5)).json() == {"acked": 5}
    assert post(running_job, logs(3, 5)).json() == {"acked": 7}
    assert LogLine.objects.count() == 7
    assert sorted(LogLine.objects.values_list("line", flat=True)) == sorted(f"line {i}" for i in range(1, 8))


def test_it_refuses_a_gap_with_409_and_what_it_has(running_job):
    post(running_job, logs(1, 3))
    response = post(running_job, logs(6, 2))
    assert response.status_code == 409 and response.json()["acked"] == 3
    assert LogLine.objects.count() == 3


def test_it_refuses_a_forged_or_foreign_token(running_job):
    other = job(member("team-b", "bob"), status="PENDING")
    assert post(running_job, logs(1, 1), token="forged").status_code == 401
    assert post(running_job, logs(1, 1), token=credentials.issue_for_attempt(other)[0]).status_code == 401
    assert post(running_job, logs(1, 1), attempt=2).status_code == 401  # the credential is for attempt 1
    assert not LogLine.objects.exists()


def test_status_records_drive_the_job(running_job, django_capture_on_commit_callbacks):
    records = [{"seq": 1, "kind": "status", "state": "preparing", "time": 1},
               {"seq": 2, "kind": "status", "state": "running", "time": 2},
               {"seq": 3, "kind": "metric", "name": "loss", "value": 0.5, "step": 1, "time": 3},
               {"seq": 4, "kind": "status", "state": "exited", "exit_code": 0, "time": 4}]
    with django_capture_on_commit_callbacks() as callbacks:
        post(running_job, records)
    running_job.refresh_from_db()
    assert running_job.status == "PROCESSING"
    assert list(running_job.events.values_list("to_status", flat=True)) == ["DOWNLOADING", "PROCESSING"]
    assert Learner.objects.get(job=running_job).exit_code == 0
    assert MetricPoint.objects.get().value == 0.5
    assert any("finish_attempt" in repr(c) or callable(c) for c in callbacks)


@pytest.mark.parametrize("change", [{"status": "TERMINATED"}, {"status": "COMPLETED"}, {"status": "FAILED"},
                                    {"status": "HALTED"}, {"status": "QUEUED", "attempt": 2},
                                    {"status": "PROCESSING", "attempt": 2}])
def test_it_tells_the_agent_of_an_ended_attempt_to_stop_and_keeps_nothing(running_job, change):
    Job.objects.filter(pk=running_job.pk).update(**change)
    response = post(running_job, logs(1, 2))
    assert response.status_code == 410
    assert not LogLine.objects.exists()


@pytest.mark.parametrize("value", [1763726400.123456, 1763726400, 1763726400.9999996, "1763726400.5", 0.25,
                                   None, "soon", float("nan"), float("inf"), -5.5, 1e20])
def test_log_times_format_like_datetime_isoformat(value):
    from datetime import datetime, timezone

    from jobs.ingest import _iso_time, _time
    got = datetime.fromisoformat(_iso_time(value))
    expected = _time(value)
    if value is None or value == "soon" or value != value or value in (float("inf"), 1e20):
        assert abs((got - datetime.now(timezone.utc)).total_seconds()) < 5  # unreadable: arrival time
    else:
        assert abs((got - expected).total_seconds()) <= 1e-6


def test_the_agent_may_write_system_lines_and_anything_else_is_stdout(running_job):
    records = [{"seq": 1, "kind": "log", "stream": "system", "time": 1, "line": "learner agent: the spool is full"},
               {"seq": 2, "kind": "log", "stream": "weird", "time": 2, "line": "x"},
               {"seq": 3, "kind": "log", "stream": ["stderr"], "time": 3, "line": "y"}]
    assert post(running_job, records).json() == {"acked": 3}
    assert list(LogLine.objects.order_by("seq").values_list("stream", flat=True)) == ["system", "stdout", "stdout"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_ingests_of_two_jobs_of_one_tenant_do_not_wait_for_each_other(monkeypatch):
    # The batch's lock on its job once locked the joined tenant row as well, so every ingest of a
    # tenant waited for every other one in progress (bench controlplane: 0.26 s a batch at 15 a second).
    import threading

    from django.db import connection, connections

    from tests.support.optional import skip_or_fail
    from jobs import ingest
    if connection.vendor != "postgresql":
        skip_or_fail("row locks are PostgreSQL's (set DATABASE_URL)")
    alice = member()
    first, second = job(alice, status="PENDING"), job(alice, status="PENDING")
    first.tokens, second.tokens = credentials.issue_for_attempt(first), credentials.issue_for_attempt(second)
    storing, done = threading.Event(), threading.Event()
    store = ingest._store

    def slow_store(target, learner, records, **kwargs):
        if target.pk == first.pk:  # the first job's batch stays in its transaction until `done`
            storing.set()
            done.wait(10)
        return store(target, learner, records, **kwargs)
    monkeypatch.setattr(ingest, "_store", slow_store)

    def post_first():
        try:
            post(first, logs(1, 3))
        finally:
            connections.close_all()

    slow = threading.Thread(target=post_first)
    slow.start()
    try:
        assert storing.wait(10)
        # A lock the second batch waits for makes it fail here instead (the old lock waited for `done`).
        with connection.execute_wrapper(lambda execute, sql, *args: execute(
                "SET LOCAL lock_timeout = '2s'; " + sql if "FOR " in sql else sql, *args)):
            response = post(second, logs(1, 3))
        assert response.status_code == 200, response.content
        assert LogLine.objects.filter(job=second).count() == 3
    finally:
        done.set()
        slow.join()
    assert LogLine.objects.filter(job=first).count() == 3


def test_a_bad_record_is_refused_by_name_and_the_rest_of_the_batch_is_stored(running_job):
    records = [*logs(1, 2), {"seq": 3, "kind": "metric", "name": "loss", "value": 1.0, "step": 1e300, "time": 4.0},
               {"seq": 4, "kind": "metric", "name": "loss", "value": 0.5, "step": 2, "time": 5.0},
               {"seq": 5, "kind": "metric", "name": "loss", "value": 0.5, "step": 3, "time": 1e300}]
    response = post(running_job, records)
    assert response.status_code == 200
    assert response.json() == {"acked": 5, "rejected": [
        {"seq": 3, "error": "step: must be null or an integer between -2**63 and 2**63-1"},
        {"seq": 5, "error": "time: must be Unix seconds between 0 and 253402300799"}]}
    assert list(MetricPoint.objects.values_list("step", "value")) == [(2, 0.5)]
    lines = list(LogLine.objects.order_by("seq").values_list("stream", "line"))
    assert lines[:2] == [("stdout", "line 1"), ("stdout", "line 2")]
    assert lines[2][0] == "system" and "2 record(s) of learner 0 refused" in lines[2][1] and "seq 3: step" in lines[2][1]
    assert post(running_job, logs(6, 1)).json() == {"acked": 6}  # the learner goes on
    assert Learner.objects.get(job=running_job).acked_seq == 6


def test_numbers_beyond_a_double_refuse_their_record_not_the_batch(running_job):
    body = ('{"attempt": 1, "learner": 0, "records": ['
            '{"seq": 1, "kind": "log", "stream": "stdout", "time": 1.0, "line": "ok"},'
            '{"seq": 2, "kind": "metric", "name": "loss", "value": 1e400, "step": 1, "time": 1.0},'
            '{"seq": 3, "kind": "metric", "name": "loss", "value": NaN, "step": 1, "time": 1.0},'
            '{"seq": 4, "kind": "log", "stream": "stdout", "time": 1.0, "line": "bad \\udcff"},'
            '{"seq": 5, "kind": "metric", "name": "loss", "value": 2, "step": ' + "9" * 30 + ', "time": 1.0}]}')
    response = Client().post(f"/api/v1/ingest/{running_job.id}/", body, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Ingest {running_job.tokens[0]}")
    assert response.status_code == 200
    assert [(r["seq"], r["error"].split(":")[0]) for r in response.json()["rejected"]] == [
        (2, "value"), (3, "value"), (4, "line"), (5, "step")]
    assert response.json()["acked"] == 5
    assert not MetricPoint.objects.exists()
    assert LogLine.objects.filter(stream="stdout").get().line == "ok"


def test_a_refused_last_record_is_acked_all_the_same(running_job):
    response = post(running_job, [{"seq": 1, "kind": "status", "state": "exited", "exit_code": 2**40, "time": 1.0}])
    assert response.json()["acked"] == 1 and response.json()["rejected"][0]["seq"] == 1
    assert Learner.objects.get(job=running_job).exit_code is None
    assert post(running_job, logs(2, 1)).json() == {"acked": 2}


def test_a_nul_in_an_exit_reason_is_dropped_and_the_exit_stored(running_job):
    # The database refused the reason, which answered the whole batch as "not JSON": the exit never came in.
    response = post(running_job, [{"seq": 1, "kind": "status", "state": "exited", "exit_code": 3,
                                   "reason": "killed\x00 by a signal", "time": 1.0}])
    assert response.json() == {"acked": 1}
    learner = Learner.objects.get(job=running_job)
    assert (learner.exit_code, learner.reason) == (3, "killed by a signal")


def test_a_record_without_a_usable_seq_still_fails_the_batch(running_job):
    for seq in (True, 2**63, 0, "1", 1.0):
        response = post(running_job, [{"seq": seq, "kind": "log", "line": "x"}])
        assert response.status_code == 400, seq
    assert not LogLine.objects.exists()
