"""A running platform with a tenant, a user and an API token, for the end-to-end, chaos and security
tests and the benchmarks: `portal.runner.start_platform` (what `make demo` runs, so all of them
exercise the processes a user runs) plus what only tests want — a fresh database and a Redis database
of its own per session, and helpers to submit, wait and read logs.

Backing services come from the environment: PostgreSQL when DATABASE_URL names a server (a fresh
database per session, dropped afterwards), else SQLite; the given REDIS_URL (a database of its own,
emptied first), else the embedded Redis.
"""
import itertools
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

from portal.runner import PROJECT_ROOT, Platform, create_account, free_port, manage, start_platform, stop_learner_agents
from trainyard.packing import code_upload

EXAMPLES = PROJECT_ROOT / "examples"
FINAL = frozenset({"COMPLETED", "FAILED", "TERMINATED"})


@dataclass
class PlatformSession:
    platform: Platform
    token: str
    username: str
    password: str
    tenant: str
    data_dir: Path
    cleanups: list = field(default_factory=list)

    @property
    def url(self):
        return self.platform.url

    @property
    def env(self):
        return self.platform.env

    # --- talking to it -----------------------------------------------------------------------------
    def api(self, method, path, *, token=None, **kwargs):
        headers = kwargs.pop("headers", {})
        headers.setdefault("Authorization", f"Token {token or self.token}")
        return requests.request(method, self.url + path, headers=headers, timeout=60, **kwargs)

    def submit(self, example, *, manifest_text=None, token=None, wait_out_limits=True):
        """Submit examples/<example> (optionally with another manifest); return the job JSON.
        `wait_out_limits`: past the tenant's submission rate, wait and submit again (below)."""
        folder = EXAMPLES / example
        manifest = manifest_text if manifest_text is not None else (folder / "manifest.yml").read_text()
        code = code_upload(str(folder))
        with code.fileobj:
            files = {"manifest": ("manifest.yml", manifest), "code": (code.filename, code.fileobj.read())}
        response = self.api("POST", "/api/v1/jobs/", token=token, files=files)
        # Past its tenant's submission rate (a 429 with Retry-After) it waits, as a polite script does:
        # the suites sharing a platform submit in bursts; the limits have tests of their own.
        for _ in range(3 if wait_out_limits else 0):
            if response.status_code != 429 or "Retry-After" not in response.headers:
                break
            time.sleep(int(response.headers["Retry-After"]))
            response = self.api("POST", "/api/v1/jobs/", token=token, files=files)
        if response.status_code != 201:
            raise AssertionError(f"submit {example}: {response.status_code} {response.text}")
        return response.json()

    def job(self, job_id, *, token=None):
        return self.api("GET", f"/api/v1/jobs/{job_id}/", token=token).json()

    def add_member(self, tenant, username, *, role="researcher", password=None):
        """Create (or update) a tenant member; return an API token of theirs."""
        return create_account(self.env, tenant=tenant, username=username, password=password, role=role)

    def sdk(self):
        """A trainyard.Client of the platform's user, as a script would make one."""
        from trainyard import Client
        return Client(self.url, self.token, self.tenant)

    def wait_for(self, job_id, statuses=FINAL, timeout=120, poll=0.1, *, token=None):
        return wait_for_status(lambda i: self.job(i, token=token), job_id, statuses, timeout=timeout, poll=poll)

    def wait_until(self, job_id, check, *, timeout, poll=0.2):
        """The job once `check(job)` holds; fail after `timeout` seconds."""
        def get(i):
            job = self.job(i)
            return dict(job, status="ok" if check(job) else job["status"])
        return wait_for_status(get, job_id, {"ok"}, timeout=timeout, poll=poll)

    def all_logs(self, job_id):
        lines, since = [], 0
        while True:
            page = self.api("GET", f"/api/v1/jobs/{job_id}/logs/", params={"since": since, "limit": 10000}).json()
            if not page["results"]:
                return lines
            lines += page["results"]
            since = page["next_since"]

    def cli(self, *args, timeout=300):
        env = dict(os.environ, TRAINYARD_URL=self.url, TRAINYARD_TOKEN=self.token, HOME=str(self.data_dir))
        return subprocess.run([str(Path(sys.executable).with_name("trainyard")), *args], cwd=PROJECT_ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)

    def manage(self, *args, env=None):
        return manage(dict(self.env, **(env or {})), *args)

    # --- lifecycle ---------------------------------------------------------------------------------
    def stop(self):
        self.platform.stop()
        stop_learner_agents(self.data_dir)
        for cleanup in reversed(self.cleanups):
            cleanup()


