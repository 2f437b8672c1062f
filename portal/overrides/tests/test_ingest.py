"""Ingest posts through the ASGI application (portal.overrides.ingest): the same answers as through
Django's stack, without it, and each tenant's posts within its share of the route's threads."""
import asyncio
import json
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator, WebsocketCommunicator
from django.db import connection, connections

from jobs import credentials
from jobs.models import LogLine
from portal.asgi import application, ingest_application, ingest_route
from portal.overrides.ingest import IngestRoute
from tests.support.builders import job, member, token_for
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


# --- each tenant has its share of the pool's threads ----------------------------------------------
class HeldPosts:
    """Posts held inside the view (jobs.ingest.ingest) until released; `inside`: how many are."""

    def __init__(self):
        self.lock, self.release, self.inside = threading.Lock(), threading.Event(), 0

    def around(self, ingest):
        def held(grant, payload, **kwargs):
            with self.lock:
                self.inside += 1
            self.release.wait(20)
            return ingest(grant, payload, **kwargs)
        return held

    async def until_inside(self, count):
        deadline = time.monotonic() + 10
        while self.inside < count:
            assert time.monotonic() < deadline, f"{self.inside} posts reached the view, not {count}"
            await asyncio.sleep(0.02)


@pytest.fixture
def shared_route(settings, monkeypatch):
    """(a route of 4 threads, HeldPosts): every post stops inside the view until released."""
    from jobs import ingest
    if connection.vendor != "postgresql":
        skip_or_fail("the pool's shares are PostgreSQL's matter (set DATABASE_URL; SQLite's posts take turns)")
    settings.INGEST_THREADS, settings.INGEST_TENANT_THREADS = 4, 0
    held = HeldPosts()
    monkeypatch.setattr(ingest, "ingest", held.around(ingest.ingest))
    route = IngestRoute(ingest_route.django)
    try:
        yield route, held
    finally:
        held.release.set()
        route.close()


def learners_of(tenant_slug, username, count):
    target = job(member(tenant_slug, username), status="PENDING", learners=count)
    target.tokens = credentials.issue_for_attempt(target)
    return target


async def post_as(route, target, learner, records, *, timeout=10):
    """(status, headers by lower-case name) of one learner's post through `route`."""
    body = json.dumps({"attempt": 1, "learner": learner, "records": records}).encode()
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
               (b"authorization", f"Ingest {target.tokens[learner]}".encode())]
    response = await HttpCommunicator(route, "POST", f"/api/v1/ingest/{target.id}/", body=body,
                                      headers=headers).get_response(timeout=timeout)
    return response["status"], {name.lower(): value for name, value in response["headers"]}


def test_a_tenants_posts_past_its_share_wait_while_another_tenants_post_is_served_at_once(shared_route):
    route, held = shared_route
    noisy, quiet = learners_of("team-b", "mallory", 4), learners_of("team-a", "alice", 1)

    async def scenario():
        noisy_posts = [asyncio.ensure_future(post_as(route, noisy, i, logs(1, 1), timeout=30)) for i in range(4)]
        await held.until_inside(2)
        await asyncio.sleep(0.3)  # time enough for a third of them to reach the view, were it let through
        inside_before = held.inside
        try:
            quiet_post = asyncio.ensure_future(post_as(route, quiet, 0, logs(1, 1)))
            await held.until_inside(inside_before + 1)  # a thread was free for it: it is in the view
        finally:
            held.release.set()
        return inside_before, await quiet_post, await asyncio.gather(*noisy_posts)

    inside_before, (quiet_status, _), noisy_answers = async_to_sync(scenario)()
    assert inside_before == 2  # half the pool: the other two posts waited their turn, unread
    assert quiet_status == 200
    assert [status for status, _ in noisy_answers] == [200] * 4  # each served in its turn
    assert LogLine.objects.filter(job=noisy).count() == 4


