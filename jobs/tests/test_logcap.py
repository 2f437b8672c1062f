"""Log caps (jobs.logcap): past a job's or a learner's cap, lines are counted, not stored."""
import pytest
from django.test import Client

from jobs import credentials, logcap, runtime
from tests.support.builders import job, member
from trainyard.manifest import parse_manifest
from jobs.models import Job, Learner, LogLine

pytestmark = pytest.mark.django_db

MANIFEST = "name: chatty\nframework: {name: custom, command: ls}\n"


def running_job(caps, learners=1):
    target = job(member(), status="PENDING", learners=learners)
    stored = runtime.from_manifest(parse_manifest(MANIFEST), disk_caps=dict(caps))
    Job.objects.filter(pk=target.pk).update(runtime=stored)
    logcap._caps.pop(target.pk, None)
    target.tokens = credentials.issue_for_attempt(target)
    return target


def post(target, records, learner=0):
    return Client().post(f"/api/v1/ingest/{target.id}/", {"attempt": 1, "learner": learner, "records": records},
                         content_type="application/json", HTTP_AUTHORIZATION=f"Ingest {target.tokens[learner]}")


def lines(start, count, text="x" * 99):
    return [{"seq": s, "kind": "log", "stream": "stdout", "time": 1.0 + s, "line": text} for s in range(start, start + count)]


def exited(seq):
    return [{"seq": seq, "kind": "status", "state": "exited", "exit_code": 0, "time": 2.0}]


def test_it_stops_storing_at_the_jobs_line_cap_and_says_how_much_it_did_not_store():
    target = running_job({"log_lines": 10})
    assert post(target, lines(1, 25)).json() == {"acked": 25}
    assert post(target, lines(26, 5) + exited(31)).json() == {"acked": 31}
    stored = list(LogLine.objects.filter(job=target).order_by("seq").values_list("stream", "line"))
    learner_lines = [line for stream, line in stored if stream == "stdout"]
    notices = [line for stream, line in stored if stream == "system"]
    assert len(learner_lines) == 10
    assert len(notices) == 2, notices
    assert "log cap reached for learner 0" in notices[0]
    assert notices[1].startswith("… 20 lines / ") and "not stored: log cap reached" in notices[1]
    target.refresh_from_db()
    assert (target.log_dropped_lines, target.log_dropped_bytes) == (20, 20 * 99)
    learner = Learner.objects.get(job=target)
    assert (learner.log_lines, learner.log_dropped_lines) == (10, 20)


def test_it_stops_at_the_jobs_byte_cap():
    target = running_job({"logs": 1000})
    post(target, lines(1, 30))
    assert LogLine.objects.filter(job=target, stream="stdout").count() == 10  # 10 × 99 bytes fit, the 11th not
    target.refresh_from_db()
    assert target.log_dropped_lines == 20 and target.log_bytes <= 1000 + 300  # the notice is stored beyond it


def test_a_learner_past_its_own_cap_leaves_room_for_the_others(settings):
    settings.LOG_MAX_LINES_PER_LEARNER = 5
    target = running_job({}, learners=2)
    post(target, lines(1, 8), learner=0)
    post(target, lines(1, 3), learner=1)
    stored = LogLine.objects.filter(job=target, stream="stdout")
    assert stored.filter(learner=0).count() == 5 and stored.filter(learner=1).count() == 3


def test_once_cut_a_learners_later_small_lines_are_not_stored_either():
    target = running_job({"logs": 1000})
    post(target, lines(1, 10, text="y" * 99) + lines(11, 1, text="z" * 500) + lines(12, 1, text="small"))
    assert not LogLine.objects.filter(job=target, line="small").exists()


def test_a_long_line_is_cut_and_marked(settings):
    settings.LOG_MAX_LINE_BYTES = 1000
    target = running_job({})
    post(target, lines(1, 1, text="é" * 2000))
    line = LogLine.objects.get(job=target).line
    assert line.startswith("é" * 500) and "line cut: 4000 bytes" in line
    assert len(line.split(" …")[0].encode()) <= 1000


def test_cut_counts_utf8_bytes():
    assert logcap.cut("abc", 1000) == ("abc", 3)
    assert logcap.cut("é" * 10, 1000) == ("é" * 10, 20)