def wait_for_status(get_job, job_id, statuses, *, timeout, poll=0.1):
    """Poll `get_job(job_id)` until its status is one of `statuses`; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        job = get_job(job_id)
        if job["status"] in statuses:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} still {job['status']} after {timeout:.0f}s "
                                 f"(wanted {'/'.join(sorted(statuses))}): {job.get('status_reason')}")
        time.sleep(poll)


def start_session(data_dir, *, port=None, tenant="team-a", username="alice", password="alice-password",
                  quiet=True, public_url=None, supervise=False, **extra_env):
    """A fresh database and Redis database, then `portal.runner.start_platform`; a PlatformSession.

    `public_url` is the address learner agents post to, when it is not the web server's own;
    `supervise` starts again any part that exits on its own (runner.Platform).
    """
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    cleanups = []
    env = dict(os.environ, TRAINYARD_DATA_DIR=str(data_dir), **extra_env)
    env.update(backing_services(data_dir, cleanups))
    try:
        platform, token = start_platform(data_dir, port=port or free_port(), tenant=tenant, username=username,
                                         password=password, env=env, quiet=quiet, public_url=public_url,
                                         supervise=supervise)
    except BaseException:
        for cleanup in reversed(cleanups):
            cleanup()
        raise
    return PlatformSession(platform, token, username, password, tenant, data_dir, cleanups)


def backing_services(data_dir, cleanups):
    """The environment naming a fresh database and a Redis database of its own for a platform in
    `data_dir` (what start_session gives its platform; a test running `manage.py demo` itself gives
    it the same); what must be dropped afterwards is added to `cleanups`."""
    return {"DATABASE_URL": _database(data_dir, cleanups), **_redis_env()}


def _database(data_dir, cleanups):
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        return f"sqlite:///{data_dir / 'trainyard.sqlite3'}"
    import psycopg2
    name = f"trainyard_{uuid.uuid4().hex[:10]}"

    def admin(sql):
        connection = psycopg2.connect(url)
        connection.autocommit = True
        try:
            connection.cursor().execute(sql)
        finally:
            connection.close()

    admin(f'CREATE DATABASE "{name}"')
    cleanups.append(lambda: admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    return f"{url.rsplit('/', 1)[0]}/{name}"


# Sessions alive at the same time (the e2e suite's shared platform and a test's own) must not share a
# Redis database: one platform's worker would take the other's tasks, and flushing it would drop them.
# Each session takes the next of these that no client is connected to (a long-lived session, or a
# process a killed one left behind, keeps its database busy); 0-5 stay for the tests themselves.
_SESSION_REDIS_DBS = range(6, 16)
_next_redis_db = itertools.cycle(_SESSION_REDIS_DBS)


def _redis_env():
    url = os.environ.get("REDIS_URL")
    if not url:
        return {"REDIS_URL": "", "TRAINYARD_EMBEDDED_REDIS_PORT": str(free_port())}
    import redis
    base = url.rsplit("/", 1)[0]
    busy = {int(client["db"]) for client in redis.Redis.from_url(url).client_list()}
    for _ in _SESSION_REDIS_DBS:
        db = next(_next_redis_db)
        if db not in busy:
            break
    else:
        raise RuntimeError(f"every Redis database {_SESSION_REDIS_DBS.start}-{_SESSION_REDIS_DBS.stop - 1} of "
                           f"{base} has clients: stop the platforms that use them")
    dedicated = f"{base}/{db}"
    redis.Redis.from_url(dedicated).flushdb()
    return {"REDIS_URL": dedicated}
