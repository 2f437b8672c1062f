"""The web servers' statements end at WEB_STATEMENT_TIMEOUT_S: a request stuck on the database is a 503."""
import json
import os
import subprocess
import sys
import threading
import time

import psycopg2
import pytest
from django.db import connection

from tests.support.asgi import serve_get
from tests.support.builders import logged_in, member, token_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
RELEASE_AFTER_S = 8  # the lock is let go then, so the request ends even without a limit


@pytest.fixture
def postgres():
    if connection.vendor != "postgresql":
        pytest.skip("statement_timeout is PostgreSQL's; SQLite has none")


@pytest.fixture
def jobs_table_locked(postgres):
    """The jobs table held by another session (a migration, a stuck transaction) for RELEASE_AFTER_S."""
    params = connection.get_connection_params()
    holder = psycopg2.connect(**{key: params[key] for key in ("dbname", "user", "host", "port") if key in params})
    holder.cursor().execute("LOCK TABLE jobs_job IN ACCESS EXCLUSIVE MODE")
    timer = threading.Timer(RELEASE_AFTER_S, holder.rollback)
    timer.start()
    yield
    timer.cancel()
    holder.rollback()
    holder.close()


def test_an_api_request_waiting_on_the_database_past_the_limit_is_a_503(settings, jobs_table_locked):
    token = token_for(member())
    settings.WEB_STATEMENT_TIMEOUT_S = 0.5  # after this test's own connection is made: the server's get it
    started = time.monotonic()
    status, body = serve_get("/api/v1/jobs/", headers=[(b"authorization", f"Token {token}".encode())])
    waited = time.monotonic() - started
    assert status == 503, body
    assert "within 0.5 s" in json.loads(body)["detail"]
    assert waited < RELEASE_AFTER_S / 2


def test_a_page_waiting_on_the_database_past_the_limit_is_a_503(settings, jobs_table_locked):
    session = logged_in(member()).cookies["sessionid"].value
    settings.WEB_STATEMENT_TIMEOUT_S = 0.5
    status, body = serve_get("/", headers=[(b"cookie", f"sessionid={session}".encode())])
    assert status == 503
    assert b"did not answer this request within 0.5 s" in body


def test_only_the_servers_connections_are_limited(postgres):
    """A worker, beat or the scheduling loop never imports portal.asgi, and its statements have no limit."""
    check = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'portal.settings'); django.setup()\n"
             "{imports}\nfrom django.db import connection\n"
             "with connection.cursor() as c:\n    c.execute('SHOW statement_timeout'); print(c.fetchone()[0])")
    env = {**os.environ, "TRAINYARD_WEB_STATEMENT_TIMEOUT_S": "7", "DATABASE_URL": os.environ["DATABASE_URL"]}

    def shown(imports):
        return subprocess.run([sys.executable, "-c", check.format(imports=imports)], env=env, check=True,
                              capture_output=True, text=True, timeout=120).stdout.split()[-1]
    assert shown("import jobs.tasks") == "0"
    assert shown("import portal.asgi") == "7s"