def test_a_post_that_does_not_get_its_turn_soon_is_told_to_retry_with_its_body_unread(shared_route, settings,
                                                                                  monkeypatch):
    from portal.overrides import ingest as route_module
    route, held = shared_route
    settings.INGEST_TENANT_THREADS = 1
    route.close()  # its shares start afresh, under the setting
    monkeypatch.setattr(route_module, "TURN_WAIT_S", 0.3, raising=False)  # a route without it fails on its answer
    noisy = learners_of("team-b", "mallory", 2)

    async def scenario():
        first = asyncio.ensure_future(post_as(route, noisy, 0, logs(1, 1), timeout=30))
        await held.until_inside(1)
        try:
            started = time.monotonic()
            second = await post_as(route, noisy, 1, logs(1, 1))
            waited = time.monotonic() - started
        finally:
            held.release.set()
        return await first, second, waited, held.inside

    (first_status, _), (second_status, headers), waited, inside = async_to_sync(scenario)()
    assert (first_status, second_status) == (200, 503) and waited < 5
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert inside == 1  # the refused post never reached the view
    assert async_to_sync(post_as)(route, noisy, 1, logs(1, 1))[0] == 200  # the agent's retry, its turn free


def test_a_turn_given_back_goes_to_the_tenants_next_post_still_waiting():
    from portal.overrides.ingest import Shares

    async def scenario():
        shares = Shares(1)
        assert await shares.take("b", 1)
        assert await shares.take("a", 1)  # another tenant's turn is its own
        gave_up = await shares.take("b", 0.05)  # waits past its time: no turn, and none kept for it
        waiting = asyncio.ensure_future(shares.take("b", 5))
        await asyncio.sleep(0.05)
        shares.give_back("b")  # handed to the post still waiting, not to the one that gave up
        got = await waiting
        shares.give_back("b")
        shares.give_back("a")
        return gave_up, got, dict(shares.serving), dict(shares.waiting)

    assert async_to_sync(scenario)() == (False, True, {}, {})


def test_a_turn_is_never_lost_to_a_post_cancelled_while_it_waits():
    from portal.overrides.ingest import Shares

    async def scenario():
        shares = Shares(1)
        assert await shares.take("b", 1)
        cancelled = asyncio.ensure_future(shares.take("b", 5))
        waiting = asyncio.ensure_future(shares.take("b", 5))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        shares.give_back("b")  # handed to the cancelled post before it runs again
        # It either passes the turn on (CancelledError) or keeps it (asyncio.wait_for before Python 3.12
        # returns what it was handed) and, as the route does, gives it back when done.
        if await asyncio.gather(cancelled, return_exceptions=True) == [True]:
            shares.give_back("b")
        got = await asyncio.wait_for(waiting, 2)
        shares.give_back("b")
        return got, dict(shares.serving), dict(shares.waiting)

    assert async_to_sync(scenario)() == (True, {}, {})


# --- the ingest servers' application: agents' posts, and nothing else --------------------------------
# portal.asgi.ingest_application runs on the only platform servers learner pods may reach.
@async_to_sync
async def request(method, path, body=b"", headers=()):
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers]
    communicator = HttpCommunicator(ingest_application, method, path, body=body, headers=headers)
    response = await communicator.get_response(timeout=10)
    return response["status"], json.loads(response["body"])


def test_an_ingest_server_stores_and_acknowledges_an_agents_post(running_job):
    target, token = running_job, running_job.tokens[0]
    records = [{"seq": 1, "kind": "log", "stream": "stdout", "time": 1.0, "line": "hello"}]
    status, body = request("POST", f"/api/v1/ingest/{target.id}/",
                           json.dumps({"attempt": 1, "learner": 0, "records": records}).encode(),
                           [(b"authorization", f"Ingest {token}".encode())])
    assert (status, body) == (200, {"acked": 1})
    assert list(LogLine.objects.values_list("line", flat=True)) == ["hello"]


@pytest.mark.parametrize("method, path", [
    ("GET", "/api/v1/jobs/"),  # the API, even with a good token
    ("POST", "/api/v1/jobs/"),
    ("GET", "/admin/"),
    ("GET", "/login/"),
    ("GET", "/api/schema/"),
    ("GET", "/metrics"),
    ("GET", "/api/v1/ingest/"),  # no job id
])
def test_an_ingest_server_serves_nothing_else_of_the_platform(method, path):
    token = token_for(member())
    status, body = request(method, path, b"{}", [(b"authorization", f"Token {token}".encode())])
    assert status == 404 and "ingest" in body["detail"]


def test_an_ingest_server_refuses_websockets():
    async def connect():
        communicator = WebsocketCommunicator(ingest_application, "/ws/jobs/",
                                             headers=[(b"host", b"testserver"), (b"origin", b"http://testserver")])
        connected, _ = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected
    assert async_to_sync(connect)() is False
