"""The scheduling loop: the one process that runs scheduling cycles (`manage.py run_scheduler`), as
Kueue runs its cycle in one manager process.

Every change that may let a queued job in (a submission, resources released by a finish or a
teardown, a resume, a quota change, each reconcile pass) wakes the loop through Redis
(jobs.dispatch.wake_scheduler: one item pushed on a list the loop waits on with BLPOP, trimmed to
one). Woken, the loop waits out its rest since the last cycle ended (TRAINYARD_SCHEDULER_MIN_INTERVAL,
or as long as that cycle took if longer, up to MAX_REST_S: cycles over a long queue never hold the
admission lock back to back), empties the list and runs `admission.run_cycle()`, then the
autoscaler. A wake that arrives while a cycle runs stays on the list and starts the next one; any
number of wakes before a cycle empties the list are served by that cycle, which reads everything
they committed before they were sent. Without a wake a cycle runs every
TRAINYARD_SCHEDULER_MAX_INTERVAL seconds, so a lost wake (Redis down, a process killed between its
commit and its wake) delays admissions by that much at most.

A cycle's admissions and preemptions write their follow-up rows in its transaction (the outbox,
jobs.states.transition) and the rows' messages leave when it commits, from this process, to the
Celery workers that deploy and halt.

**Leader and standby.** Any number of these processes may run (deploy/kubernetes runs two); one
leads and runs cycles, the others stand by and try to take the lease every STANDBY_POLL_S seconds.
The lease is a lock that the database's own machinery frees when its holder dies:
- PostgreSQL: a session-level advisory lock (LEASE_LOCK_KEY) taken with `pg_try_advisory_lock` on a
  connection of its own, kept open for as long as the process leads. The server frees it when the
  session ends: at once when the process dies (its kernel closes the socket: SIGKILL, OOM, a crashed
  container), and when the leader's machine vanishes, once the server's keepalives on that
  connection (about 10 s) give up. The leader checks its session before every cycle and stands down
  when it is gone. Through PgBouncer the same holds in its session mode, the one it must run in
  (docs/operating.md): the server session is the client's until the client goes, and PgBouncer's
  `DISCARD ALL` then unlocks it before another client gets it.
- SQLite (one machine: the database is a file every process opens): an exclusive `flock` on a file
  beside the database, which the kernel frees when the process dies, however it dies.
Neither expires while its holder lives, so there is no TTL to tune and no clock to trust; a standby
takes over within STANDBY_POLL_S of the leader's death, and its first cycle runs at once (the leader
may have died mid-cycle, with the wake that started it taken).

The lease only keeps cycles from being run twice for nothing. What makes them correct is still the
admission lock inside each cycle (jobs.admission: a transaction-scoped advisory lock on PostgreSQL,
the IMMEDIATE transaction's write lock on SQLite), which the autoscaler's periodic pass on the
workers takes too, and the compare-and-swap of every transition: a leader that stood down late (its
session gone unnoticed) and the new one run their cycles one after the other, the second seeing the
first's admissions, so no job is admitted twice. (That is why the lease is a lock of its own and not
the admission lock held for the leader's life: held that way, the autoscaler's pass on a worker
would wait for it forever.)
"""
import fcntl
import logging
import os
import threading
import time
from pathlib import Path

import redis
from django.conf import settings
from django.db import close_old_connections, connection

from jobs import admission, autoscaler, dispatch, experiments

log = logging.getLogger(__name__)
LEASE_LOCK_KEY = admission.ADMISSION_LOCK_KEY + 1  # "traj": a key no other lock of the platform takes
STANDBY_POLL_S = 1.0
# A cycle rests after it at least as long as it took, up to this: over a long queue a cycle takes a
# while, and such cycles back to back would hold the admission lock (and the database) all the time,
# each admitting the job or two that ended meanwhile. Paced, they take half of the time at most.
MAX_REST_S = 5.0
WAIT_SLICE_S = 1.0  # the longest one BLPOP blocks: a stop is noticed within this
# The server's keepalives on the lease's session (seconds): a leader whose machine vanished loses
# the lease after about IDLE + INTERVAL x COUNT.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 4, 2, 3


