"""The ingest protocol: exactly once, in order, whatever the agent resends."""
import pytest
from django.test import Client

from jobs import actions
from jobs.models import Job, Learner, LogLine, MetricPoint
from jobs.tests.builders import job, member

pytestmark = pytest.mark.django_db


@pytest.fixture
def running_job():
    return job(member(), status="PENDING")


def post(target, records, *, attempt=1, learner=0, token=None):
    token = token or actions.ingest_token(target.id, attempt)
    return Client().post(f"/api/v1/ingest/{target.id}/", {"attempt": attempt, "learner": learner, "records": records},
                         content_type="application/json", HTTP_AUTHORIZATION=f"Ingest {token}")


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
    other = job(member("team-b", "bob"))
    assert post(running_job, logs(1, 1), token="forged").status_code == 401
    assert post(running_job, logs(1, 1), token=actions.ingest_token(other.id, 1)).status_code == 401
    assert post(running_job, logs(1, 1), token=actions.ingest_token(running_job.id, 2)).status_code == 401
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


def test_it_tells_the_agent_of_a_terminated_job_to_stop(running_job):
    Job.objects.filter(pk=running_job.pk).update(status="TERMINATED")
    response = post(running_job, logs(1, 2))
    assert response.status_code == 410
    assert LogLine.objects.count() == 2  # its last words are still kept


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
