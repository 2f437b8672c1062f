"""How the user's command is started: its argv (optionally inside bubblewrap) and its environment.

User code is untrusted. With bubblewrap it runs without network, in its own pid, IPC and user
namespaces, with no capabilities, no_new_privs and no way to make further user namespaces, on a
view of the machine built from an allow-list (system_view): the system's programs and libraries and
the few files of /etc that programs read, read-only; the platform's Python environment and the
learner_agent package, read-only; the learner's own folders; a private /tmp; a fresh /proc and /dev.
Nothing else of the host exists there: no /run or /var (host services listen on Unix sockets there,
and a read-only mount does not stop connect()), no home folders, no /sys/fs/cgroup (every job's
control group), no platform data. Where one of those lies inside a visible folder, it is hidden
under an empty tmpfs. /tmp and /dev/shm are tmpfs mounts of a fixed size. The only devices besides
the usual /dev ones are the job's own GPUs (gpu_devices).

When the agent is root, each job's learners run as an unprivileged uid of their own (learner_identity:
derived from the job id, in [LEARNER_ID_BASE, LEARNER_ID_BASE + LEARNER_ID_COUNT), gid the same),
which owns the learner's writable folders (hand_over); a control group (learner_agent.cgroups) limits
memory, CPU and processes. learner_agent.launch does the privileged part (cgroups, the job's network
namespace, staging the folders, dropping the uid) and then execs bubblewrap. When the agent is not
root, bubblewrap still makes a user namespace and drops every capability; the uid is the agent's own.

Without bubblewrap ("none", or "auto" where it is missing or cannot create namespaces) the
command runs as a plain process: fine for development, not for untrusted users.

Either way the environment is built from scratch, never inherited: the agent's environment may hold
platform secrets and the learner must never see them (SPEC §6).

The learners of a distributed job share one private network namespace (learner_agent.netns): given
its path, the command is started inside it, and bubblewrap keeps that network instead of
unsharing an empty one of its own, so the learners reach each other on 127.0.0.1 and nothing else.
"""
import functools
import glob
import hashlib
import logging
import marshal
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass


log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "none")
# The directory holding the learner_agent package: on the learner's PYTHONPATH for `report`.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(PACKAGE_PARENT, "learner_agent")

# Namespaces and privileges. --disable-userns (bwrap >= 0.8) stops the learner from making a user
# namespace of its own, in which it would hold capabilities again.
_ISOLATION = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
# The learner gets a private, empty /tmp (a tmpfs, like every hidden dir), of a fixed size.
_PRIVATE_DIRS = ("/tmp",)


def _python_environment():
    """The Python environment this interpreter runs in. That is sys.prefix, except that the agent
    starts without site (-S, learner_agent.agent.agent_argv) and site is what applies a virtual
    environment to sys.prefix; the environment's pyvenv.cfg, beside or above the executable (PEP
    405), names it either way. Missing it left a virtual environment under a hidden dir (a checkout
    in /tmp) out of the sandbox: the learner's `python` was not found."""
    executable_dir = os.path.dirname(os.path.abspath(sys.executable))
    for candidate in (executable_dir, os.path.dirname(executable_dir)):
        if os.path.exists(os.path.join(candidate, "pyvenv.cfg")):
            return candidate
    return sys.prefix


# What the learner runs with: the platform's Python environment (its `python` comes first on PATH)
# and the learner_agent package. They stay visible, read-only, even when they live under a hidden
# dir such as /tmp (a checkout in /tmp, a CI runner's work dir).
_RUNTIME_DIRS = tuple(dict.fromkeys([_python_environment(), sys.prefix, sys.base_prefix, sys.exec_prefix,
                                     PACKAGE_DIR]))
# What of the machine every learner sees, read-only (system_view). /bin, /sbin and /lib* are
# symlinks into /usr on most systems and stay symlinks. Of /etc only what programs read to run: the
# loader's cache, users and groups, name lookup, certificates (and OpenSSL's policies), the time zone,
# the alternatives' links, fonts. resolv.conf is left out: no network, and it often links into /run.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf", "/etc/gai.conf", "/etc/services",
                "/etc/protocols", "/etc/localtime", "/etc/timezone", "/etc/ssl", "/etc/ca-certificates",
                "/etc/ca-certificates.conf", "/etc/pki", "/etc/crypto-policies", "/etc/alternatives",
                "/etc/fonts", "/etc/mime.types", "/etc/os-release",
                # The CPUs and NUMA nodes: thread pools (OpenMP, PyTorch's cpuinfo) size themselves from them.
                "/sys/devices/system/cpu", "/sys/devices/system/node")
