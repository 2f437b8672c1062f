"""A noisy neighbour cannot take the platform from a quiet tenant.

While tenant B (mallory) runs each abuse in turn — a log flood, a job filling its disk, a result of
very many files, archive bombs (eight at once, a wave a second), webhook receivers that trickle one
byte a second, and a burst of whole-node jobs, half of them asking for `priority: high` — tenant A (alice) runs a
two-line job and reads the API. A's job must complete within 2x its time on the quiet platform and
A's API p95 must stay within 2x of quiet, except for the KNOWN_GAPS below, held to looser bounds.

The platform is this module's own (not the suite's shared one), so the quiet figures are taken on a
platform nobody else's jobs are running on, right before each abuse. A's job time is the median of
five runs and its p95 is over 200 reads, since one run on a loaded 2-core machine varies by more
than the effect being looked for.
"""
import contextlib
import io
import os
import shutil
import socket
import statistics
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from learner_agent import sandbox
from portal.runner import PROJECT_ROOT
from tests.support.harness import EXAMPLES, FINAL, start_session
from tests.support.optional import skip_or_fail

# A timing test: .ci/run runs it apart from the rest of the suite, whose platforms would share the machine.
pytestmark = [pytest.mark.e2e, pytest.mark.noisy_neighbour]

NEIGHBOUR = PROJECT_ROOT / "tests" / "security" / "jobs" / "neighbour"
JOB_RUNS = 5  # A's two-line job, per phase
API_READS = 200  # A's API requests, per phase
SLOWDOWN = 2.0
# Where the 2x target is not met yet, the bound this test holds instead (a regression to minutes of
# waiting still fails it) and why; docs/security.md gives the figures as measured.
KNOWN_GAPS = {
    # A's job must wait for one of B's whole-node jobs to be halted through fair-share preemption
    # (HALTING, halted, admitted): one preemption's round trip more than a quiet platform.
    ("high_priority_backlog", "job"): 5.0,
}


@pytest.fixture(scope="module")
def neighbours():
    """(platform, mallory's token): alice of team-a and mallory of team-b on a platform of their own."""
    if sandbox.bwrap_problem() is not None:
        skip_or_fail(f"the noisy-neighbour test needs bubblewrap: {sandbox.bwrap_problem()}")
    data_dir = tempfile.mkdtemp(prefix="trainyard-neighbour-", dir="/var/tmp")
    session = start_session(data_dir, TRAINYARD_SANDBOX="bwrap", TRAINYARD_RECONCILE_INTERVAL="2",
                            TRAINYARD_LOCAL_CPUS="4", TRAINYARD_WEBHOOK_ALLOW_PRIVATE="1")
    try:
        yield session, session.add_member("team-b", "mallory", password="mallory-password")
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def submit(platform, command, *, token=None, cpus=0.5, memory="256MiB", priority="normal", wait_out_limits=True):
    """Submit a job of the neighbour folder running `command`; B's set-up waits out its tenant's rate."""
    manifest = (NEIGHBOUR / "manifest.yml").read_text()
    manifest = manifest.replace("command: python3 two_lines.py", f"command: {command}")
    manifest = manifest.replace("cpus: 0.5", f"cpus: {cpus}").replace("memory: 256MiB", f"memory: {memory}")
    manifest += f"priority: {priority}\n"
    return platform.submit(os.path.relpath(NEIGHBOUR, EXAMPLES), manifest_text=manifest, token=token,
                           wait_out_limits=wait_out_limits)


# --- what tenant A measures -------------------------------------------------------------------------

def two_line_job_seconds(platform):
    """Wall time from A's submit to COMPLETED, as A's script sees it."""
    started = time.monotonic()
    job = submit(platform, "python3 two_lines.py")
    final = platform.wait_for(job["id"], timeout=300, poll=0.05)
    assert final["status"] == "COMPLETED", final
    return time.monotonic() - started


def api_p95_seconds(platform, job_id):
    """p95 over A's reads of the jobs list and one job's detail, logs and artifacts."""
    paths = ["/api/v1/jobs/", f"/api/v1/jobs/{job_id}/", f"/api/v1/jobs/{job_id}/logs/",
             f"/api/v1/jobs/{job_id}/artifacts/"]
    times = []
    for i in range(API_READS):
        started = time.monotonic()
        response = platform.api("GET", paths[i % len(paths)])
        times.append(time.monotonic() - started)
        assert response.status_code == 200, response.text
    return statistics.quantiles(times, n=20)[-1]


def measure(platform, job_id):
    jobs = [two_line_job_seconds(platform) for _ in range(JOB_RUNS)]
    return statistics.median(jobs), api_p95_seconds(platform, job_id)


@pytest.fixture(scope="module")
def readable_job(neighbours):
    """A's finished job, read through the API (after it, one warm-up job)."""
    platform, _ = neighbours
    job = submit(platform, "python3 two_lines.py")
    platform.wait_for(job["id"])
    two_line_job_seconds(platform)
    return job["id"]


# --- what tenant B does ------------------------------------------------------------------------------

def terminate_all(platform, token):
    """B's active jobs terminated, and waited for (so the next abuse starts on a settled platform)."""
    active = ",".join(sorted({"QUEUED", "PENDING", "DOWNLOADING", "PROCESSING", "STORING", "HALTING", "HALTED"}))
    for _ in range(20):
        jobs = platform.api("GET", "/api/v1/jobs/", token=token,
                           params={"status": active, "size": 200}).json()["results"]
        if not jobs:
            return
        for job in jobs:
            platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/", token=token)
        for job in jobs:
            platform.wait_for(job["id"], FINAL | {"HALTED"}, timeout=120, token=token)
            if platform.job(job["id"], token=token)["status"] == "HALTED":
                platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/", token=token)


