"""Ingest posts through the ASGI application (portal.overrides.ingest): the same answers as through
Django's stack, without it."""
import json
import time

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.db import connection, connections

from jobs import credentials
from jobs.models import LogLine
from portal.asgi import application, ingest_route
from portal.overrides.ingest import IngestRoute
from tests.support.builders import job, member
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture(autouse=True)
def connections_let_go():
    """The route's threads keep their connections; the suite's database is dropped at its end."""
    yield
    ingest_route.close()


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


def test_a_nul_in_the_job_id_is_refused_by_name(running_job):
    status, body = async_to_sync(post)("/api/v1/ingest/x\x00y/", b"{}", token=running_job.tokens[0])
    assert (status, json.loads(body)) == (400, {"detail": "path: holds a NUL character", "field": "path"})


# --- the pool's threads keep their database connection between posts ---------------------------
@pytest.fixture
def one_thread_route(settings):
    if connection.vendor != "postgresql":
        skip_or_fail("a kept connection is PostgreSQL's matter (set DATABASE_URL; SQLite keeps its own anyway)")
    settings.INGEST_THREADS = 1
    route = IngestRoute(ingest_route.django)
    yield route
    route.close()


def backend_of(route):
    """The server process behind the connection the route's one thread holds; None while it holds none."""
    def own():
        held = connections["default"].connection
        return held.get_backend_pid() if held is not None else None
    return route.executor.submit(own).result()


def post_through(route, target, records):
    body = json.dumps({"attempt": 1, "learner": 0, "records": records}).encode()
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
               (b"authorization", f"Ingest {target.tokens[0]}".encode())]
    communicator = HttpCommunicator(route, "POST", f"/api/v1/ingest/{target.id}/", body=body, headers=headers)
    return async_to_sync(communicator.get_response)(timeout=10)["status"]


def server_processes():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        return {pid for (pid,) in cursor.fetchall()}


def test_posts_on_a_thread_run_on_the_connection_it_kept(one_thread_route, running_job):
    assert post_through(one_thread_route, running_job, logs(1, 2)) == 200
    kept = backend_of(one_thread_route)
    assert kept is not None  # still open after the post
    for start in (3, 5):
        assert post_through(one_thread_route, running_job, logs(start, 2)) == 200
        assert backend_of(one_thread_route) == kept
    assert LogLine.objects.count() == 6


def test_without_a_keep_time_each_post_opens_and_closes_its_own(one_thread_route, running_job, settings):
    settings.INGEST_KEEP_CONNECTION_S = 0
    one_thread_route.close()  # threads start afresh, under the setting
    assert post_through(one_thread_route, running_job, logs(1, 2)) == 200
    assert backend_of(one_thread_route) is None


def test_a_kept_connection_that_died_is_replaced_before_the_next_post(one_thread_route, running_job):
    assert post_through(one_thread_route, running_job, logs(1, 1)) == 200
    dead = backend_of(one_thread_route)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [dead])
    assert post_through(one_thread_route, running_job, logs(2, 1)) == 200  # not a 500 for the agent
    assert backend_of(one_thread_route) not in (None, dead)
    assert LogLine.objects.count() == 2


def test_closing_the_route_closes_the_connections_its_threads_kept(one_thread_route, running_job):
    assert post_through(one_thread_route, running_job, logs(1, 1)) == 200
    kept = backend_of(one_thread_route)
    assert kept in server_processes()
    one_thread_route.close()
    deadline = time.monotonic() + 5
    while kept in server_processes():
        assert time.monotonic() < deadline, "the kept connection outlived its route"
        time.sleep(0.05)
