"""The first process of a sandboxed learner: it puts itself in the learner's place, then becomes bubblewrap.

The agent starts `python -I -S .../learner_agent/launch.py PLAN_FD` with a fixed environment and the
plan (built by learner_agent.sandbox.bwrap_plan) in an inherited memfd, in `marshal`'s format: built
into the interpreter, where importing json (and with it `re`) would lengthen every learner's start.
Only the agent writes it, before the learner exists. A spare agent starts its launcher ahead, as
`launch.py -`, and hands it the plan through its stdin (see _read_plan). In order, each step
only when the plan asks for it:

1. join the learner's control groups, so everything started from here on is counted and limited;
2. join the job's shared network namespace (setns, as nsenter does);
3. stage the learner's folders (root only): bubblewrap runs as the learner's uid, which may not be
   allowed to walk the path to the job's folders (a 0700 data directory, a test's temp dir), so
   they are bind-mounted under a root-made, world-searchable tmpfs in a private mount namespace
   of this process, and bubblewrap binds them from there to their real paths;
4. limit the uid's processes (RLIMIT_NPROC) where no pids cgroup does it;
5. set no_new_privs and drop to the learner's uid and gid with no supplementary groups;
6. limit the size of any one file the learner writes (RLIMIT_FSIZE, at the job's largest disk cap:
   learner_agent.diskwatch), last, once this process has written its own files;
7. refuse fallocate (a seccomp filter, inherited by everything the learner starts): it takes a file's
   blocks without writing them, gigabytes in a millisecond, far past a disk cap before the agent's
   next measurement; refused (EOPNOTSUPP, as file systems without it answer), glibc's
   posix_fallocate falls back to writing, and space goes no faster than writes do;
8. exec bubblewrap with its arguments in a memfd (`--args`), so the learner's environment never
   appears on a command line other users of the machine can read.

Until step 5 this process may be root, so nothing the job controls reaches it: `-I` ignores
PYTHON* variables and puts no folder of anyone's on sys.path, `-S` skips site-packages, only the
standard library is imported (not even this package) and the environment is the agent's fixed
one; the learner's own environment travels inside the plan and is set by bubblewrap (`--clearenv`,
`--setenv`). A failure is printed to stderr, which is the learner's, so the job's log says why it
never started (exit status 126).
"""
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38
FAILED = 126


class LaunchError(RuntimeError):
    pass


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan = marshal.loads(_read_plan(argv[0]))
        launch(plan)
    except (LaunchError, OSError, ValueError, IndexError, EOFError, TypeError, KeyError) as e:
        print(f"trainyard sandbox: the learner could not be started: {e}", file=sys.stderr, flush=True)
        return FAILED
    return FAILED  # not reached: launch() execs


