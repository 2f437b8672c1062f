"""Reading the learner's process tree from /proc.

A learner is a tree of processes (a shell, python, data-loader workers, ...). The agent needs the whole
tree to enforce the memory limit (the sum over every process, as a container's limit would count it)
and to deliver signals to every process group in it (inside bubblewrap the command runs in its own
session, so signalling only the process we started would miss it). Linux only, like the agent.
"""
import contextlib
import os

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_table():
    """{pid: (ppid, pgid, rss_bytes)} for every process we can read right now."""
    table = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(entry) if entry.isdigit() else None
        if fields is None:
            continue
        try:
            table[int(entry)] = (int(fields[1]), int(fields[2]), int(fields[21]) * PAGE_BYTES)
        except (IndexError, ValueError):
            continue
    return table


def stat_fields(pid):
    """/proc/<pid>/stat's fields after the command name, or None once the process is gone.
    fields[0] is the state (stat field 3), so stat field N is fields[N - 3]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # exited meanwhile
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return stat[stat.rfind(b")") + 2:].split()


def descendants(root, table=None):
    """Pids of every live process below `root` (not `root` itself), parents before children."""
    table = process_table() if table is None else table
    children = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def tree_rss_bytes(root):
    """Resident memory of `root` and all its descendants, summed."""
    table = process_table()
    return sum(table[pid][2] for pid in [root, *descendants(root, table)] if pid in table)


def tree_process_groups(root, table=None):
    """Process group ids of `root`'s descendants (root's own group included only if one of them is in it)."""
    table = process_table() if table is None else table
    return {table[pid][1] for pid in descendants(root, table)}


def argv(pid):
    """A process's command line as a list ([] if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


def catches(pid, signum):
    """Whether the process has a handler installed for the signal (SigCgt in /proc/PID/status)."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (int(signum) - 1)))
    return False


def real_uid(pid):
    """The process's real uid, or None if it is gone. Not the owner of its /proc files, which are root's
    for a process that made itself non-dumpable (the agent: learner_agent.agent._guard_credential)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def start_time(pid):
    """When the process started (clock ticks since boot), or None if it is gone: with its pid, an
    identity a recycled pid cannot fake."""
    try:
        return int(stat_fields(pid)[19])  # stat field 22
    except (TypeError, IndexError, ValueError):  # TypeError: no fields, it is gone
        return None


def agent_running(folder):
    """Whether the agent of the learner folder `folder` runs: the process its agent.pid names is alive,
    not a zombie, and is that agent, so a recycled pid does not fool us. A cold-started agent's
    command line names the folder's agent.json; a spare that was handed the learner
    (learner_agent.spare) names only its FIFO. Either counts only if it runs as our uid (learners run
    as uids of their own, and can take any command line, another learner's agent.json included) and
    started before it wrote the pid file (a process that took the pid over later started after that)."""
    pid_file = os.path.join(folder, "agent.pid")
    try:
        with open(pid_file) as f:
            pid = int(f.read().strip())
        written_at = os.stat(pid_file).st_mtime
    except (OSError, ValueError):
        return False
    fields = stat_fields(pid)
    if fields is None or fields[:1] == [b"Z"] or real_uid(pid) != os.getuid():
        return False
    command = argv(pid)
    ours = (os.path.join(folder, "agent.json") in " ".join(command)
            or command[1:5] == ["-S", "-m", "learner_agent", "spare"])
    return ours and _started_before(pid, written_at)


def _started_before(pid, moment):
    """Whether the process started no later than `moment` (Unix seconds). The boot time /proc gives
    is whole seconds, hence the second of slack."""
    ticks = start_time(pid)
    if ticks is None:
        return False
    try:
        with open("/proc/stat") as f:
            booted = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return False
    return booted + ticks / os.sysconf("SC_CLK_TCK") <= moment + 1.0
