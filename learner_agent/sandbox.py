"""How the user's command is started: its argv (optionally inside bubblewrap) and its environment.

User code is untrusted. With bubblewrap it runs without network, in its own pid namespace, on a
read-only view of the machine in which the platform's data (other jobs, the database, the agent's own
config) is hidden under empty tmpfs mounts and only the learner's own directories are visible and
writable. Without bubblewrap ("none", or "auto" where it is missing or cannot create namespaces) the
command runs as a plain process: fine for development, not for untrusted users.

Either way the environment is built from scratch, never inherited: the agent's environment may hold
platform secrets and the learner must never see them (SPEC §6).

The learners of a distributed job share one private network namespace (learner_agent.netns): given
its path, the command is started inside it with nsenter, and bubblewrap keeps that network instead of
unsharing an empty one of its own, so the learners reach each other on 127.0.0.1 and nothing else.
"""
import functools
import glob
import math
import os
import shutil
import subprocess
import sys

from learner_agent import netns

MODES = ("auto", "bwrap", "none")
# The directory holding the learner_agent package: on the learner's PYTHONPATH for `report`.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(PACKAGE_PARENT, "learner_agent")

_ISOLATION = ["--unshare-net", "--unshare-pid", "--die-with-parent", "--new-session",
              "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
# The learner gets a private, empty /tmp (a tmpfs, like every hidden dir).
_PRIVATE_DIRS = ("/tmp",)
# What the learner runs with: the platform's Python environment (its `python` comes first on PATH)
# and the learner_agent package. They stay visible, read-only, even when they live under a hidden
# dir such as /tmp (a checkout in /tmp, a CI runner's work dir).
_RUNTIME_DIRS = tuple(dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix, PACKAGE_DIR]))
# GPUs are device files; bwrap's fresh /dev doesn't have them, so they are passed through when present.
_GPU_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/dri")


class SandboxError(RuntimeError):
    """The requested sandbox cannot be used on this machine."""


def resolve_mode(mode):
    """"bwrap" or "none": what `mode` means here. Raises SandboxError for "bwrap" when it can't work."""
    if mode not in MODES:
        raise SandboxError(f"sandbox must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "none":
        return "none"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if mode == "bwrap":
        raise SandboxError(f"bubblewrap sandbox unavailable: {problem}")
    return "none"


@functools.lru_cache(maxsize=1)
def bwrap_problem():
    """None when bubblewrap can create our sandbox here, else why not (probed once per process)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not on PATH"
    try:
        probe = subprocess.run([bwrap, *_ISOLATION, "/bin/true"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"probe failed: {e}"
    if probe.returncode != 0:
        return f"probe failed: {probe.stderr.decode('utf-8', 'replace').strip()}"
    return None


def build_argv(command, *, mode, work_dir, writable_dirs=(), readonly_dirs=(), hidden_dirs=(),
               network_namespace=""):
    """argv running `/bin/sh -c command`, in bubblewrap when `mode` resolves to "bwrap", and inside
    the job's shared network namespace when `network_namespace` (a /proc/<pid>/ns/net path) is given."""
    shell = ["/bin/sh", "-c", command]
    join = netns.join_argv(network_namespace) if network_namespace else []
    if resolve_mode(mode) == "none":
        return [*join, *shell]
    isolation = [a for a in _ISOLATION if not (network_namespace and a == "--unshare-net")]
    return [*join, shutil.which("bwrap"), *isolation,
            *_mount_args(work_dir=work_dir, writable_dirs=writable_dirs, readonly_dirs=readonly_dirs,
                         hidden_dirs=hidden_dirs),
            *_gpu_args(), "--chdir", work_dir, "--", *shell]


def build_env(*, work_dir, cpus, learner_env=None, path=None):
    """The learner's whole environment: a few basics plus the platform's learner variables."""
    threads = str(max(1, math.ceil(cpus)))
    env = {
        "PATH": path if path is not None else os.environ.get("PATH", os.defpath),
        "HOME": work_dir,
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",  # so log lines (and metrics) arrive when printed, not at exit
        "PYTHONPATH": PACKAGE_PARENT,
        "TMPDIR": "/tmp",
        # Numeric libraries size their thread pools by the machine, not by the learner's share of it.
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
    }
    for key, value in (learner_env or {}).items():
        env[str(key)] = str(value)
    if learner_env and "PYTHONPATH" in learner_env:
        # The learner may add to the path, but `from learner_agent import report` must keep working.
        env["PYTHONPATH"] = f"{PACKAGE_PARENT}{os.pathsep}{learner_env['PYTHONPATH']}"
    return env


def _mount_args(*, work_dir, writable_dirs, readonly_dirs, hidden_dirs):
    """tmpfs over hidden dirs, then binds of the visible ones at the same path.

    Mounts are applied outermost first (tmpfs before binds at equal depth), so a learner directory
    inside a hidden one shows through, and a hidden directory inside a visible one stays hidden.
    """
    mounts = {}
    for rank, option, dirs in ((0, "--tmpfs", [*_PRIVATE_DIRS, *hidden_dirs]),
                               (1, "--bind", [work_dir, *writable_dirs]),
                               (2, "--ro-bind", readonly_dirs)):
        for d in dirs:
            if not os.path.isdir(d):
                continue  # nothing to hide, nothing to show (bwrap would refuse a missing source)
            mounts[os.path.realpath(d)] = (rank, option)
    for runtime in _RUNTIME_DIRS:
        if os.path.isdir(runtime) and _is_hidden(runtime, mounts):
            mounts.setdefault(os.path.realpath(runtime), (2, "--ro-bind"))
    args = []
    for path, (_, option) in sorted(mounts.items(), key=lambda m: (_depth(m[0]), m[1][0])):
        args += [option, path] if option == "--tmpfs" else [option, path, path]
    return args


def _gpu_args():
    args = []
    for pattern in _GPU_DEVICE_GLOBS:
        for device in sorted(glob.glob(pattern)):
            args += ["--dev-bind", device, device]
    return args


def _is_hidden(path, mounts):
    path = os.path.realpath(path)
    return any(path == m or path.startswith(m + os.sep)
               for m, (_, option) in mounts.items() if option == "--tmpfs")


def _depth(path):
    return len([p for p in path.split(os.sep) if p])
