"""The PostgreSQL backend that keeps a process's closed connections for its next ones (portal.pgpool),
against the machine's PostgreSQL."""
import os
import threading
import time

import psycopg2
import pytest
from django.db import connection, connections

from portal.pgpool import base as pool
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def postgresql():
    if connection.vendor != "postgresql":
        skip_or_fail("needs PostgreSQL (DATABASE_URL=postgres://...)")
    assert isinstance(connections["default"], pool.DatabaseWrapper), "settings choose the pooling backend"
    pool.IDLE.drain()
    yield
    pool.IDLE.drain()


def in_a_thread(function):
    """`function()` run in a thread of its own, as the ASGI server runs each request, which closes
    its connection at the end (as Django does when the request finishes)."""
    result = []

    def run():
        try:
            result.append(function())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return result[0]


def backend_pid():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def raw_connection():
    return psycopg2.connect(**connection.get_connection_params())


def test_the_next_request_runs_on_the_connection_the_last_one_closed():
    first, second = in_a_thread(backend_pid), in_a_thread(backend_pid)
    assert first == second  # one session, not a server process set up per request
    assert pool.IDLE.count() == 1


def test_concurrent_requests_each_get_a_connection_of_their_own_and_all_are_kept():
    started, release, pids = threading.Barrier(3), threading.Event(), []

    def hold():
        pids.append(backend_pid())
        started.wait(10)
        release.wait(10)

    threads = [threading.Thread(target=lambda: (hold(), connections.close_all())) for _ in range(2)]
    for thread in threads:
        thread.start()
    started.wait(10)
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(set(pids)) == 2
    assert pool.IDLE.count() == 2
    assert in_a_thread(backend_pid) in pids


def test_a_connection_left_in_a_transaction_is_closed_not_kept():
    raw = raw_connection()
    raw.cursor().execute("SELECT 1")  # not autocommit: a transaction is now open
    key = ("test", "in-transaction")
    pool.IDLE.put(key, raw)
    assert raw.closed
    assert pool.IDLE.take(key) is None


def test_a_connection_the_server_dropped_is_replaced_not_handed_out():
    dropped = in_a_thread(backend_pid)
    with raw_connection() as admin:
        admin.cursor().execute("SELECT pg_terminate_backend(%s)", [dropped])
    time.sleep(0.2)
    replacement = in_a_thread(backend_pid)  # the request works, on a new session
    assert replacement != dropped


def test_a_connection_idle_too_long_is_closed_instead_of_reused(monkeypatch):
    first = in_a_thread(backend_pid)
    monkeypatch.setattr(pool, "IDLE_S", 0.0)
    assert in_a_thread(backend_pid) != first


def test_no_more_than_idle_max_are_kept(monkeypatch):
    monkeypatch.setattr(pool, "IDLE_MAX", 1)
    key = ("test", "room")
    extra = [raw_connection() for _ in range(2)]
    for raw in extra:
        raw.autocommit = True
        pool.IDLE.put(key, raw)
    assert pool.IDLE.count(key) == 1
    assert extra[1].closed  # no room: closed, not leaked
    pool.IDLE.drain(key)
    assert extra[0].closed


def test_a_forked_child_does_not_use_its_parents_connections():
    parent_session = in_a_thread(backend_pid)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its first query must not run on the parent's socket
        try:
            os.write(writer, b"%d" % in_a_thread(backend_pid))
        finally:
            os._exit(0)
    os.close(writer)
    child_session = int(os.read(reader, 32) or 0)
    os.waitpid(child, 0)
    assert child_session and child_session != parent_session
    assert in_a_thread(backend_pid) == parent_session  # and the parent's is still whole


def test_a_cursor_its_user_left_open_is_closed_before_the_next_one_gets_the_connection():
    key = ("test", "cursors")
    raw = raw_connection()
    raw.autocommit = True
    raw.cursor().execute("DECLARE left_open CURSOR WITH HOLD FOR SELECT 1")  # as an abandoned .iterator()
    pool.IDLE.put(key, raw)
    taken = pool.IDLE.take(key)
    assert taken is raw
    with taken.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_cursors")
        assert cursor.fetchone()[0] == 0
    pool.IDLE.drain(key)


# The abandoned iterator, collected at the end, finds its cursor closed (as it should be) and says so.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_abandoned_iterators_cursor_is_closed_and_a_connection_without_one_goes_back_untouched():
    from django.contrib.auth import get_user_model
    from django.test.utils import CaptureQueriesContext

    User = get_user_model()
    for name in ("a", "b", "c"):
        User.objects.create(username=f"cursor-{name}")

    abandoned = []  # kept alive, so no finalizer closes its cursor

    def abandon_an_iterator():
        rows = User.objects.all().iterator(chunk_size=1)  # a named, holdable cursor in autocommit
        next(rows)
        abandoned.append(rows)
        return backend_pid()
    pid = in_a_thread(abandon_an_iterator)

    def open_cursors():
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_cursors")
            return backend_pid(), cursor.fetchone()[0]
    assert in_a_thread(open_cursors) == (pid, 0)  # the same session, its cursor closed on the way back

    # Nothing declared: the connection goes back to the idle list with no round trip (no CLOSE ALL).
    sent = []
    original = pool._cleaned
    pool._cleaned = lambda raw: sent.append("CLOSE ALL") or original(raw)
    try:
        in_a_thread(lambda: User.objects.filter(username="cursor-a").exists())
    finally:
        pool._cleaned = original
    assert sent == []
    assert pool.IDLE.count() == 1
