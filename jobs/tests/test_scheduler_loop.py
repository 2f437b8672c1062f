"""The scheduling loop (jobs.scheduler_loop): its lease (one leader at a time, taken over when the
leader dies), its wakes through Redis, its intervals. The loop with the whole platform, its leader
SIGKILLed mid-cycle: tests/chaos/test_scheduler_chaos.py."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from jobs import dispatch, scheduler_loop
from jobs.scheduler_loop import FileLease, PostgresLease, SchedulerLoop, Wakes
from portal.runner import PROJECT_ROOT
from tests.support.optional import skip_or_fail


# --- the lease -------------------------------------------------------------------------------------
def hold_in_another_process(lease_code):
    """A process that takes the lease `lease_code` builds (Python, with FileLease and PostgresLease
    imported) and holds it until killed; returns it once it holds the lease."""
    program = ("import django, sys; django.setup()\n"
               "from jobs.scheduler_loop import FileLease, PostgresLease\n"
               f"lease = {lease_code}\n"
               "assert lease.try_acquire(), 'the lease was taken'\n"
               "print('held', flush=True)\n"
               "sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", program], cwd=PROJECT_ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=dict(os.environ, DJANGO_SETTINGS_MODULE="portal.settings"))
    assert holder.stdout.readline() == b"held\n"
    return holder


def taken_within(lease, seconds):
    deadline = time.monotonic() + seconds
    while not lease.try_acquire():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_file_lease_has_one_holder_at_a_time(tmp_path):
    first, second = FileLease(tmp_path / "lease"), FileLease(tmp_path / "lease")
    assert first.try_acquire() and first.try_acquire()  # held: asking again keeps it
    assert not second.try_acquire()
    first.release()
    assert second.try_acquire() and not first.try_acquire()
    second.release()


def test_a_file_lease_is_taken_over_when_its_holder_is_killed(tmp_path):
    holder = hold_in_another_process(f"FileLease({str(tmp_path / 'lease')!r})")
    standby = FileLease(tmp_path / "lease")
    try:
        assert not standby.try_acquire()
        holder.kill()  # SIGKILL: no chance to let go
        holder.wait()
        assert taken_within(standby, 1)
    finally:
        holder.kill()
        standby.release()


@pytest.fixture
def postgres_params(db):
    from django.db import connection
    if connection.vendor != "postgresql":
        skip_or_fail("the PostgreSQL lease needs PostgreSQL (set DATABASE_URL)")
    return connection.get_connection_params()


@pytest.mark.postgres
def test_a_postgres_lease_has_one_holder_at_a_time(postgres_params):
    first, second = PostgresLease(postgres_params), PostgresLease(postgres_params)
    try:
        assert first.try_acquire() and first.try_acquire() and first.still_held()
        assert not second.try_acquire()
        first.release()
        assert second.try_acquire() and not first.try_acquire()
    finally:
        first.release()
        second.release()


@pytest.mark.postgres
def test_a_postgres_lease_is_taken_over_when_its_holder_is_killed(postgres_params):
    params = {name: value for name, value in postgres_params.items() if name != "cursor_factory"}
    holder = hold_in_another_process(f"PostgresLease(__import__('json').loads({json.dumps(params)!r}))")
    standby = PostgresLease(postgres_params)
    try:
        assert not standby.try_acquire()
        holder.kill()  # SIGKILL: its session ends with its socket, and the lock with the session
        holder.wait()
        assert taken_within(standby, 2)
    finally:
        holder.kill()
        standby.release()


@pytest.mark.postgres
def test_a_leader_whose_session_is_gone_knows_it_has_lost_the_lease(postgres_params):
    from django.db import connection
    leader, standby = PostgresLease(postgres_params), PostgresLease(postgres_params)
    try:
        assert leader.try_acquire()
        pid = leader._session.get_backend_pid()
        with connection.cursor() as cursor:  # the server ends the session (a restart, a dropped link)
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        assert taken_within(standby, 2)
        assert not leader.still_held()
    finally:
        leader.release()
        standby.release()


def test_sqlite_platforms_lease_a_file_beside_their_database(settings, tmp_path):
    class SQLite:
        vendor = "sqlite"
        settings_dict = {"NAME": str(tmp_path / "trainyard.sqlite3")}
    lease = scheduler_loop.lease_for(SQLite())
    assert isinstance(lease, FileLease) and lease.path == tmp_path / "trainyard.sqlite3.scheduler-lease"


# --- the loop --------------------------------------------------------------------------------------
@pytest.fixture
def redis_url(tmp_path, settings):
    from tests.support.redis_server import RedisServer
    server = RedisServer(tmp_path).start()
    settings.REDIS_URL = server.url
    yield server.url
    server.stop()


class Cycles:
    """A stand-in for the cycle: records when each ran, takes `seconds`."""

    def __init__(self, seconds=0.0):
        self.seconds, self.started, self.ended = seconds, [], []

    def __call__(self):
        self.started.append(time.monotonic())
        time.sleep(self.seconds)
        self.ended.append(time.monotonic())


class Running:
    """A SchedulerLoop in a thread of the test's, stopped at the end."""

    def __init__(self, lease, redis_url, cycles, *, min_interval_s=0.2, max_interval_s=30.0):
        self.cycles = cycles
        self.loop = SchedulerLoop(lease=lease, wakes=Wakes(redis.Redis.from_url(redis_url)), cycle=cycles,
                                  min_interval_s=min_interval_s, max_interval_s=max_interval_s, standby_poll_s=0.05)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self.loop.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def wake(redis_url):
    redis.Redis.from_url(redis_url).lpush(dispatch.SCHEDULER_WAKE_KEY, 1)


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_new_leader_runs_a_cycle_at_once_and_then_one_per_wake(tmp_path, redis_url):
    cycles = Cycles()
    with Running(FileLease(tmp_path / "lease"), redis_url, cycles):
        assert wait_until(lambda: len(cycles.started) == 1, 2)  # its predecessor may have died mid-cycle
        time.sleep(0.5)
        assert len(cycles.started) == 1  # nothing woke it
        woken = time.monotonic()
        wake(redis_url)
        assert wait_until(lambda: len(cycles.started) == 2, 2)
        assert cycles.started[1] - woken < 1.0  # the rest after the first cycle was over: no waiting


