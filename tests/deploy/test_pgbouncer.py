"""PgBouncer as deploy/pgbouncer/pgbouncer.ini configures it, in front of the machine's PostgreSQL (on a
database of the test's own): the platform's connections, a new one per request as Django opens them,
run on server sessions PgBouncer keeps, and what one client leaves on a session never reaches the next.
"""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dj_database_url
import psycopg2
import pytest
import yaml
from django.db.utils import ConnectionHandler

from tests.support import pgbouncer
from tests.support.optional import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.postgres


@pytest.fixture
def server():
    """(direct URL, URL through PgBouncer) of a scratch database on the machine's PostgreSQL."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://", "pgsql://")):
        skip_or_fail("needs PostgreSQL (DATABASE_URL=postgres://...)")
    if pgbouncer.executable() is None:
        skip_or_fail("needs pgbouncer (apt-get install pgbouncer)")
    params = dj_database_url.parse(url)
    name = f"pgbouncer_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(host=params["HOST"] or "127.0.0.1", port=int(params["PORT"] or 5432),
                             user=params["USER"] or "postgres", password=params["PASSWORD"] or None, dbname="postgres")
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    try:
        with pgbouncer.running(url) as through:
            yield f"{url.rsplit('/', 1)[0]}/{name}", through.url(name)
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def requests_may_connect(django_db_blocker):
    with django_db_blocker.unblock():  # databases of the test's own, not the suite's test database
        yield


def sessions_of_requests(url, count):
    """The server session (backend pid) each of `count` requests ran on, each request opening and
    closing its connection through Django's PostgreSQL backend as the platform's settings make it."""
    pids = []
    for _ in range(count):
        connection = ConnectionHandler({"default": dj_database_url.parse(url, conn_max_age=0)})["default"]
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pids.append(cursor.fetchone()[0])
        finally:
            connection.close()
    return pids


def test_it_runs_each_request_on_a_kept_session_instead_of_a_new_server_process(server, requests_may_connect):
    direct, pooled = server
    assert len(set(sessions_of_requests(direct, 3))) == 3  # without it: a backend forked per request
    assert len(set(sessions_of_requests(pooled, 3))) == 1


def test_what_a_client_leaves_on_its_session_does_not_reach_the_next(server):
    _, pooled = server
    first = psycopg2.connect(pooled)
    first.autocommit = True
    with first.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
        # An abandoned .iterator()'s holdable cursor, whose name a later request could reuse, and a setting.
        cursor.execute("DECLARE left_open CURSOR WITH HOLD FOR SELECT 1")
        cursor.execute("SET statement_timeout = 1234")
    first.close()

    second = psycopg2.connect(pooled)
    try:
        with second.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid(), (SELECT count(*) FROM pg_cursors),"
                           " current_setting('statement_timeout')")
            assert cursor.fetchone() == (pid, 0, "0")
    finally:
        second.close()


def test_its_sessions_are_in_utc_so_django_sets_no_time_zone_per_request(server):
    """Django sets its zone on each connection it opens unless the server reports that zone when the
    connection starts (a round trip per request); a session a client left in another zone comes back
    in UTC."""
    _, pooled = server
    assert ConnectionHandler({"default": dj_database_url.parse(pooled)})["default"].timezone_name == "UTC"
    for _ in range(2):
        client = psycopg2.connect(pooled)
        client.autocommit = True
        try:
            assert client.info.parameter_status("TimeZone") == "UTC"  # what Django compares with its zone
            with client.cursor() as cursor:
                cursor.execute("SELECT current_setting('TimeZone')")
                assert cursor.fetchone() == ("UTC",)
                cursor.execute("SET TIME ZONE 'Europe/Berlin'")
        finally:
            client.close()


def test_the_scheduling_loops_lease_is_freed_through_it_when_its_holder_is_killed(server):
    """The scheduling loop's lease (jobs.scheduler_loop.PostgresLease, a session-level advisory lock)
    through PgBouncer: held while its holder lives, freed for a standby once the holder is SIGKILLed
    (PgBouncer resets the server session it gives back)."""
    from jobs.scheduler_loop import PostgresLease
    _, pooled = server
    parsed = dj_database_url.parse(pooled)
    params = {"dbname": parsed["NAME"], "user": parsed["USER"], "host": parsed["HOST"], "port": parsed["PORT"],
              **({"password": parsed["PASSWORD"]} if parsed["PASSWORD"] else {})}
    program = ("import django, sys; django.setup()\n"
               "from jobs.scheduler_loop import PostgresLease\n"
               f"lease = PostgresLease({params!r})\n"
               "assert lease.try_acquire()\n"
               "print('held', flush=True)\n"
               "sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=dict(os.environ, DJANGO_SETTINGS_MODULE="portal.settings"))
    standby = PostgresLease(params)
    try:
        assert holder.stdout.readline() == b"held\n"
        assert not standby.try_acquire()
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 5
        while not standby.try_acquire():
            assert time.monotonic() < deadline, "the lease was not freed through PgBouncer"
            time.sleep(0.05)
    finally:
        holder.kill()
        standby.release()


def test_a_client_logs_in_with_scram_against_the_secret_in_its_user_list(server):
    """The shipped file's auth_type with the user list as the manual tells a deployment to write it (a
    SCRAM secret, no password): the password logs in, anything else is refused."""
    _, pooled = server
    parsed = dj_database_url.parse(pooled)
    assert pgbouncer.shipped_config()["pgbouncer"]["auth_type"] == "scram-sha-256"
    psycopg2.connect(pooled).close()
    with pytest.raises(psycopg2.OperationalError, match="SASL authentication failed"):
        psycopg2.connect(host=parsed["HOST"], port=parsed["PORT"], user=parsed["USER"], dbname=parsed["NAME"],
                         password="not-" + parsed["PASSWORD"])


def test_its_pool_holds_the_sessions_ingest_servers_keep_with_room_for_the_rest(settings):
    """Each ingest server's threads keep a session each (portal.overrides.ingest); at the production
    overlay's most ingest servers they must leave sessions for web requests and workers, within
    PostgreSQL's default max_connections (100, 3 of them reserved for superusers)."""
    scalers = yaml.safe_load_all((ROOT / "deploy/kubernetes/overlays/production/autoscaling.yaml").read_text())
    ingest = next(s for s in scalers if s["metadata"]["name"] == "trainyard-ingest")
    kept = ingest["spec"]["maxReplicas"] * settings.INGEST_THREADS
    pool = int(pgbouncer.shipped_config()["pgbouncer"]["default_pool_size"])
    assert kept <= pool // 2 and pool <= 100 - 3