# --- the lease -------------------------------------------------------------------------------------
class PostgresLease:
    """A session-level advisory lock on a connection of its own (never one of Django's: Django closes
    and opens those as it pleases, and the lock would go with the session)."""

    def __init__(self, params, *, key=LEASE_LOCK_KEY):
        self.params = {name: value for name, value in params.items() if name != "cursor_factory"}
        self.key = key
        self._session = None
        self.held = False

    def try_acquire(self):
        """True if this process holds the lease now (it took it, or held it already)."""
        if self.held:
            return self.still_held()
        try:
            if self._session is None:
                self._session = self._connect()
            with self._session.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_lock(%s)", [self.key])
                self.held = bool(cursor.fetchone()[0])
        except Exception as exc:  # noqa: BLE001 - the database unreachable: stand by, try again
            log.warning("scheduler: could not ask for the lease (%s)", exc)
            self._drop()
        return self.held

    def still_held(self):
        """True while the session that holds the lock lives (the lock lives as long as it does)."""
        if not self.held:
            return False
        try:
            with self._session.cursor() as cursor:
                cursor.execute("SELECT 1")
            return True
        except Exception as exc:  # noqa: BLE001 - the session is gone, and the lock with it
            log.warning("scheduler: the lease's session is gone (%s)", exc)
            self._drop()
            return False

    def release(self):
        self._drop()  # ending the session frees the lock

    def _connect(self):
        import psycopg2
        session = psycopg2.connect(**self.params, keepalives=1, keepalives_idle=KEEPALIVE_IDLE_S,
                                   keepalives_interval=KEEPALIVE_INTERVAL_S, keepalives_count=KEEPALIVE_COUNT,
                                   application_name="trainyard-scheduler-lease")
        session.autocommit = True
        with session.cursor() as cursor:  # the server's side: it drops a vanished leader's session
            cursor.execute("SET tcp_keepalives_idle = %s; SET tcp_keepalives_interval = %s; "
                           "SET tcp_keepalives_count = %s",
                           [KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT])
        return session

    def _drop(self):
        self.held = False
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - closed already
                pass


class FileLease:
    """An exclusive flock on a file: the kernel frees it when the holding process dies."""

    def __init__(self, path):
        self.path = Path(path)
        self._fd = None

    @property
    def held(self):
        return self._fd is not None

    def try_acquire(self):
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # who leads, for a person looking
        self._fd = fd
        return True

    def still_held(self):
        return self._fd is not None

    def release(self):
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # frees the lock


def lease_for(db=None):
    """The lease that fits the platform's database."""
    db = db or connection
    if db.vendor == "postgresql":
        return PostgresLease(db.get_connection_params())
    name = str(db.settings_dict["NAME"])
    if db.vendor == "sqlite" and not name.startswith(("file:", ":memory:")):
        return FileLease(f"{name}.scheduler-lease")
    return FileLease(Path(settings.DATA_DIR) / "scheduler.lease")


