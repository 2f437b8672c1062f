"""Chaos for the scheduling loop (jobs.scheduler_loop): two `manage.py run_scheduler` processes, the
leader SIGKILLed in the middle of a cycle, while jobs wait in the queue. The standby takes the lease
and admits them within 10 s, each once (one PENDING per job and attempt), and they run to the end.

Mid-cycle, for sure: the jobs wait on their tenant's quota (0 jobs at once). The test opens a
transaction that holds the admission lock (PostgreSQL: its advisory lock; SQLite: the database's write
lock, BEGIN IMMEDIATE) and lifts the quota in it, then wakes the loop: the leader takes the wake,
starts its cycle and waits for the lock inside it. The leader is killed there; then the test commits.
Nothing wakes the standby but its own takeover (and what wakes any leader: reconcile passes).
"""
import random
import re
import time
from datetime import datetime
from urllib.parse import urlsplit

import pytest
import redis

from jobs import admission, dispatch
from tenants.models import Quota, Tenant
from tests.chaos.invariants import check_job, submit

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]
SCHEDULERS = ("scheduler", "scheduler2")
TAKEOVER_S = 10.0


def scheduler_log(chaos, name):
    path = chaos.platform.log_dir / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def role_of(chaos, name):
    """"leading" or "standing by", as the process `name` running now last said; None before it says."""
    pid = chaos.platform.pids().get(name)
    said = re.findall(rf"scheduler: (leading|standing by) \(pid {pid}\b", scheduler_log(chaos, name))
    return said[-1] if pid and said else None


def wait_for_roles(chaos, timeout=60):
    """{"leading": name, "standing by": name} once both schedulers have said which they are."""
    deadline = time.monotonic() + timeout
    while True:
        roles = {name: role_of(chaos, name) for name in SCHEDULERS}
        if sorted(filter(None, roles.values())) == ["leading", "standing by"]:
            return {role: name for name, role in roles.items()}
        assert time.monotonic() < deadline, f"the schedulers did not settle into leader and standby: {roles}"
        time.sleep(0.1)


@pytest.fixture
def two_schedulers(chaos):
    """The platform's scheduler and a second one beside it (standing by, or leading if the first
    is gone); whichever the scenario kills is started again afterwards."""
    for name in SCHEDULERS:
        if name not in chaos.platform.processes:
            chaos.platform.start_scheduler(name)
    yield wait_for_roles(chaos)
    for name in SCHEDULERS:
        if name not in chaos.platform.processes:
            chaos.platform.start_scheduler(name)


class HeldAdmissionLock:
    """A transaction of the test's own on the platform's database that holds the admission lock
    (as a cycle holds it) and lifts a tenant's quota of jobs, committed when `commit` is called."""

    def __init__(self, database_url, tenant):
        url = urlsplit(database_url)
        self.postgres = url.scheme.startswith("postgres")
        quota, tenants = Quota._meta.db_table, Tenant._meta.db_table
        lift = f"UPDATE {quota} SET jobs = NULL WHERE tenant_id = (SELECT id FROM {tenants} WHERE slug = %s)"
        if self.postgres:
            import psycopg2
            self.connection = psycopg2.connect(database_url)
            cursor = self.connection.cursor()
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [admission.ADMISSION_LOCK_KEY])
        else:
            import sqlite3
            self.connection = sqlite3.connect(url.path, timeout=30, isolation_level=None)
            cursor = self.connection.cursor()
            cursor.execute("BEGIN IMMEDIATE")  # the write lock: every cycle's BEGIN waits for it
            lift = lift.replace("%s", "?")
        cursor.execute(lift, [tenant])

    def waiters(self):
        """Sessions waiting for the admission lock (PostgreSQL; None on SQLite, which cannot tell)."""
        if not self.postgres:
            return None
        import psycopg2
        with psycopg2.connect(self.connection.dsn) as other, other.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                           "AND classid = 0 AND objid = %s", [admission.ADMISSION_LOCK_KEY])
            return cursor.fetchone()[0]

    def commit(self):
        if self.postgres:
            self.connection.commit()
        else:
            self.connection.execute("COMMIT")
        self.connection.close()

    def abandon(self):
        try:
            self.connection.close()  # rolls back
        except Exception:  # noqa: BLE001 - closed already
            pass