def launch(plan):
    for procs in plan.get("cgroup_procs", ()):
        _step(f"joining the control group {os.path.dirname(procs)}", _write, procs, str(os.getpid()))
    if plan.get("network_namespace"):
        _step("joining the job's network namespace", _setns, plan["network_namespace"], CLONE_NEWNET)
    if plan.get("stage"):
        _step("staging the learner's folders", _stage, plan["stage_dir"], plan["stage"])
    if plan.get("rlimit_nproc"):
        limit = int(plan["rlimit_nproc"])
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise LaunchError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    if plan.get("uid") is not None:
        os.setgroups([])
        os.setgid(int(plan["gid"]))
        os.setuid(int(plan["uid"]))
        if os.getuid() != int(plan["uid"]) or os.geteuid() != int(plan["uid"]):
            raise LaunchError("could not drop to the learner's uid")
    args_fd = _memfd("bwrap-args", b"".join(a.encode() + b"\0" for a in plan["bwrap_args"]))
    if plan.get("rlimit_fsize"):
        limit = int(plan["rlimit_fsize"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    _refuse_fallocate()
    bwrap = plan["bwrap"]
    os.execve(bwrap, [bwrap, "--args", str(args_fd), "--", *plan["command"]], {"PATH": os.defpath})


# (native audit arch, its fallocate, compat arch, its fallocate) by machine: <linux/audit.h>, the
# kernel's syscall tables. x86_64's x32 calls carry bit 30 in their number, masked off before comparing.
FALLOCATE = {"x86_64": (0xC000003E, 285, 0x40000003, 324), "aarch64": (0xC00000B7, 47, 0x40000028, 352)}
X32_BIT = 0x40000000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
EOPNOTSUPP = 95
BPF_LD_W_ABS, BPF_JEQ_K, BPF_AND_K, BPF_RET_K = 0x20, 0x15, 0x54, 0x06


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def fallocate_filter(machine):
    """The classic BPF program (sock_filter entries, packed) that answers fallocate with EOPNOTSUPP
    and allows every other call; None on a machine not in FALLOCATE. seccomp_data: nr at 0, arch at 4."""
    if machine not in FALLOCATE:
        return None
    native, native_nr, compat, compat_nr = FALLOCATE[machine]
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # 0: arch
        (BPF_JEQ_K, 0, 3, native),  # 1: native → 2, else → 5
        (BPF_LD_W_ABS, 0, 0, 0),  # 2: nr
        (BPF_AND_K, 0, 0, ~X32_BIT & 0xFFFFFFFF),  # 3
        (BPF_JEQ_K, 4, 3, native_nr),  # 4: fallocate → 9, else → 8
        (BPF_JEQ_K, 0, 2, compat),  # 5: compat → 6, else → 8
        (BPF_LD_W_ABS, 0, 0, 0),  # 6: nr
        (BPF_JEQ_K, 1, 0, compat_nr),  # 7: fallocate → 9, else → 8
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),  # 8
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EOPNOTSUPP),  # 9
    ]
    return b"".join(code.to_bytes(2, sys.byteorder) + bytes([jt, jf]) + k.to_bytes(4, sys.byteorder)
                    for code, jt, jf, k in program)


def _refuse_fallocate():
    """Install fallocate_filter (no_new_privs is set already, so no privilege is needed)."""
    program = fallocate_filter(os.uname().machine)
    if program is None:
        return
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if _libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise LaunchError(f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}")


def _read_plan(source):
    """The plan's bytes from the memfd numbered `source`, or with "-" from stdin: a launcher started
    ahead of its learner (learner_agent.spare) waits there until the agent writes the plan and closes
    the pipe; the learner's stdin is then /dev/null, as for a launcher started with its plan."""
    if source != "-":
        with os.fdopen(int(source), "rb") as f:
            return f.read()
    with os.fdopen(os.dup(0), "rb") as f:
        data = f.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return data


def _step(what, action, *args):
    try:
        action(*args)
    except OSError as e:
        raise LaunchError(f"{what}: {e.strerror or e}") from e


def _stage(stage_dir, sources):
    """Bind each source at stage_dir/<index>, visible only in this process's new mount namespace."""
    libc = _libc()
    os.makedirs(stage_dir, mode=0o755, exist_ok=True)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Private: none of these mounts propagates back to the machine's namespace.
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    # Opened in the new namespace (a bind's source must be in it) and before the stage covers
    # anything; O_NOFOLLOW refuses a source that is itself a symlink (a learner of an earlier
    # attempt could have planted one where a later attempt's folder is expected).
    fds = [os.open(src, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC) for src in sources]
    _check(libc.mount(b"tmpfs", stage_dir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=64k"),
           f"mounting a tmpfs on {stage_dir}")
    for index, fd in enumerate(fds):
        target = os.path.join(stage_dir, str(index))
        os.mkdir(target, 0o755)
        _check(libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND | MS_REC, None),
               f"binding {sources[index]}")
        os.close(fd)


def _setns(path, kind):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc().setns(fd, kind), f"setns({path})")
    finally:
        os.close(fd)


def _memfd(name, data):
    """An inheritable in-memory file holding `data`, positioned at its start."""
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write(path, value):
    with open(path, "w") as f:
        f.write(value)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


if __name__ == "__main__":
    sys.exit(main())