# A hidden dir's tmpfs only holds mount points; a small size keeps the learner from filling memory there.
HIDDEN_TMPFS_BYTES = 1 << 20
DEFAULT_TMP_BYTES = 1 << 30  # /tmp and /dev/shm when the learner has no memory limit
# The GPU devices every CUDA program needs besides /dev/nvidia<N> of its own GPUs.
GPU_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# Learner uids (and gids): above every range distributions hand out to users and to subordinate ids
# (/etc/subuid starts at 100000 and grows by 65536 per user), below 2**31.
LEARNER_ID_BASE = 2_000_000_000
LEARNER_ID_COUNT = 1 << 24
# Where learner_agent.launch stages the learner's folders (in its own mount namespace only).
STAGE_DIR = "/run/trainyard-learner"


class SandboxError(RuntimeError):
    """The requested sandbox cannot be used on this machine."""


@dataclass(frozen=True)
class Identity:
    """The unprivileged uid and gid a job's learners run as."""
    uid: int
    gid: int


def learner_identity(job_id, uid_number=None):
    """The job's own uid/gid when the agent can switch to it (it is root), else None: numbered by the
    platform (`uid_number`, distinct for every job of a long run) or, in a config without one, by a
    hash of the job's id."""
    if os.geteuid() != 0:
        return None
    if uid_number is None:
        uid_number = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big")
    number = LEARNER_ID_BASE + uid_number % LEARNER_ID_COUNT
    return Identity(number, number)


def hand_over(identity, *, tree, dirs):
    """Give the learner its folders: `tree` (its freshly unpacked work dir) with everything in it,
    and each of `dirs` itself (not their contents, which earlier learners of the job already own).

    Only folders whose parent stays root's are handed over whole: a learner owning a parent could
    swap a folder for a symlink before the next attempt's agent uses it."""
    for dirpath, dirnames, filenames in os.walk(tree):
        os.lchown(dirpath, identity.uid, identity.gid)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), identity.uid, identity.gid)
    for d in dirs:
        if os.path.isdir(d) and not os.path.islink(d):
            os.lchown(d, identity.uid, identity.gid)


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
    """None when bubblewrap can create our sandbox here, else why not (probed once per process).

    As root the probe runs as nobody: learners run as an unprivileged uid, which needs the kernel
    to allow unprivileged user namespaces."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not on PATH"
    as_nobody = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        probe = subprocess.run([bwrap, *_ISOLATION, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                                "/bin/true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, timeout=10, cwd="/", **as_nobody)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"probe failed: {e}"
    if probe.returncode != 0:
        who = " as an unprivileged user (are unprivileged user namespaces allowed?)" if as_nobody else ""
        return f"probe failed{who}: {probe.stderr.decode('utf-8', 'replace').strip()}"
    return None


def build_argv(command, *, network_namespace=""):
    """argv running `/bin/sh -c command` without a sandbox, inside the job's shared network
    namespace when `network_namespace` (a /proc/<pid>/ns/net path) is given."""
    if not network_namespace:
        return ["/bin/sh", "-c", command]
    from learner_agent import netns  # only distributed jobs share one; a single learner's start skips it
    return [*netns.join_argv(network_namespace), "/bin/sh", "-c", command]


def bwrap_plan(command, *, work_dir, env, writable_dirs=(), readonly_dirs=(), hidden_dirs=(),
               network_namespace="", identity=None, tmp_bytes=None, devices=(), cgroup_procs=(),
               rlimit_nproc=None):
    """The plan learner_agent.launch follows to start `/bin/sh -c command` in bubblewrap.

    With an `identity` (the agent is root) the learner runs as that uid and its folders are staged
    (see learner_agent.launch); else it keeps the agent's uid, in a user namespace all the same."""
    uid, gid = (identity.uid, identity.gid) if identity else (os.getuid(), os.getgid())
    staged = identity is not None
    tmp_size = str(tmp_bytes or DEFAULT_TMP_BYTES)
    isolation = [a for a in _ISOLATION if not (network_namespace and a == "--unshare-net")]
    if staged:
        visible = [work_dir, *writable_dirs, *readonly_dirs, *_RUNTIME_DIRS]
        hidden_dirs = (*hidden_dirs, *unsearchable_ancestors(visible, identity))
    system = system_view()
    mounts = _mount_args(work_dir=work_dir, writable_dirs=writable_dirs, readonly_dirs=readonly_dirs,
                         hidden_dirs=hidden_dirs, tmp_size=tmp_size, shown=_bound(system))
    stage = []
    if staged:
        mounts = _staged(mounts, stage)  # the system's folders are everyone's to read: never staged
    # bubblewrap's root is an empty tmpfs of its own: only what is mounted on it exists, and it is
    # made read-only last, once every mount point on it is made.
    args = [*isolation, "--uid", str(uid), "--gid", str(gid),
            *system, "--proc", "/proc", *_dev_args(devices, tmp_size), *mounts,
            "--remount-ro", "/", "--chdir", work_dir, "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return {"bwrap": shutil.which("bwrap"), "bwrap_args": args, "command": ["/bin/sh", "-c", command],
            "uid": identity.uid if identity else None, "gid": identity.gid if identity else None,
            "stage_dir": STAGE_DIR, "stage": stage, "cgroup_procs": list(cgroup_procs),
            "network_namespace": network_namespace, "rlimit_nproc": rlimit_nproc}


