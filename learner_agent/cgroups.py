"""One control group per learner: its memory (tmpfs and shared memory included), CPU quota and pids.

Polling the learner's RSS misses what matters most to the machine: files in the sandbox's tmpfs
mounts and shared memory are not in any process's RSS, and RSS says nothing about CPU time or a
fork bomb. A control group counts all of it in the kernel. The agent creates the group, the launcher
(learner_agent.launch) moves itself in before it starts bubblewrap, so everything the learner ever
starts is inside, and the agent removes the group once the learner has ended.

cgroup v2 is used where its controllers are available, else v1 (one hierarchy per controller), else
nothing: `create` returns None with the reason, and the agent falls back to polling RSS.

Writing the limits needs write access to the hierarchy, in practice root; the groups live in a
`trainyard` group below the agent's own (v1) or at the top of the v2 hierarchy (v2's rule of no
processes in inner groups forbids the agent's own).
"""
import contextlib
import os
import re
import signal
import time

PARENT = "trainyard"
CPU_PERIOD_US = 100_000
REMOVE_TIMEOUT_S = 5.0
_V1_CONTROLLERS = ("memory", "cpu", "pids")
STANDBY = "standby-"  # the name of every standby group starts so (`standby`)
STANDBY_STALE_S = 60.0


class CgroupError(RuntimeError):
    """No control group can be made here; the message says why."""