def test_wakes_are_served_no_sooner_than_the_minimum_interval_and_many_by_one_cycle(tmp_path, redis_url):
    cycles = Cycles()
    with Running(FileLease(tmp_path / "lease"), redis_url, cycles, min_interval_s=2.0):
        assert wait_until(lambda: len(cycles.started) == 1, 2)
        for _ in range(5):  # a burst of submissions, all during the rest
            dispatch.wake_scheduler()
        burst_sent = time.monotonic()
        assert wait_until(lambda: len(cycles.started) == 2, 4)
        time.sleep(1.0)
    assert burst_sent < cycles.started[1]
    assert len(cycles.started) == 2
    assert cycles.started[1] - cycles.ended[0] >= 2.0


def test_a_wake_during_a_cycle_starts_another_after_it(tmp_path, redis_url):
    cycles = Cycles(seconds=0.3)
    with Running(FileLease(tmp_path / "lease"), redis_url, cycles, min_interval_s=0.0):
        assert wait_until(lambda: len(cycles.started) == 1, 2)
        wake(redis_url)  # the cycle may have read the queue before this change: another one must run
        assert wait_until(lambda: len(cycles.started) == 2, 2)
        assert cycles.started[1] >= cycles.ended[0] + 0.3  # after a rest as long as the cycle took