def system_view(paths=None):
    """bubblewrap arguments showing `paths` read-only at the same place, those the machine has
    (glob patterns allowed): a symlink stays a symlink, whose target the learner sees only if it is
    in its view too (/etc/resolv.conf's in /run would not be)."""
    args = []
    for pattern in SYSTEM_PATHS if paths is None else paths:
        for path in sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                args += ["--ro-bind", path, path]
    return args


def _bound(args):
    """The destinations of the binds in bubblewrap arguments."""
    return [args[i + 2] for i, a in enumerate(args) if a in ("--bind", "--ro-bind", "--dev-bind")]


def unsearchable_ancestors(paths, identity):
    """For each path, its outermost ancestor the learner's uid may not enter (a 0700 data or temp
    directory). Where that lies inside a folder of the learner's view, bubblewrap, running as that
    uid, could not create the learner's mount points below it; hidden under an empty tmpfs, it loses
    nothing the learner could have seen, and its folders are mounted inside. (Elsewhere bubblewrap
    makes the mount points on its own root, and nothing needs hiding.)"""
    found = set()
    for path in paths:
        current = "/"
        for part in [p for p in os.path.realpath(path).split(os.sep) if p][:-1]:
            current = os.path.join(current, part)
            try:
                info = os.stat(current)
            except OSError:
                break
            if not _searchable(info, identity):
                found.add(current)
                break
    return sorted(found)


def _searchable(info, identity):
    if info.st_uid == identity.uid:
        return bool(info.st_mode & 0o100)
    if info.st_gid == identity.gid:
        return bool(info.st_mode & 0o010)
    return bool(info.st_mode & 0o001)


LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")


def launcher_argv(plan_fd):
    """How the agent starts learner_agent.launch, with the plan in the memfd `plan_fd`, or with "-"
    (a launcher a spare starts ahead) on its stdin: isolated (`-I`: no PYTHON* variable, no user site, not
    even the script's own folder on sys.path) and without site-packages (`-S`: no .pth file runs while
    it may be root). Run as a script, not `-m`: launch.py needs only the standard library, and
    importing this package first (its dataclass pulls in inspect, re, enum) nearly doubled the
    launcher's start-up, which every learner's start waits for."""
    return [sys.executable, "-I", "-S", LAUNCHER, str(plan_fd)]


# The launcher's whole environment: it may be root, and nothing of the job's or the agent's reaches it.
LAUNCHER_ENV = {"PATH": os.defpath, "LANG": "C.UTF-8"}


def encode_plan(plan):
    """The plan as the launcher reads it: marshal's format (see learner_agent.launch)."""
    return marshal.dumps(plan)


