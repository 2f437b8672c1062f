"""One private network namespace shared by the learners of a distributed job (local backend).

The learners of a job must reach each other (MASTER_ADDR=127.0.0.1, MASTER_PORT) and nothing else.
A network namespace gives exactly that: its own loopback and no other interface. A small detached
holder process creates it and keeps it alive (`python -m learner_agent.netns hold ...`); each
learner's agent starts its command inside it with `nsenter --net=/proc/<holder>/ns/net`, so the
command (and bubblewrap around it, which then shares this namespace instead of making its own) sees
only the job's loopback. The agents themselves stay outside and still reach the platform.

The holder ends by itself once every learner of the attempt has written exit.json, or when none of
their agents runs any more; the backend also stops it on delete. Creating a namespace needs
CAP_SYS_ADMIN (root); `create` raises NetnsError when it cannot.

Stdlib only, like the rest of the agent: unshare(2) through ctypes, the loopback brought up with
the SIOCSIFFLAGS ioctl.
"""
import argparse
import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

from learner_agent import procfs
from learner_agent.files import write_atomically

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PID_FILE = "netns.pid"
CHECK_INTERVAL_S = 1.0
# An agent that has not written its pid this long after the holder started counts as never coming.
AGENT_START_GRACE_S = 60.0


class NetnsError(RuntimeError):
    """No shared namespace can be made or joined here; the message says why."""


def namespace_path(pid):
    return f"/proc/{pid}/ns/net"


def holder_pid(attempt_dir):
    """The pid of this attempt's live holder, or None. A sandboxed learner can take any argv, so a
    process under a reused pid must also run as the agents do (learners run as uids of their own)."""
    try:
        pid = int(open(os.path.join(attempt_dir, PID_FILE)).read().strip())
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None
    ours = owner == os.getuid() and b"learner_agent.netns" in cmdline
    return pid if ours and os.path.abspath(attempt_dir).encode() in cmdline else None


def create(attempt_dir, learners):
    """Start the holder for one attempt (or find the running one); return the namespace's path."""
    pid = holder_pid(attempt_dir)
    if pid is None:
        if shutil.which("nsenter") is None:
            raise NetnsError("nsenter (util-linux) is not on PATH; learners could not join the namespace")
        done = subprocess.run([sys.executable, "-m", "learner_agent.netns", "hold",
                               "--dir", os.path.abspath(attempt_dir), "--learners", str(learners)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10,
                              env={"PATH": os.environ.get("PATH", os.defpath),
                                   "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
        if done.returncode != 0:
            raise NetnsError(done.stderr.strip() or f"the namespace holder exited with {done.returncode}")
        pid = holder_pid(attempt_dir)
        if pid is None:
            raise NetnsError("the namespace holder did not stay up")
    return namespace_path(pid)


def stop(attempt_dir):
    pid = holder_pid(attempt_dir)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def join_argv(path):
    """The argv prefix that runs a command inside the namespace at `path`."""
    return [shutil.which("nsenter") or "nsenter", f"--net={path}", "--"]


# --- the holder process ----------------------------------------------------------------------------
def _unshare_network():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        hint = " (creating a network namespace needs root / CAP_SYS_ADMIN)" if code == errno.EPERM else ""
        raise NetnsError(f"unshare(CLONE_NEWNET) failed: {os.strerror(code)}{hint}")


def _loopback_up():
    """`ip link set lo up`, without needing `ip`: a new namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _learners_done(attempt_dir, learners, started):
    folders = [os.path.join(attempt_dir, f"learner-{i}") for i in range(learners)]
    if all(os.path.exists(os.path.join(f, "exit.json")) for f in folders):
        return True
    alive = [procfs.agent_running(f) for f in folders]
    if any(alive):
        return False
    # None runs: either they have not started yet (deploy in progress) or they all died.
    return time.monotonic() - started > AGENT_START_GRACE_S or all(
        os.path.exists(os.path.join(f, "agent.pid")) for f in folders)


def hold(attempt_dir, learners):
    """Create the namespace in this process, detach, and keep it until the learners are done.

    The namespace is created before the fork so an error reaches the caller as this process's
    exit status; the middle process writes the holder's pid file before exiting, so once the
    caller sees exit 0 the file is there."""
    _unshare_network()
    _loopback_up()
    middle = os.fork()
    if middle:
        _, status = os.waitpid(middle, 0)
        return os.waitstatus_to_exitcode(status)
    os.setsid()
    holder = os.fork()
    if holder:
        write_atomically(os.path.join(attempt_dir, PID_FILE), f"{holder}\n", mode=0o644)
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    started = time.monotonic()
    while not stop_requested and os.path.isdir(attempt_dir) and not _learners_done(attempt_dir, learners, started):
        time.sleep(CHECK_INTERVAL_S)
    os._exit(0)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m learner_agent.netns")
    commands = parser.add_subparsers(dest="command", required=True)
    hold_parser = commands.add_parser("hold", help="create and hold one attempt's network namespace")
    hold_parser.add_argument("--dir", required=True, help="the attempt's folder (holds learner-<i>/)")
    hold_parser.add_argument("--learners", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        return hold(args.dir, args.learners)
    except (NetnsError, OSError) as exc:
        print(f"learner_agent.netns: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
