"""A hostile learner on the local backend (bubblewrap) tries to get out, and to take the machine down.

The learner's code is in tests/security/jobs/hostile/; each attempt prints one
`ESCAPE <attempt> blocked|ESCAPED <detail>` line, and every one must say blocked. The resource tests
(fork bomb, filling /tmp, CPU share) check that the job ends cleanly with the right reason and the
platform keeps answering.
"""
import os
import socket
import threading
import time
import uuid

import pytest

from portal.runner import PROJECT_ROOT
from tests.support.hostile import log_lines, submit_hostile

pytestmark = pytest.mark.e2e

ATTEMPTS = ("capeff", "remount_root_rw", "umount_tmp", "mount_proc", "unhide_mounts", "ptrace_agent",
            "host_proc_environ", "read_platform_files", "read_other_tenants_result", "write_host_file",
            "hand_spare_a_config", "raw_socket", "host_unix_sockets", "run_visible", "cgroups_of_jobs",
            "nested_userns", "setuid_root")


@pytest.fixture(scope="module")
def victim_dir(platform, intruder):
    """Another tenant's finished job with a private result (team-b, mallory)."""
    _, _, token = intruder
    job = submit_hostile(platform, "python3 victim.py", token=token)
    assert platform.wait_for(job["id"], token=token)["status"] == "COMPLETED"
    folder = platform.data_dir / "storage" / "team-b" / job["id"]
    assert (folder / "results" / "secret.txt").exists()
    return folder


class HostSocket:
    """A listening Unix socket of the test's own on the host, open to every uid (as a database's
    local socket is), counting who connects."""

    def __init__(self, path):
        self.path, self.connections = path, 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        os.chmod(path, 0o777)
        self.server.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:  # closed
                return
            self.connections += 1
            connection.close()

    def close(self):
        self.server.close()
        os.unlink(self.path)


@pytest.fixture(scope="module")
def host_sockets(platform):
    """Sockets in /run (where host services listen) and beside the platform's data directory."""
    name = f"trainyard-test-{uuid.uuid4().hex[:8]}.sock"
    folders = [platform.data_dir.parent]
    if os.access("/run", os.W_OK):
        folders.append("/run")
    sockets = [HostSocket(os.path.join(folder, name)) for folder in folders]
    yield sockets
    for s in sockets:
        s.close()


def test_every_escape_attempt_fails(platform, victim_dir, host_sockets):
    job = submit_hostile(platform, " ".join(["python3 escape.py", str(victim_dir), *(s.path for s in host_sockets)]))
    final = platform.wait_for(job["id"], timeout=120)
    lines = log_lines(platform, job["id"], "ESCAPE ")
    assert final["status"] == "COMPLETED", (final, lines)
    assert "ESCAPE done" in lines, lines
    outcomes = {line.split()[1]: line for line in lines if line != "ESCAPE done"}
    assert sorted(outcomes) == sorted(ATTEMPTS), lines
    # A write the learner sees succeed may have landed in its private /tmp (a checkout under /tmp shows
    # through read-only, and its parent dirs exist only in that tmpfs): only the host can tell.
    escaped = [line for name, line in outcomes.items()
               if name != "write_host_file" and line.split()[2] != "blocked"]
    assert escaped == [], "\n".join(lines)
    assert not list(PROJECT_ROOT.glob("escaped-*.txt")), "the learner wrote a file on the host"
    assert "CapEff=0 " in outcomes["capeff"]
    assert [s.connections for s in host_sockets] == [0] * len(host_sockets), [s.path for s in host_sockets]


def test_a_fork_bomb_is_bounded_and_the_platform_keeps_working(platform):
    job = submit_hostile(platform, "python3 forkbomb.py", memory="2GiB")
    final = platform.wait_for(job["id"], timeout=180)
    lines = log_lines(platform, job["id"], "FORKBOMB")
    assert final["status"] == "COMPLETED", (final, lines)
    assert len(lines) == 1 and lines[0].startswith("FORKBOMB stopped after"), lines
    assert int(lines[0].split()[3]) <= 4096  # the learner's pids limit (agent config max_processes)
    started = time.monotonic()
    assert platform.api("GET", "/api/v1/jobs/").status_code == 200
    assert time.monotonic() - started < 5
    # Nothing of it is left running on the machine: the sleepers died with the sandbox. (Only this job's
    # processes count: other suites' learners may be sleeping too.)
    uid = int(lines[0].rsplit("(uid ", 1)[1].rstrip(")"))
    assert _processes_running("sleep 300", uid=uid) == []


def test_filling_tmp_past_the_memory_limit_kills_the_learner_with_a_memory_reason(platform):
    job = submit_hostile(platform, "python3 fill_tmp.py", memory="256MiB")
    final = platform.wait_for(job["id"], timeout=120)
    lines = log_lines(platform, job["id"], "TMPFILL")
    assert final["status"] == "FAILED", (final, lines)
    assert "memory limit 256.0MiB exceeded" in final["status_reason"], final
    assert not any("wrote all" in line for line in lines), lines


def test_cpus_is_a_real_quota(platform):
    job = submit_hostile(platform, "python3 cpu_share.py", cpus=0.25)
    final = platform.wait_for(job["id"], timeout=120)
    lines = log_lines(platform, job["id"], "CPUSHARE")
    assert final["status"] == "COMPLETED" and len(lines) == 1, (final, lines)
    assert float(lines[0].split()[1]) < 0.4, lines  # 0.25 and some slack for accounting


def test_a_normal_example_still_completes_in_the_sandbox(platform):
    job = platform.submit("custom-shell")
    final = platform.wait_for(job["id"], timeout=120)
    assert final["status"] == "COMPLETED", final
    artifacts = platform.api("GET", f"/api/v1/jobs/{job['id']}/artifacts/").json()["results"]
    assert any(a["kind"] == "result" for a in artifacts), artifacts


def _processes_running(needle, *, uid):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (os.stat(f"/proc/{pid}").st_uid == uid
                    and needle.encode() in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")):
                found.append(int(pid))
        except OSError:
            pass
    return found