def write_plan(plan):
    """The plan in an inheritable memfd for the launcher (it closes it after reading)."""
    fd = os.memfd_create("trainyard-launch-plan", 0)
    os.write(fd, encode_plan(plan))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def gpu_devices(cuda_visible_devices, *, dev="/dev"):
    """The device files of the learner's own GPUs (CUDA_VISIBLE_DEVICES, as the local backend sets
    it from the job's placement: indexes, which name /dev/nvidia<index>), plus the control devices;
    nothing for a job without GPUs. Only files that exist are returned."""
    indexes = [part.strip() for part in (cuda_visible_devices or "").split(",") if part.strip()]
    if not indexes:
        return []
    wanted = []
    for index in indexes:
        if not index.isdigit():
            log.warning("CUDA_VISIBLE_DEVICES entry %r is not an index; no device file passed for it", index)
            continue
        wanted.append(os.path.join(dev, f"nvidia{int(index)}"))
    wanted += [os.path.join(dev, name) for name in GPU_CONTROL_DEVICES]
    return [d for d in dict.fromkeys(wanted) if os.path.exists(d)]


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


def _mount_args(*, work_dir, writable_dirs, readonly_dirs, hidden_dirs, tmp_size, shown=()):
    """The private /tmp, the learner's folders and the Python runtime bound at the same path, and a
    tmpfs over each hidden dir that some folder of the view (these, or the system's: `shown`) would
    show.

    Mounts are applied outermost first (tmpfs before binds at equal depth), so a learner directory
    inside a hidden one shows through, and a hidden directory inside a visible one stays hidden.
    """
    mounts = {}
    for rank, option, dirs in ((0, "--tmpfs", _PRIVATE_DIRS),
                               (1, "--bind", [work_dir, *writable_dirs]),
                               (2, "--ro-bind", readonly_dirs)):
        for d in dirs:
            if not os.path.isdir(d) and d not in _PRIVATE_DIRS:
                continue  # nothing to show (bwrap would refuse a missing source)
            mounts[os.path.realpath(d)] = (rank, option)
    hidden = {os.path.realpath(d) for d in hidden_dirs if os.path.isdir(d)}
    for runtime in _RUNTIME_DIRS:
        runtime = os.path.realpath(runtime)
        if os.path.isdir(runtime) and (not _within(runtime, shown) or _within(runtime, hidden)):
            mounts.setdefault(runtime, (2, "--ro-bind"))
    visible = [*shown, *(path for path, (_, option) in mounts.items() if option != "--tmpfs")]
    for d in hidden:
        if _within(d, visible):
            mounts.setdefault(d, (0, "--tmpfs"))  # a folder both hidden and the learner's is shown
    args, read_only = [], []
    for path, (_, option) in sorted(mounts.items(), key=lambda m: (_depth(m[0]), m[1][0])):
        if option == "--tmpfs" and path in _PRIVATE_DIRS:
            args += ["--size", tmp_size, "--tmpfs", path]
        elif option == "--tmpfs":
            args += ["--size", str(HIDDEN_TMPFS_BYTES), "--tmpfs", path]
            read_only += ["--remount-ro", path]
        else:
            args += [option, path, path]
    # Once the mount points inside exist, hidden dirs become read-only (the binds in them stay as they are).
    return args + read_only


def _dev_args(devices, tmp_size):
    """A fresh /dev with the given devices, a sized /dev/shm, and the rest of /dev read-only (an
    unsized writable tmpfs would let the learner fill the machine's memory)."""
    args = ["--dev", "/dev"]
    for device in devices:
        args += ["--dev-bind", device, device]
    return [*args, "--size", tmp_size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]


def _staged(mounts, stage):
    """The bind arguments with each source replaced by its staged path (appending sources to `stage`)."""
    args, i = [], 0
    while i < len(mounts):
        option = mounts[i]
        if option in ("--bind", "--ro-bind"):
            stage.append(mounts[i + 1])
            args += [option, os.path.join(STAGE_DIR, str(len(stage) - 1)), mounts[i + 2]]
            i += 3
        elif option == "--size":
            args += mounts[i:i + 4]
            i += 4
        else:
            args += mounts[i:i + 2]
            i += 2
    return args


def _within(path, folders):
    """Whether `path` is one of `folders` or inside one."""
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def _depth(path):
    return len([p for p in path.split(os.sep) if p])
