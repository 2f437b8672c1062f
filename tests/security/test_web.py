"""The web edge of the real platform, probed as a hostile researcher (or a hostile web page) would:
open websockets that outlive their access, foreign Origins and Hosts, floods of logins, tokens and
ingest posts, script injection the Content-Security-Policy must stop; and `make demo`, which must
leave nothing running whichever signal stops it."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portal.runner import PROJECT_ROOT, free_port, migrate, port_is_free

pytestmark = pytest.mark.e2e


# --- `make demo` stops everything it started ---------------------------------------------------------
def processes_of(data_dir):
    """pids of every process running with this TRAINYARD_DATA_DIR (Redis, daphne, the worker and
    its pool, beat, learner agents: all inherit the demo's environment)."""
    marker = f"TRAINYARD_DATA_DIR={data_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_until(predicate, timeout, poll=0.2):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(poll)
    return value


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "running"), (signal.SIGHUP, "running"),
                                       (signal.SIGTERM, "starting")])
def test_make_demo_stops_everything_it_started(tmp_path, sig, when):
    data_dir = tmp_path.resolve()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(TRAINYARD_DATA_DIR=str(data_dir), TRAINYARD_PORT=str(port), TRAINYARD_DEMO_EXAMPLES="none",
               DJANGO_SETTINGS_MODULE="portal.settings")
    migrate(env)
    log = open(tmp_path / "demo.out", "wb")
    # Its own session, like a shell job: the signal reaches the demo alone, as `kill` or make sends it.
    demo = subprocess.Popen([sys.executable, "manage.py", "demo"], cwd=PROJECT_ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        if when == "running":
            assert wait_until(lambda: b"Trainyard is running" in (tmp_path / "demo.out").read_bytes(), 120), \
                (tmp_path / "demo.out").read_text()
        else:  # the web server is starting: the demo is inside the platform's start-up
            assert wait_until(lambda: any(b"daphne" in cmdline(pid) for pid in processes_of(data_dir)), 120), \
                (tmp_path / "demo.out").read_text()
        started = processes_of(data_dir)
        assert len(started) >= (5 if when == "running" else 2), started  # redis, web, worker (+pool), beat
        demo.send_signal(sig)
        demo.wait(60)
        left = wait_until(lambda: not processes_of(data_dir), 30) or processes_of(data_dir)
        assert left is True, f"still running after {signal.Signals(sig).name}: {left}"
        assert port_is_free(port)
    finally:
        for pid in processes_of(data_dir):
            os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            demo.kill()
