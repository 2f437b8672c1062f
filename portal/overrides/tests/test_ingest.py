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


# --- the body is bounded: size, time, and no credential no reading -------------------------------
async def open_post(target, *, token, length=None):
    """A post whose body is sent by the test, message by message: (communicator, path)."""
    from channels.testing import ApplicationCommunicator

    headers = [(b"host", b"testserver"), (b"content-type", b"application/json")]
    if token is not None:
        headers.append((b"authorization", f"Ingest {token}".encode()))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": f"/api/v1/ingest/{target.id}/",
             "raw_path": f"/api/v1/ingest/{target.id}/".encode(), "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 40000), "server": ("testserver", 80)}
    return ApplicationCommunicator(application, scope)


async def answer_of(communicator):
    """(status, headers as a dict by lower-case name, body) of the answer, without sending more of the body."""
    start = await communicator.receive_output(timeout=10)
    body = await communicator.receive_output(timeout=10)
    return start["status"], {name.lower(): value for name, value in start["headers"]}, body["body"]


def test_a_declared_length_over_the_limit_is_refused_before_a_byte_is_read(running_job, settings):
    async def scenario():
        communicator = await open_post(running_job, token=running_job.tokens[0],
                                       length=settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)
        return await answer_of(communicator)  # no body message is ever sent

    status, headers, _ = async_to_sync(scenario)()
    assert status == 413
    assert headers[b"connection"] == b"close"


def test_a_post_without_a_credential_is_answered_with_its_body_unread(running_job):
    async def scenario():
        communicator = await open_post(running_job, token="forged", length=8 * 2**20)
        return await answer_of(communicator)  # the 8 MiB announced are never sent

    status, headers, body = async_to_sync(scenario)()
    assert status == 401 and "not valid" in json.loads(body)["detail"]
    assert headers[b"connection"] == b"close"


def test_a_body_that_grows_past_the_limit_is_refused_as_it_does(running_job, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096

    async def scenario():
        communicator = await open_post(running_job, token=running_job.tokens[0])  # chunked: no length
        for _ in range(3):
            await communicator.send_input({"type": "http.request", "body": b" " * 2048, "more_body": True})
        return await answer_of(communicator)  # the body never ends

    status, headers, _ = async_to_sync(scenario)()
    assert status == 413
    assert headers[b"connection"] == b"close"
    assert not LogLine.objects.exists()


def test_a_body_that_stalls_is_refused_at_the_deadline(running_job, settings):
    settings.INGEST_READ_S = 1.0

    async def scenario():
        communicator = await open_post(running_job, token=running_job.tokens[0], length=1000)
        await communicator.send_input({"type": "http.request", "body": b"{", "more_body": True})
        started = time.monotonic()
        return *(await answer_of(communicator)), time.monotonic() - started

    status, headers, _, waited = async_to_sync(scenario)()
    assert status == 408 and waited < 8
    assert headers[b"connection"] == b"close"


def test_a_body_sent_in_parts_within_the_limits_is_stored(running_job):
    body = json.dumps({"attempt": 1, "learner": 0, "records": logs(1, 2)}).encode()

    async def scenario():
        communicator = await open_post(running_job, token=running_job.tokens[0], length=len(body))
        middle = len(body) // 2
        await communicator.send_input({"type": "http.request", "body": body[:middle], "more_body": True})
        await communicator.send_input({"type": "http.request", "body": body[middle:], "more_body": False})
        return await answer_of(communicator)

    status, headers, answer = async_to_sync(scenario)()
    assert (status, json.loads(answer)) == (200, {"acked": 2})
    assert b"connection" not in headers  # the connection stays for the agent's next post


def test_a_post_that_cannot_have_its_jobs_lock_soon_is_told_to_retry(running_job, monkeypatch):
    """Another post of the job (or a worker) holding its lock must not hold this post's thread too."""
    import threading

    from django.db import transaction

    from jobs import ingest
    from jobs.models import Job
    if connection.vendor != "postgresql":
        skip_or_fail("lock waits are PostgreSQL's (set DATABASE_URL; SQLite posts take turns in one thread)")
    monkeypatch.setattr(ingest, "LOCK_WAIT_S", 0.2)
    held, release = threading.Event(), threading.Event()

    def hold_the_jobs_lock():
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=running_job.pk)
                held.set()
                release.wait(20)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_jobs_lock)
    holder.start()
    try:
        assert held.wait(10)
        body = json.dumps({"attempt": 1, "learner": 0, "records": logs(1, 1)}).encode()
        headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
                   (b"authorization", f"Ingest {running_job.tokens[0]}".encode())]
        started = time.monotonic()
        response = async_to_sync(HttpCommunicator(application, "POST", f"/api/v1/ingest/{running_job.id}/",
                                                  body=body, headers=headers).get_response)(timeout=15)
        waited = time.monotonic() - started
    finally:
        release.set()
        holder.join()
    assert response["status"] == 503 and waited < 10
    assert {name.lower(): value for name, value in response["headers"]}[b"retry-after"] == b"1"
    assert not LogLine.objects.exists()
    assert async_to_sync(batch)(running_job, logs(1, 1))[0] == 200  # the agent's retry, once the lock is free