def admitted_at(chaos, job_id):
    """When the job went QUEUED → PENDING (Unix time), and how many times it did, per attempt."""
    events = chaos.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    admissions = [e for e in events if e["to_status"] == "PENDING" and e["from_status"] == "QUEUED"]
    per_attempt = {}
    for event in admissions:
        per_attempt[event["attempt"]] = per_attempt.get(event["attempt"], 0) + 1
    first = datetime.fromisoformat(admissions[0]["time"].replace("Z", "+00:00")).timestamp() if admissions else None
    return first, per_attempt


def test_the_leader_is_killed_mid_cycle_and_the_standby_admits_the_queue(chaos, seed, two_schedulers):
    rng = random.Random(f"scheduler-leader:{seed}")
    count, pause = rng.randint(2, 3), rng.uniform(0.2, 1.0)
    leader, standby = two_schedulers["leading"], two_schedulers["standing by"]
    context = f"scheduler seed {seed}: {count} jobs queued, leader {leader} killed {pause:.2f}s into a cycle"
    tenant = chaos.session.tenant
    chaos.session.manage("tenant", "create", tenant, "--jobs", "0")  # its jobs wait in the queue
    held = None
    try:
        jobs = [submit(chaos)[0] for _ in range(count)]
        deadline = time.monotonic() + 20
        while not all("concurrent jobs" in (chaos.job(job_id)["wait_reason"] or "") for job_id in jobs):
            assert time.monotonic() < deadline, f"{context}: no cycle judged the queued jobs: " + repr(
                [chaos.job(job_id)["wait_reason"] for job_id in jobs])
            time.sleep(0.2)
        assert {chaos.job(job_id)["status"] for job_id in jobs} == {"QUEUED"}, context

        held = HeldAdmissionLock(chaos.platform.env["DATABASE_URL"], tenant)
        wakes = redis.Redis.from_url(chaos.platform.env["REDIS_URL"])
        token = f"chaos-{seed}-{time.time()}"
        wakes.lpush(dispatch.SCHEDULER_WAKE_KEY, token)
        deadline = time.monotonic() + 10
        while (held.waiters() == 0 if held.postgres
               else token.encode() in wakes.lrange(dispatch.SCHEDULER_WAKE_KEY, 0, -1)):
            assert time.monotonic() < deadline, f"{context}: the leader did not start a cycle"
            time.sleep(0.02)
        time.sleep(pause)  # the leader waits for the lock inside its cycle (it took the wake)
        chaos.platform.kill(leader)
        killed_at = time.time()
        held.commit()  # the quota lifted, the lock free: only a live scheduler can admit now
        held = None

        for job_id in jobs:
            chaos.wait_for(job_id, {"PENDING", "DOWNLOADING", "PROCESSING", "STORING", "COMPLETED"},
                           timeout=TAKEOVER_S + 5)
        for job_id in jobs:
            admitted, per_attempt = admitted_at(chaos, job_id)
            assert per_attempt == {1: 1}, f"{context}: {job_id} admitted {per_attempt} times per attempt"
            assert admitted - killed_at <= TAKEOVER_S, (
                f"{context}: {job_id} admitted {admitted - killed_at:.1f}s after the leader died")
        assert role_of(chaos, standby) == "leading", f"{context}: {standby} did not say it took over"
        for job_id in jobs:
            check_job(chaos, job_id, status="COMPLETED", attempts={1: "complete"}, context=context)
    finally:
        if held is not None:
            held.abandon()
        chaos.session.manage("shell", "-v", "0", "-c", (
            "from tenants.models import Quota; "
            f"Quota.objects.filter(tenant__slug={tenant!r}).update(jobs=None)"))


def test_the_only_scheduler_is_killed_and_the_job_is_admitted_once_it_is_back(chaos, seed):
    """One scheduling loop (as `make demo` runs it), SIGKILLed around a submission and started again:
    the job it may never have admitted is admitted by the one started again, once."""
    rng = random.Random(f"scheduler:{seed}")
    delay, downtime = rng.uniform(0.0, 1.0), rng.uniform(0.5, 3.0)
    context = f"scheduler seed {seed}: killed {delay:.2f}s after the submission, down {downtime:.2f}s"
    for name in SCHEDULERS[1:]:
        chaos.platform.stop_process(name)  # the standby a scenario before may have left
    job_id, submitted_at = submit(chaos)
    time.sleep(max(0.0, submitted_at + delay - time.monotonic()))
    chaos.kill("scheduler", downtime=downtime)
    job = check_job(chaos, job_id, status="COMPLETED", attempts={1: "complete"}, context=context)
    _, per_attempt = admitted_at(chaos, job["id"])
    assert per_attempt == {1: 1}, f"{context}: admitted {per_attempt} times per attempt"
