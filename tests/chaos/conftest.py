"""Chaos fixtures: one real platform per module, reached by the agents through a cuttable proxy;
seeds for the scenarios; and the "N scenarios run, M survived" report at the end of the session."""
import os
import shutil
import time

import pytest
import requests

from portal.runner import free_port
from tests.chaos.tcp_proxy import CuttableProxy
from tests.support.harness import start_session, wait_for_status

DEFAULT_SEEDS = "1,2"
PARTS = ("redis", "web", "worker", "scheduler", "beat")


def chaos_seeds():
    """TRAINYARD_CHAOS_SEEDS: seeds and ranges, e.g. "1,2" (the default), "7" or "1-20"."""
    seeds = []
    for item in os.environ.get("TRAINYARD_CHAOS_SEEDS", DEFAULT_SEEDS).split(","):
        first, _, last = item.strip().partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", chaos_seeds(), ids=lambda seed: f"seed{seed}")


class ChaosPlatform:
    """The session under test plus what a scenario needs to break it and wait for it."""

    def __init__(self, session, proxy):
        self.session, self.proxy = session, proxy
        self.platform = session.platform

    def api(self, method, path, **kwargs):
        """session.api() that waits out a web server the scenario has just killed."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.session.api(method, path, **kwargs)
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def job(self, job_id):
        return self.api("GET", f"/api/v1/jobs/{job_id}/").json()

    def wait_for(self, job_id, statuses, *, timeout):
        try:
            return wait_for_status(self.job, job_id, statuses, timeout=timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.describe(job_id)}") from None

    def describe(self, job_id):
        """What a failed wait needs to be understood afterwards: the job's events and, per learner
        folder, the files there and the end of its agent's log."""
        events = self.api("GET", f"/api/v1/jobs/{job_id}/events/").json().get("results", [])
        lines = [f"events: {[(e['time'], e['attempt'], e['to_status'], e['reason']) for e in events]}"]
        for folder in sorted(self.session.data_dir.glob(f"storage/*/{job_id}/attempt-*/learner-*")):
            lines.append(f"{folder.relative_to(self.session.data_dir)}: {sorted(p.name for p in folder.iterdir())}")
            agent_log = folder / "agent.log"
            if agent_log.exists():
                lines += ["  " + line for line in agent_log.read_text(errors="replace").splitlines()[-15:]]
        return "\n".join(lines)

    def kill(self, part, *, downtime):
        """SIGKILL one part of the platform, leave it down for `downtime` seconds, start it again."""
        self.platform.kill(part)
        try:
            time.sleep(downtime)
        finally:
            self.ensure_running()

    def ensure_running(self):
        """Start again the part a scenario killed (even when the scenario failed meanwhile). A part
        that crashed by itself is the platform's supervisor's business, not the test's."""
        for part in PARTS:
            if part == "redis" and not self.platform.embedded_redis:
                continue
            if part not in self.platform.processes:
                getattr(self.platform, f"start_{part}")()
        self.wait_web_up()

    def wait_web_up(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if requests.get(self.platform.url + "/login/", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the web server did not come back within {timeout}s")

    def terminate_leftovers(self):
        """Stop jobs a failed scenario left running, so the next one starts from an idle platform."""
        active = self.api("GET", "/api/v1/jobs/", params={
            "status": "QUEUED,PENDING,DOWNLOADING,PROCESSING,STORING,HALTING,HALTED"}).json()["results"]
        for job in active:
            self.api("POST", f"/api/v1/jobs/{job['id']}/terminate/")
        for job in active:
            self.wait_for(job["id"], {"TERMINATED", "COMPLETED", "FAILED"}, timeout=30)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    port = free_port()
    proxy = CuttableProxy(port)
    session = start_session(tmp_path_factory.mktemp("chaos"), port=port, public_url=proxy.url, supervise=True,
                            TRAINYARD_RECONCILE_INTERVAL="1", TRAINYARD_LOCAL_CPUS="8")
    try:
        yield ChaosPlatform(session, proxy)
    finally:
        _supervisor_restarts.extend(part for part, _, _ in session.platform.restarts)
        session.stop()
        proxy.close()
        if keep := os.environ.get("TRAINYARD_KEEP_CHAOS_LOGS"):
            shutil.copytree(session.platform.log_dir, keep, dirs_exist_ok=True)
            for agent_log in session.data_dir.glob("storage/*/*/attempt-*/learner-*/agent.log"):
                job, attempt, learner = agent_log.parts[-4:-1]
                shutil.copyfile(agent_log, os.path.join(keep, f"agent-{job}-{attempt}-{learner}.log"))
            if (database := session.data_dir / "trainyard.sqlite3").exists():
                shutil.copyfile(database, os.path.join(keep, database.name))


@pytest.fixture(autouse=True)
def _restore_platform(request):
    """After each scenario, pass or fail: every part running again, no job of it still active."""
    yield
    if "chaos" in request.fixturenames:
        platform = request.getfixturevalue("chaos")
        platform.ensure_running()
        platform.terminate_leftovers()


# --- the report ----------------------------------------------------------------------------------
_outcomes = {}  # nodeid -> "survived" | "failed" | "skipped"
_supervisor_restarts = []  # parts that crashed as a consequence of a scenario and were restarted


def pytest_runtest_logreport(report):
    if "chaos" not in report.keywords:
        return
    if report.skipped:
        _outcomes.setdefault(report.nodeid, "skipped")
    elif report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "survived")


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    outcomes = list(_outcomes.values())
    survived = outcomes.count("survived")
    run = survived + outcomes.count("failed")
    line = f"chaos: {run} scenarios run, {survived} survived"
    if skipped := outcomes.count("skipped"):
        line += f" ({skipped} skipped)"
    if _supervisor_restarts:
        counts = {part: _supervisor_restarts.count(part) for part in sorted(set(_supervisor_restarts))}
        line += "; crashed and restarted by the supervisor: " + ", ".join(f"{p} x{n}" for p, n in counts.items())
    terminalreporter.write_sep("=", line, red=run != survived, green=run == survived)
