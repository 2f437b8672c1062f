"""PostgreSQL through psycopg2, with the connections a process closes kept for its next ones
(ENGINE "portal.pgpool", chosen by portal/settings.py for a postgres:// DATABASE_URL).

Why: the ASGI server runs each request in a thread of its own, so Django cannot keep a connection
for the next request (CONN_MAX_AGE keeps one per thread), and every request, websocket database
call and Celery task opened one: a PostgreSQL backend process forked and set up each time, about
5 ms of mostly the server's CPU against 0.4 ms for the same two queries on a kept connection (on
this 2-core machine). Django pools connections itself only with psycopg 3; this project runs on
psycopg2. So a connection Django closes in a clean state goes back to its process's idle list, and
the next one Django opens with the same parameters takes it.

What keeps that safe:
- only a connection in autocommit with no transaction open is kept; anything else is closed;
- a connection that may hold a cursor its user left open (Django opened a named cursor on it: an
  `.iterator()`'s holdable cursor, whose name a later user could reuse) is cleaned with one round
  trip (`CLOSE ALL`) when it is put back; one that held none goes back as it is. When a connection
  is taken, only what the server sent it while it was idle is looked at, without a round trip: a
  session the server dropped (a restart, an idle timeout, a terminated backend) has left its last
  words or the end of the stream there, and is closed and replaced, not handed to a request. (A
  round trip at every take was a tenth of an ingest request's time under load, and the one at
  every put, before an ingest post's response, another 6%: bench controlplane, py-spy.)
- a forked process never uses its parent's connections (their sockets are shared);
- at most IDLE_MAX are kept per process and database, none longer than IDLE_S;
- session state does not leak: the platform sets none beyond what Django sets on every connect
  (time zone, role), and takes its advisory lock per transaction (jobs.admission).
"""
import logging
import os
import select
import threading
import time

import psycopg2
from django.db.backends.postgresql import base, creation

log = logging.getLogger(__name__)
IDLE_MAX = 8  # kept per process and database: a web process's concurrent requests, a worker's tasks
IDLE_S = 60.0  # a connection idle longer is closed instead (servers and proxies drop idle ones)


class IdleConnections:
    """One process's idle connections, by connection parameters."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.idle = {}  # parameters -> [(connection, time.monotonic() it was put back), ...]

    def take(self, key):
        """A live idle connection for `key`, or None."""
        while True:
            with self.lock:
                self._forget_if_forked()
                kept = self.idle.get(key)
                if not kept:
                    return None
                connection, since = kept.pop()
            if time.monotonic() - since < IDLE_S and _clean(connection) and _quiet(connection):
                return connection
            _close_quietly(connection)

    def put(self, key, connection, *, cursors_declared=True):
        """Keep `connection` if it is clean and there is room; close it otherwise. `cursors_declared`:
        its user may have left a server-side cursor open on it, which is closed first."""
        if not (_cleaned(connection) if cursors_declared else _clean(connection)):
            _close_quietly(connection)
            return
        with self.lock:
            self._forget_if_forked()
            kept = self.idle.setdefault(key, [])
            if len(kept) < IDLE_MAX:
                kept.append((connection, time.monotonic()))
                return
        _close_quietly(connection)

    def drain(self, key=None):
        """Close the idle connections (for `key`, or all): before a database is dropped."""
        with self.lock:
            self._forget_if_forked()
            keys = [key] if key is not None else list(self.idle)
            closing = [connection for k in keys for connection, _ in self.idle.pop(k, [])]
        for connection in closing:
            _close_quietly(connection)

    def count(self, key=None):
        with self.lock:
            self._forget_if_forked()
            return sum(len(kept) for k, kept in self.idle.items() if key is None or k == key)

    def _forget_if_forked(self):
        # The parent's sockets: closing them here would end the parent's sessions too.
        if self.pid != os.getpid():
            self.pid, self.idle = os.getpid(), {}


IDLE = IdleConnections()


def _clean(connection):
    return (not connection.closed and connection.autocommit
            and connection.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE)


def _cleaned(connection):
    # One round trip that closes any cursor its user left open (an abandoned .iterator()'s holdable
    # cursor, whose name a later thread could reuse) and proves the session alive.
    if not _clean(connection):
        return False
    try:
        with connection.cursor() as cursor:
            cursor.execute("CLOSE ALL")
        return _clean(connection)
    except psycopg2.Error:
        return False


def _quiet(connection):
    """Nothing arrived on an idle connection: a server that ends a session says so, or closes it."""
    try:
        readable, _, _ = select.select([connection.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg2.Error):
        return False
    return not readable


def _close_quietly(connection):
    try:
        connection.close()
    except psycopg2.Error:
        log.debug("closing a dropped connection failed", exc_info=True)


def _key(conn_params):
    return tuple(sorted((name, repr(value)) for name, value in conn_params.items()))


class DatabaseCreation(creation.DatabaseCreation):
    def _destroy_test_db(self, test_database_name, verbosity):
        IDLE.drain()  # DROP DATABASE refuses while this process still holds connections to it
        super()._destroy_test_db(test_database_name, verbosity)


class DatabaseWrapper(base.DatabaseWrapper):
    creation_class = DatabaseCreation

    _cursors_declared = False  # a named (server-side) cursor was opened since the connection was taken

    def get_new_connection(self, conn_params):
        self._pool_key = _key(conn_params)
        self._cursors_declared = False
        return IDLE.take(self._pool_key) or super().get_new_connection(conn_params)

    def create_cursor(self, name=None):
        if name is not None:  # Django's chunked_cursor (.iterator()): holdable in autocommit
            self._cursors_declared = True
        return super().create_cursor(name)

    def _close(self):
        if self.connection is None:
            return None
        if self.in_atomic_block:  # closed mid-transaction: Django rolls back by dropping it
            return super()._close()
        IDLE.put(self._pool_key, self.connection, cursors_declared=self._cursors_declared)
        self._cursors_declared = False
        return None