def running(platform, job_id, token):
    return platform.wait_for(job_id, {"PROCESSING", *FINAL}, timeout=120, token=token)


@contextlib.contextmanager
def log_flood(platform, token):
    jobs = [submit(platform, "FLOOD_SECONDS=120 python3 flood_log.py", token=token) for _ in range(2)]
    for job in jobs:
        running(platform, job["id"], token)
    time.sleep(3)  # the lines are arriving
    yield


@contextlib.contextmanager
def disk_fill(platform, token):
    jobs = [submit(platform, "FILL_MIB=400 python3 fill_disk.py", token=token) for _ in range(2)]
    for job in jobs:
        running(platform, job["id"], token)
    time.sleep(3)
    yield


@contextlib.contextmanager
def many_files(platform, token):
    jobs = [submit(platform, "MANY_FILES=200000 python3 many_files.py", token=token, memory="512MiB")
            for _ in range(2)]
    for job in jobs:  # measured while their results are being created and recorded
        platform.wait_for(job["id"], {"STORING", *FINAL}, timeout=300, token=token)
    yield


def bomb_archive():
    """A .tgz of about 1 MiB that unpacks to 1 GiB of zeros."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 1 << 30
        tar.addfile(info, _Zeros(info.size))
        manifest = (NEIGHBOUR / "manifest.yml").read_bytes()
        info = tarfile.TarInfo("two_lines.py")
        source = (NEIGHBOUR / "two_lines.py").read_bytes()
        info.size = len(source)
        tar.addfile(info, io.BytesIO(source))
    return buffer.getvalue(), manifest


class _Zeros(io.RawIOBase):
    def __init__(self, size):
        self.left = size

    def readable(self):
        return True

    def readinto(self, buffer):
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


@contextlib.contextmanager
def archive_bombs(platform, token):
    archive, manifest = bomb_archive()
    stop = threading.Event()

    def bomb_every_second():
        while not stop.wait(1):
            requests.post(platform.url + "/api/v1/jobs/", headers={"Authorization": f"Token {token}"},
                          files={"manifest": ("manifest.yml", manifest), "code": ("code.tgz", archive)},
                          timeout=120)

    with ThreadPoolExecutor(8) as pool:
        for _ in range(8):
            pool.submit(bomb_every_second)
        time.sleep(2)
        try:
            yield
        finally:
            stop.set()


@contextlib.contextmanager
def slow_webhooks(platform, token):
    with trickling_receiver() as url:
        for _ in range(2):
            response = platform.api("POST", "/api/v1/webhooks/", token=token, json={"url": url, "format": "slack"})
            assert response.status_code == 201, response.text
        hooks = [hook["id"] for hook in platform.api("GET", "/api/v1/webhooks/", token=token).json()["results"]]
        for _ in range(3):  # every status change of these is a delivery to each hook
            submit(platform, "python3 two_lines.py", token=token)
        time.sleep(3)  # the first deliveries are trickling
        try:
            yield
        finally:
            for hook in hooks:
                platform.api("DELETE", f"/api/v1/webhooks/{hook}/", token=token)


@contextlib.contextmanager
def trickling_receiver():
    """An HTTP receiver that reads the request, then answers one byte a second for ten minutes."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle(connection):
        with connection:
            connection.settimeout(1)
            with contextlib.suppress(OSError):
                connection.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 600\r\n\r\n" + b"x" * 600:
                if stop.wait(1):
                    return
                with contextlib.suppress(OSError):
                    connection.sendall(bytes([byte]))

    def accept():
        server.settimeout(0.5)
        while not stop.is_set():
            with contextlib.suppress(socket.timeout, OSError):
                connection, _ = server.accept()
                threading.Thread(target=trickle, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/hook"
    finally:
        stop.set()
        server.close()


@contextlib.contextmanager
def high_priority_backlog(platform, token):
    """As many whole-node jobs as the platform takes in a burst of 300 submits, every other one
    asking for `priority: high`."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _try_submit(platform, token, "high" if i % 2 else "normal"), range(300)))
    time.sleep(1)
    yield


def _try_submit(platform, token, priority):
    with contextlib.suppress(AssertionError):  # a limit's 429 or a refused priority is the platform defending itself
        submit(platform, "sleep 120", token=token, cpus=4, priority=priority, wait_out_limits=False)


ABUSES = {"log_flood": log_flood, "disk_fill": disk_fill, "many_files": many_files,
          "archive_bombs": archive_bombs, "slow_webhooks": slow_webhooks,
          "high_priority_backlog": high_priority_backlog}


@pytest.mark.parametrize("abuse", ABUSES)
def test_a_noisy_tenant_does_not_slow_a_quiet_one_down(neighbours, readable_job, abuse):
    platform, mallory = neighbours
    quiet_job, quiet_p95 = measure(platform, readable_job)  # just before, so the machine's drift cancels
    try:
        with ABUSES[abuse](platform, mallory):
            noisy_job, noisy_p95 = measure(platform, readable_job)
    finally:
        terminate_all(platform, mallory)
    figures = (f"{abuse}: A's two-line job {noisy_job:.2f} s (quiet {quiet_job:.2f} s), "
               f"A's API p95 {noisy_p95 * 1000:.0f} ms (quiet {quiet_p95 * 1000:.0f} ms)")
    print(figures)
    assert noisy_job <= KNOWN_GAPS.get((abuse, "job"), SLOWDOWN) * quiet_job, figures
    assert noisy_p95 <= KNOWN_GAPS.get((abuse, "p95"), SLOWDOWN) * quiet_p95, figures
