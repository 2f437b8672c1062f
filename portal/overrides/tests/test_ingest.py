"""Ingest posts through the ASGI application (portal.overrides.ingest): the same answers as through
Django's stack, without it."""
import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from jobs import credentials
from jobs.models import LogLine
from portal.asgi import application
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def running_job():
    target = job(member(), status="PENDING")
    target.tokens = credentials.issue_for_attempt(target)
    return target


def logs(start, count):
    return [{"seq": s, "kind": "log", "stream": "stdout", "time": 1.0 + s, "line": f"line {s}"}
            for s in range(start, start + count)]


async def post(path, body, *, token=None, host=b"testserver", method="POST"):
    headers = [(b"host", host), (b"content-type", b"application/json")]
    if token is not None:
        headers.append((b"authorization", f"Ingest {token}".encode()))
    response = await HttpCommunicator(application, method, path, body=body, headers=headers).get_response(timeout=10)
    return response["status"], response["body"]


async def batch(target, records, *, token=None, **kwargs):
    body = json.dumps({"attempt": 1, "learner": 0, "records": records}).encode()
    return await post(f"/api/v1/ingest/{target.id}/", body, token=token or target.tokens[0], **kwargs)


def test_a_batch_is_stored_and_acknowledged(running_job):
    status, body = async_to_sync(batch)(running_job, logs(1, 3))
    assert (status, json.loads(body)) == (200, {"acked": 3})
    assert list(LogLine.objects.order_by("seq").values_list("line", flat=True)) == ["line 1", "line 2", "line 3"]


def test_it_answers_as_the_view_does_to_bad_posts(running_job):
    status, body = async_to_sync(batch)(running_job, logs(1, 1), token="forged")
    assert status == 401 and "not valid" in json.loads(body)["detail"]
    status, body = async_to_sync(post)(f"/api/v1/ingest/{running_job.id}/", b"{not json", token=running_job.tokens[0])
    assert (status, json.loads(body)) == (400, {"detail": "body is not JSON"})
    status, _ = async_to_sync(post)(f"/api/v1/ingest/{running_job.id}/", b"", method="GET")
    assert status == 405
    assert not LogLine.objects.exists()


def test_a_host_the_platform_does_not_answer_as_gets_400(running_job):
    status, _ = async_to_sync(batch)(running_job, logs(1, 1), host=b"evil.example")
    assert status == 400
    assert not LogLine.objects.exists()


def test_other_paths_still_reach_django():
    status, body = async_to_sync(post)("/api/v1/ingest/", b"", method="GET")  # no job id: not the route
    assert status == 404
    status, body = async_to_sync(post)("/login/", b"", method="GET")
    assert status == 200 and b"<form" in body
