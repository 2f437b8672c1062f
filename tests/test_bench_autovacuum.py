"""bench.autovacuum: the stand-in for PostgreSQL's autovacuum that bench controlplane runs where the
server has it off, against the machine's PostgreSQL."""
import os
import uuid

import pytest

from bench.autovacuum import Autovacuum
from tests.support.optional import skip_or_fail


@pytest.fixture
def database():
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        skip_or_fail("needs PostgreSQL (DATABASE_URL=postgres://...)")
    import psycopg2
    name = f"trainyard_autovacuum_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(url)
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    scratch = f"{url.rsplit('/', 1)[0]}/{name}"
    try:
        yield scratch
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def statistics(connection, table):
    with connection.cursor() as cursor:
        cursor.execute("SELECT vacuum_count, analyze_count, autovacuum_count, autoanalyze_count "
                       "FROM pg_stat_user_tables WHERE relname = %s", [table])
        return cursor.fetchone()


def test_it_vacuums_and_analyzes_the_tables_past_autovacuums_thresholds_and_no_others(database):
    import psycopg2
    connection = psycopg2.connect(database)
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE churned (id int PRIMARY KEY, note text)")
        cursor.execute("CREATE TABLE quiet (id int PRIMARY KEY)")
        cursor.execute("INSERT INTO churned SELECT i, 'x' FROM generate_series(1, 2000) i")
        cursor.execute("UPDATE churned SET note = 'y'")  # 2,000 dead rows: past 50 + 20% of 2,000
        cursor.execute("INSERT INTO quiet VALUES (1), (2)")  # under every threshold
        cursor.execute("SELECT pg_stat_force_next_flush()")
    with Autovacuum(database) as stand_in:
        stand_in.run_once()
        assert (stand_in.vacuums, stand_in.analyzes) == (1, 1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
    assert statistics(connection, "churned")[:2] == (1, 1)
    assert statistics(connection, "quiet")[:2] == (0, 0)
    connection.close()