class Cgroup:
    """A learner's control group: one directory (v2) or one per controller (v1)."""

    def __init__(self, version, dirs):
        self.version = version
        self.dirs = dirs  # {"memory": path, "cpu": path, "pids": path}; v2: the same path thrice

    @property
    def procs_files(self):
        """Where a process writes its pid to join (each hierarchy once)."""
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    def oom_kills(self):
        """How many times the kernel killed a process here for exceeding the memory limit."""
        memory = self.dirs["memory"]
        if self.version == 2:
            return read_key(os.path.join(memory, "memory.events"), "oom_kill") or 0
        kills = read_key(os.path.join(memory, "memory.oom_control"), "oom_kill")
        if kills is None:  # kernels before 4.13 only count hitting the limit
            return read_int(os.path.join(memory, "memory.failcnt")) or 0
        return kills

    @property
    def standing_by(self):
        """Whether this is still a standby group (`standby`), not yet a learner's."""
        return all(os.path.basename(d).startswith(STANDBY) for d in self.dirs.values())

    def join(self, pid):
        """Move process `pid` into the group, in every hierarchy."""
        for procs in self.procs_files:
            _write(procs, str(pid))

    def adopt(self, name, *, memory_bytes, cpus, max_processes):
        """Make this standby group (`standby`) the learner's group `name`, with the processes already
        in it: its limits are written, then it is renamed. CgroupError if it can't be (v2, a group
        `name` left over, a limit refused); the group keeps its processes either way."""
        if self.version != 1:
            raise CgroupError("a cgroup v2 group cannot be renamed")
        try:
            _write_v1_limits(self.dirs, memory_bytes=memory_bytes, cpus=cpus, max_processes=max_processes)
        except OSError as e:
            raise CgroupError(f"cgroup v1: {e.strerror or e} ({e.filename})") from e
        renamed = {c: os.path.join(os.path.dirname(d), _safe_name(name)) for c, d in self.dirs.items()}
        moved = []
        try:
            for controller, path in self.dirs.items():
                os.rename(path, renamed[controller])
                moved.append(controller)
        except OSError as e:
            for controller in moved:  # all or nothing: one name for the learner in every hierarchy
                with contextlib.suppress(OSError):
                    os.rename(renamed[controller], self.dirs[controller])
            raise CgroupError(f"cgroup v1: cannot rename {e.filename} to {name}: {e.strerror or e}") from e
        self.dirs = renamed

    def pids(self):
        found = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError), open(procs) as f:
                found.update(int(line) for line in f if line.strip())
        return found

    def remove(self, *, timeout=REMOVE_TIMEOUT_S):
        """Kill whatever is left inside and remove the group (a group with processes can't go)."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        problems = []
        for path in sorted(set(self.dirs.values())):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:  # EBUSY while the last processes are being reaped
                    if time.monotonic() >= deadline:
                        problems.append(f"{path}: {e.strerror}")
                        break
                    time.sleep(0.05)
        return problems


def create(name, *, memory_bytes, cpus, max_processes, mounts="/proc/self/mounts",
           own="/proc/self/cgroup"):
    """A new group `name` with the limits written, or raise CgroupError saying why there is none."""
    name = _safe_name(name)
    v2_root, v1_roots = _hierarchies(mounts)
    if _v2_usable(v2_root):
        return _create_v2(v2_root, name, memory_bytes=memory_bytes, cpus=cpus, max_processes=max_processes)
    missing = [c for c in _V1_CONTROLLERS if c not in v1_roots]
    if missing:
        raise CgroupError(f"no cgroup v2 with memory, cpu and pids, and no cgroup v1 {', '.join(missing)} "
                          "hierarchy mounted")
    return _create_v1(_v1_dirs(v1_roots, _own_paths(own), name),
                      limits={"memory_bytes": memory_bytes, "cpus": cpus, "max_processes": max_processes})


def standby(name, *, mounts="/proc/self/mounts", own="/proc/self/cgroup"):
    """A new group `STANDBY + name` without limits, for a process started ahead of the learner it will
    be (a spare's launcher) to wait in, until an agent `adopt`s it. CgroupError where none can be
    adopted later: no v1 hierarchy of each controller (a v2 group cannot be renamed)."""
    v2_root, v1_roots = _hierarchies(mounts)
    if _v2_usable(v2_root):
        raise CgroupError("cgroup v2 is used here, and its groups cannot be renamed")
    if any(c not in v1_roots for c in _V1_CONTROLLERS):
        raise CgroupError("no cgroup v1 hierarchy of each of memory, cpu and pids")
    return _create_v1(_v1_dirs(v1_roots, _own_paths(own), STANDBY + _safe_name(name)))


def remove_stale_standby(*, mounts="/proc/self/mounts", own="/proc/self/cgroup"):
    """Remove the standby groups that have been empty for a while: what spares that were killed (a
    platform's stop) left behind. One with a process in it stays (the kernel refuses), so a live
    spare's never goes; a spare's made this moment is younger than STANDBY_STALE_S."""
    _, v1_roots = _hierarchies(mounts)
    own_paths = _own_paths(own) if v1_roots else {}
    now = time.time()
    for controller, root in v1_roots.items():
        parent = os.path.join(root, own_paths.get(controller, "/").lstrip("/"), PARENT)
        try:
            names = [name for name in os.listdir(parent) if name.startswith(STANDBY)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):  # EBUSY: a spare's launcher waits in it; or gone meanwhile
                if now - os.stat(path).st_mtime > STANDBY_STALE_S:
                    os.rmdir(path)


def _create_v2(root, name, *, memory_bytes, cpus, max_processes):
    parent = os.path.join(root, PARENT)
    path = os.path.join(parent, name)
    try:
        for enabling in (root, parent):
            os.makedirs(parent, exist_ok=True)
            _write(os.path.join(enabling, "cgroup.subtree_control"), "+memory +cpu +pids")
        os.makedirs(path, exist_ok=True)
        group = Cgroup(2, {"memory": path, "cpu": path, "pids": path})
        if memory_bytes:
            _write(os.path.join(path, "memory.max"), str(memory_bytes))
            _write_if_present(os.path.join(path, "memory.swap.max"), "0")
        _write(os.path.join(path, "cpu.max"), f"{_quota_us(cpus)} {CPU_PERIOD_US}")
        _write(os.path.join(path, "pids.max"), str(max_processes))
    except OSError as e:
        _remove_quietly(path)
        raise CgroupError(f"cgroup v2 at {root}: {e.strerror or e} ({e.filename})") from e
    return group


def _create_v1(dirs, *, limits=None):
    """The group of `dirs`, with `limits` (_write_v1_limits) written, or none yet (a standby group)."""
    try:
        for path in dirs.values():
            os.makedirs(path, exist_ok=True)
        if limits is not None:
            _write_v1_limits(dirs, **limits)
    except OSError as e:
        for path in dirs.values():
            _remove_quietly(path)
        raise CgroupError(f"cgroup v1: {e.strerror or e} ({e.filename})") from e
    return Cgroup(1, dirs)


def _v1_dirs(roots, own_paths, name):
    return {c: os.path.join(roots[c], own_paths.get(c, "/").lstrip("/"), PARENT, name) for c in _V1_CONTROLLERS}


def _write_v1_limits(dirs, *, memory_bytes, cpus, max_processes):
    if memory_bytes:
        _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"), str(memory_bytes))
        # With swap accounting, memory+swap gets the same limit: swap must not stretch it.
        _write_if_present(os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes"), str(memory_bytes))
    _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), str(CPU_PERIOD_US))
    _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"), str(_quota_us(cpus)))
    _write(os.path.join(dirs["pids"], "pids.max"), str(max_processes))


def _safe_name(name):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _quota_us(cpus):
    """`cpus` worth of CPU time per period (the kernel's minimum quota is a millisecond)."""
    return max(1000, int(round(cpus * CPU_PERIOD_US)))


def _hierarchies(mounts):
    """(v2 mount point or None, {v1 controller: mount point}) from a mounts table."""
    v2, v1 = None, {}
    with open(mounts) as f:
        for line in f:
            fields = line.split()
            if len(fields) < 4:
                continue
            point, kind, options = fields[1], fields[2], fields[3].split(",")
            if kind == "cgroup2" and v2 is None:
                v2 = point
            elif kind == "cgroup":
                for controller in _V1_CONTROLLERS:
                    if controller in options:
                        v1.setdefault(controller, point)
    return v2, v1


def _v2_usable(root):
    """Whether the v2 hierarchy at `root` (None: none mounted) offers memory, cpu and pids."""
    if root is None:
        return False
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            return {"memory", "cpu", "pids"} <= set(f.read().split())
    except OSError:
        return False


def own_v2(*, mounts="/proc/self/mounts", own="/proc/self/cgroup"):
    """This process's own cgroup v2 group, to read (never to write or remove), or None: one whose
    `memory.current` and `cpu.stat` count it, as a Kubernetes container's group does (the agent and
    its learner share the container, and the pod's memory limit is judged on that group). A
    hierarchy's root has no memory.current (the whole machine), so it never counts."""
    v2_root, _ = _hierarchies(mounts)
    path = _own_paths(own).get("") if v2_root else None
    if path is None:
        return None
    directory = os.path.normpath(os.path.join(v2_root, path.lstrip("/")))
    if not all(os.path.isfile(os.path.join(directory, name)) for name in ("memory.current", "cpu.stat")):
        return None
    return Cgroup(2, {"memory": directory, "cpu": directory, "pids": directory})


def _own_paths(own):
    """{controller: path of this process's group} from /proc/self/cgroup; "" is cgroup v2's."""
    paths = {}
    with open(own) as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                for controller in parts[1].split(","):
                    paths[controller] = parts[2]
    return paths


def read_key(path, key):
    """The number after `key` in a cgroup file of `key value` lines (cpu.stat, memory.events), or None."""
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    return None


def read_int(path):
    """The number a one-number file (memory.current, cpuacct.usage) holds, or None."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _write(path, value):
    with open(path, "w") as f:
        f.write(value)


def _write_if_present(path, value):
    if os.path.exists(path):
        _write(path, value)


def _remove_quietly(path):
    with contextlib.suppress(OSError):
        os.rmdir(path)