def test_without_wakes_a_cycle_runs_every_maximum_interval(tmp_path, redis_url):
    cycles = Cycles()
    with Running(FileLease(tmp_path / "lease"), redis_url, cycles, max_interval_s=0.6):
        assert wait_until(lambda: len(cycles.started) == 3, 3)
    gaps = [b - a for a, b in zip(cycles.started, cycles.started[1:])]
    assert all(0.55 < gap < 1.5 for gap in gaps), gaps


def test_without_redis_cycles_still_run_on_the_maximum_interval(tmp_path, settings):
    from portal.runner import free_port
    cycles = Cycles()
    with Running(FileLease(tmp_path / "lease"), f"redis://127.0.0.1:{free_port()}/0", cycles, max_interval_s=0.6):
        assert wait_until(lambda: len(cycles.started) == 3, 4)


def test_only_the_leader_runs_cycles_and_a_standby_takes_over_when_it_stops(tmp_path, redis_url):
    first, second = Cycles(), Cycles()
    with Running(FileLease(tmp_path / "lease"), redis_url, first) as leader:
        assert wait_until(lambda: len(first.started) == 1, 2)
        with Running(FileLease(tmp_path / "lease"), redis_url, second):
            for _ in range(3):
                wake(redis_url)
                time.sleep(0.3)
            assert len(first.started) > 1 and not second.started
            leader.stop()  # lets the lease go on its way out
            assert wait_until(lambda: len(second.started) == 1, 2)
            wake(redis_url)
            assert wait_until(lambda: len(second.started) == 2, 2)


def test_a_leader_that_loses_its_lease_stops_running_cycles(tmp_path, redis_url):
    class Revocable(FileLease):
        revoked = False

        def still_held(self):
            return not self.revoked and super().still_held()

    lease, cycles = Revocable(tmp_path / "lease"), Cycles()
    with Running(lease, redis_url, cycles):
        assert wait_until(lambda: len(cycles.started) == 1, 2)
        lease.revoked = True
        wake(redis_url)
        time.sleep(0.6)
        assert len(cycles.started) == 1


@pytest.mark.django_db
def test_a_cycle_runs_the_experiments_before_it_the_autoscaler_after_it_and_survives_an_error(monkeypatch, caplog):
    ran = []
    monkeypatch.setattr(scheduler_loop.experiments, "advance_all", lambda: ran.append("experiments"))
    monkeypatch.setattr(scheduler_loop.admission, "run_cycle", lambda: ran.append("cycle"))
    monkeypatch.setattr(scheduler_loop.autoscaler, "run", lambda: ran.append("autoscaler"))
    scheduler_loop.run_cycle()
    assert ran == ["experiments", "cycle", "autoscaler"]
    ran.clear()

    def broken():
        raise RuntimeError("the database went away")
    monkeypatch.setattr(scheduler_loop.admission, "run_cycle", broken)
    scheduler_loop.run_cycle()  # logged; the loop goes on
    assert "the scheduling cycle failed" in caplog.text and ran == ["experiments"]


def held_elsewhere(lease):
    if not lease.path.exists():
        return False
    if lease.try_acquire():  # not yet: the file is there, its lock not taken yet
        lease.release()
        return False
    return True


def test_the_command_lets_the_lease_go_on_sigterm(tmp_path, redis_url):
    """`manage.py run_scheduler` as the runner starts it: on SIGTERM it stops and frees the lease."""
    database = tmp_path / "trainyard.sqlite3"
    env = dict(os.environ, DATABASE_URL=f"sqlite:///{database}", REDIS_URL=redis_url,
               TRAINYARD_DATA_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="portal.settings")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=PROJECT_ROOT, env=env, check=True)
    process = subprocess.Popen([sys.executable, "manage.py", "run_scheduler"], cwd=PROJECT_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lease = FileLease(f"{database}.scheduler-lease")
    try:
        assert wait_until(lambda: held_elsewhere(lease), 30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert lease.try_acquire()
    finally:
        process.kill()
        lease.release()
    assert b"scheduler: leading" in process.stdout.read()
