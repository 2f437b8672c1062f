"""The network namespace a distributed job's learners share: joined by every learner, reachable by
them only, and gone once they have all ended."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from learner_agent import netns, sandbox
from learner_agent.config import ConfigError, parse_config
from tests.support.optional import skip_or_fail

SERVER = "import socket,sys; s=socket.create_server(('127.0.0.1', int(sys.argv[1]))); c,_=s.accept(); print(c.recv(9).decode())"
CLIENT = r"""
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=1); break
    except OSError:
        time.sleep(0.05)
c.sendall(b'neighbour')
"""


@pytest.fixture
def attempt_dir(tmp_path):
    for index in (0, 1):
        (tmp_path / f"learner-{index}").mkdir()
    try:
        path = netns.create(tmp_path, 2)
    except netns.NetnsError as exc:
        skip_or_fail(f"cannot create a network namespace here: {exc}")
    yield tmp_path, path
    netns.stop(tmp_path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_learners_in_the_namespace_reach_each_other_and_not_the_host(attempt_dir):
    folder, path = attempt_dir
    port = free_port()
    server = subprocess.Popen([*netns.join_argv(path), sys.executable, "-c", SERVER, str(port)],
                              stdout=subprocess.PIPE, text=True)
    subprocess.run([*netns.join_argv(path), sys.executable, "-c", CLIENT, str(port)], check=True, timeout=30)
    assert server.communicate(timeout=30)[0].strip() == "neighbour"

    with socket.create_server(("127.0.0.1", 0)) as host_server:  # a platform port on the host
        host_port = host_server.getsockname()[1]
        probe = subprocess.run([*netns.join_argv(path), sys.executable, "-c",
                                f"import socket; socket.create_connection(('127.0.0.1', {host_port}), timeout=2)"],
                               capture_output=True, text=True, timeout=30)
    assert probe.returncode != 0 and "ConnectionRefusedError" in probe.stderr


def test_create_is_idempotent_and_the_holder_leaves_when_every_learner_has_ended(attempt_dir):
    folder, path = attempt_dir
    assert netns.create(folder, 2) == path  # a repeated deploy finds the same namespace
    for index in (0, 1):
        (folder / f"learner-{index}" / "exit.json").write_text(json.dumps({"exit_code": 0}))
    deadline = time.monotonic() + 10
    while netns.holder_pid(folder) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert netns.holder_pid(folder) is None
    assert not os.path.exists(path)


def test_stop_ends_the_holder(attempt_dir):
    folder, _ = attempt_dir
    netns.stop(folder)
    deadline = time.monotonic() + 10
    while netns.holder_pid(folder) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert netns.holder_pid(folder) is None


def test_the_command_joins_the_namespace_with_or_without_bubblewrap(monkeypatch):
    argv = sandbox.build_argv("python t.py", network_namespace="/proc/42/ns/net")
    assert argv[1:] == ["--net=/proc/42/ns/net", "--", "/bin/sh", "-c", "python t.py"]
    assert sandbox.build_argv("python t.py") == ["/bin/sh", "-c", "python t.py"]
    # In bubblewrap, the launcher joins it (setns) before it becomes bwrap.
    shared = sandbox.bwrap_plan("x", work_dir="/w", env={}, network_namespace="/proc/42/ns/net")
    assert shared["network_namespace"] == "/proc/42/ns/net"
    assert "--unshare-net" not in shared["bwrap_args"]  # bwrap keeps the job's namespace instead of an empty one
    assert "--unshare-net" in sandbox.bwrap_plan("x", work_dir="/w", env={})["bwrap_args"]


def test_the_config_takes_an_absolute_namespace_path(tmp_path):
    base = {"job_id": "j", "command": "c", "code_archive": "a", "work_dir": "w", "ingest_url": "u",
            "ingest_token": "t", "attempt": 1, "learner": 0}
    assert parse_config(dict(base, network_namespace="/proc/1/ns/net"), path=str(tmp_path / "a.json")
                        ).network_namespace == "/proc/1/ns/net"
    with pytest.raises(ConfigError, match="network_namespace"):
        parse_config(dict(base, network_namespace="proc/1"), path=str(tmp_path / "a.json"))


def test_a_learners_process_under_a_reused_holder_pid_is_not_taken_for_the_holder(tmp_path):
    """A sandboxed learner's processes show the host any argv they like; one that got the pid of a
    holder that has exited must not become the namespace the next deploy's learners join."""
    if os.getuid() != 0:
        skip_or_fail("learners run as uids of their own only under a root agent")
    argv = ["/bin/sh", "-c", "sleep 30; :", "learner_agent.netns", os.path.abspath(tmp_path)]
    for uid, taken in ((65534, False), (os.getuid(), True)):
        impostor = subprocess.Popen(argv, preexec_fn=lambda uid=uid: os.setuid(uid))
        try:
            (tmp_path / netns.PID_FILE).write_text(f"{impostor.pid}\n")
            for _ in range(100):  # until the child has exec'd its argv
                if b"learner_agent.netns" in open(f"/proc/{impostor.pid}/cmdline", "rb").read():
                    break
                time.sleep(0.01)
            assert (netns.holder_pid(tmp_path) == impostor.pid) is taken
        finally:
            impostor.kill()
            impostor.wait()