# --- the wakes -------------------------------------------------------------------------------------
class Wakes:
    """The Redis list jobs.dispatch.wake_scheduler pushes to."""

    def __init__(self, client, key=dispatch.SCHEDULER_WAKE_KEY):
        self.client, self.key = client, key
        self._failing = False

    @classmethod
    def from_settings(cls):
        return cls(redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2,
                                        socket_timeout=WAIT_SLICE_S + 5))

    def wait(self, timeout):
        """True if a wake came within `timeout` seconds (at most WAIT_SLICE_S are waited)."""
        timeout = min(max(timeout, 0.01), WAIT_SLICE_S)
        try:
            woken = self.client.blpop([self.key], timeout=timeout) is not None
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            time.sleep(timeout)  # Redis is down: cycles run on the interval meanwhile
            return False
        self._recovered()
        return woken

    def clear(self):
        """Take every wake sent so far: the cycle about to start serves them."""
        try:
            self.client.delete(self.key)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)

    def _failed(self, exc):
        if not self._failing:
            log.warning("scheduler: Redis unreachable (%s); a cycle runs every %.0f s until it is back", exc,
                        settings.SCHEDULER_MAX_INTERVAL_S)
        self._failing = True

    def _recovered(self):
        if self._failing:
            log.info("scheduler: Redis is back; cycles run on wakes again")
        self._failing = False


# --- the loop --------------------------------------------------------------------------------------
def run_cycle():
    """The experiments' pass (the trials it starts are admitted by this cycle; jobs.experiments),
    one cycle and, after it, the autoscaler's pass (it grows elastic jobs onto what the cycle left
    idle; it returns at once unless an elastic job runs on GPUs). Errors are logged: the next cycle
    tries again (on a new connection, if the database dropped this one)."""
    try:
        experiments.advance_all()
    except Exception:  # noqa: BLE001
        log.exception("scheduler: the experiments' pass failed")
    try:
        admission.run_cycle()
    except Exception:  # noqa: BLE001 - e.g. the database restarting: the loop goes on
        log.exception("scheduler: the scheduling cycle failed")
        return
    try:
        autoscaler.run()
    except Exception:  # noqa: BLE001
        log.exception("scheduler: the autoscaler's pass failed")


class SchedulerLoop:
    def __init__(self, *, lease, wakes, min_interval_s, max_interval_s, cycle=run_cycle, stop=None,
                 standby_poll_s=STANDBY_POLL_S):
        self.lease, self.wakes, self.cycle = lease, wakes, cycle
        self.min_interval_s, self.max_interval_s = min_interval_s, max_interval_s
        self.standby_poll_s = standby_poll_s
        self.stop = stop or threading.Event()
        self.cycles = 0

    @classmethod
    def from_settings(cls, **kwargs):
        return cls(lease=lease_for(), wakes=Wakes.from_settings(), min_interval_s=settings.SCHEDULER_MIN_INTERVAL_S,
                   max_interval_s=settings.SCHEDULER_MAX_INTERVAL_S, **kwargs)

    def run(self):
        """Stand by until this process holds the lease, lead until it stops or loses it; again,
        until `stop` is set. The lease is let go on the way out."""
        standing_by = False
        try:
            while not self.stop.is_set():
                if not self.lease.try_acquire():
                    if not standing_by:
                        log.info("scheduler: standing by (pid %d; another process leads)", os.getpid())
                        standing_by = True
                    self.stop.wait(self.standby_poll_s)
                    continue
                standing_by = False
                log.info("scheduler: leading (pid %d)", os.getpid())
                self.lead()
                if not self.stop.is_set():
                    log.warning("scheduler: lost the lease; standing by")
        finally:
            self.lease.release()

    def lead(self):
        """Run cycles while this process holds the lease: the first at once, then on each wake
        (after the rest) and at least every max_interval_s."""
        woken, next_due, rest_until = True, 0.0, 0.0
        while not self.stop.is_set():
            if not woken:
                left = next_due - time.monotonic()
                woken = self.wakes.wait(left) if left > 0 else True
                if not woken:
                    continue
            if self.stop.wait(max(0.0, rest_until - time.monotonic())):
                return
            if not self.lease.still_held():
                return
            self.wakes.clear()
            started = time.monotonic()
            close_old_connections()  # one the database dropped since (a restart, an error) is replaced
            self.cycle()
            self.cycles += 1
            ended = time.monotonic()
            rest_until = ended + max(self.min_interval_s, min(ended - started, MAX_REST_S))
            next_due, woken = ended + self.max_interval_s, False
