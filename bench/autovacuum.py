"""A stand-in for PostgreSQL's autovacuum, for a server that has it switched off.

A deployment's PostgreSQL runs autovacuum (on by default): it VACUUMs a table once enough of its
rows have died or been inserted, and ANALYZEs it once enough have changed. A test server may have it
off (this machine's does, so that test databases stay as the tests leave them). A bench on such a
server measures the platform on tables that only gather dead rows and have no statistics, which no
deployment sees: in bench controlplane the 10,000 queued jobs' rows are rewritten every few seconds
(their queue positions), and counting them took 33 ms after ten rewrites against 12 ms after a
VACUUM (an idle machine).

`Autovacuum(url)` does in a thread what the autovacuum launcher does for that one database, where the
server's autovacuum is off: every autovacuum_naptime it VACUUMs each table past autovacuum's vacuum
or insert threshold and ANALYZEs each past its analyze threshold. The thresholds are the formulas of
PostgreSQL's documentation ("The Autovacuum Daemon") with the server's own settings, and the work is
throttled by the autovacuum cost settings, as autovacuum's is. Where autovacuum is on, it does nothing.
Its work runs in a PostgreSQL backend, so its CPU is counted with PostgreSQL's, as autovacuum's is.
"""
import logging
import threading

log = logging.getLogger(__name__)

SETTINGS = ("autovacuum", "autovacuum_naptime", "autovacuum_vacuum_threshold", "autovacuum_vacuum_scale_factor",
            "autovacuum_vacuum_insert_threshold", "autovacuum_vacuum_insert_scale_factor",
            "autovacuum_analyze_threshold", "autovacuum_analyze_scale_factor", "autovacuum_vacuum_cost_delay",
            "autovacuum_vacuum_cost_limit", "vacuum_cost_limit")
TABLES = """
    SELECT s.schemaname, s.relname, s.n_dead_tup, s.n_ins_since_vacuum, s.n_mod_since_analyze,
           greatest(c.reltuples, 0)
    FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
"""


class Autovacuum:
    """Use as a context manager around the measured work; `describe()` says what it did."""

    def __init__(self, url):
        import psycopg2
        self._connection = psycopg2.connect(url)
        self._connection.autocommit = True  # VACUUM runs outside a transaction
        self.settings = self._settings()
        self.active = self.settings["autovacuum"] == "off"
        self.vacuums, self.analyzes = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autovacuum stand-in", daemon=True)

    def __enter__(self):
        if self.active:
            self._throttle()
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._connection.close()

    def describe(self):
        if not self.active:
            return "the server's own (on)"
        return (f"off on this server; a stand-in ran its thresholds every {self.settings['autovacuum_naptime']:g} s: "
                f"{self.vacuums} VACUUMs, {self.analyzes} ANALYZEs")

    def run_once(self):
        """One round of the launcher over this database: VACUUM or ANALYZE what is past its threshold."""
        s = self.settings
        with self._connection.cursor() as cursor:
            cursor.execute(TABLES)
            tables = cursor.fetchall()
        for schema, name, dead, inserted, modified, tuples in tables:
            vacuum = (dead > s["autovacuum_vacuum_threshold"] + s["autovacuum_vacuum_scale_factor"] * tuples
                      or inserted > (s["autovacuum_vacuum_insert_threshold"]
                                     + s["autovacuum_vacuum_insert_scale_factor"] * tuples))
            analyze = modified > s["autovacuum_analyze_threshold"] + s["autovacuum_analyze_scale_factor"] * tuples
            if not (vacuum or analyze):
                continue
            table = f'"{schema}"."{name}"'
            command = f"VACUUM (ANALYZE) {table}" if vacuum and analyze else (
                f"VACUUM {table}" if vacuum else f"ANALYZE {table}")
            with self._connection.cursor() as cursor:
                cursor.execute(command)
            self.vacuums += vacuum
            self.analyzes += analyze

    def _run(self):
        while not self._stop.wait(self.settings["autovacuum_naptime"]):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - a missed round is what a busy autovacuum does too
                log.warning("the autovacuum stand-in's round failed: %s", exc)

    def _settings(self):
        with self._connection.cursor() as cursor:
            cursor.execute("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", [list(SETTINGS)])
            values = dict(cursor.fetchall())
        return {name: value if name == "autovacuum" else float(value) for name, value in values.items()}

    def _throttle(self):
        # A manual VACUUM runs unthrottled (vacuum_cost_delay 0); autovacuum's is held to its cost settings.
        limit = self.settings["autovacuum_vacuum_cost_limit"]
        if limit < 0:
            limit = self.settings["vacuum_cost_limit"]
        with self._connection.cursor() as cursor:
            cursor.execute(f"SET vacuum_cost_delay = '{self.settings['autovacuum_vacuum_cost_delay']:g}ms'")
            cursor.execute(f"SET vacuum_cost_limit = {int(limit)}")
