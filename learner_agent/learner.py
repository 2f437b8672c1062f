"""The user's command as a running process: starting it, reading its output, signalling, killing.

The command gets its own process group (session), so signals reach the shell and everything it
started, and never the agent. Inside bubblewrap there is one more layer: bwrap (and its pid-1 reaper)
sit between us and the command, which runs in a session of its own. Killing bwrap kills the whole
sandbox at once, which is right for SIGKILL but wrong for a polite signal the learner must see (the
checkpoint signal), so polite signals go to the process groups *inside* the tree instead.
"""
import contextlib
import os
import signal
import subprocess

from learner_agent import procfs

MAX_LINE_BYTES = 64 * 1024
TRUNCATED_MARK = " …[line truncated]"


def end_process(popen):
    """Kill a process of ours and reap it (a launcher started ahead that no learner took)."""
    popen.kill()
    popen.wait()


class LearnerProcess:
    def __init__(self, popen, *, sandboxed):
        self._popen = popen
        self._sandboxed = sandboxed
        self.pid = popen.pid
        self.stdout = popen.stdout
        self.stderr = popen.stderr

    @classmethod
    def start(cls, argv, *, env, cwd, sandboxed, pass_fds=()):
        popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, close_fds=True, pass_fds=pass_fds)
        return cls(popen, sandboxed=sandboxed)

    @classmethod
    def start_ahead(cls, argv, *, env, cwd):
        """A process started before its learner exists, waiting on its stdin for what it is to run
        (a sandbox launcher: learner_agent.launch `-`); `hand_plan` makes it the learner."""
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)

    @classmethod
    def hand_plan(cls, popen, plan, *, sandboxed):
        """The learner `popen` (from start_ahead) becomes once it reads `plan` (bytes) to its end;
        OSError if it is gone."""
        with popen.stdin:
            popen.stdin.write(plan)
        popen.stdin = None
        return cls(popen, sandboxed=sandboxed)

    def wait(self):
        return self._popen.wait()

    def send_signal(self, sig):
        """Deliver a signal the learner is meant to handle (terminate, checkpoint).

        The command runs under `/bin/sh -c`, which only waits for what it started; if the shell
        got a signal it does not trap it would die at once, and inside bubblewrap its exit tears
        the sandbox down before the learner has written its checkpoint. So the signal goes to
        every process below that shell, and to the shell itself only when it traps the signal or
        nothing runs below it.
        """
        table = procfs.process_table()
        shell = self._command_shell(table)
        below = procfs.descendants(shell, table) if shell else []
        if below:
            for pid in below:
                _kill(pid, sig)
            if procfs.catches(shell, sig):
                _kill(shell, sig)
            return
        if self._sandboxed:
            # The command's groups are the ones below bwrap that aren't bwrap's own. bwrap's pid-1
            # reaper is in such a group too, but as a namespace's init it ignores what it doesn't handle.
            groups = procfs.tree_process_groups(self.pid) - {self.pid}
            if groups:
                for group in groups:
                    _killpg(group, sig)
                return
            # The command hasn't started inside the sandbox yet: there is nothing to checkpoint.
        _killpg(self.pid, sig)

    def _command_shell(self, table):
        """The pid of our `/bin/sh -c COMMAND` if it is still a shell, else None."""
        for pid in [self.pid, *procfs.descendants(self.pid, table)]:
            if procfs.argv(pid)[:2] == ["/bin/sh", "-c"]:
                return pid
        return None

    def kill(self):
        """SIGKILL the whole tree: our group, every group below it, and every process in it."""
        # One reading of the process table (every /proc/<pid>/stat: milliseconds on a busy machine, at
        # the end of every learner) for both the processes and their groups.
        table = procfs.process_table()
        pids, groups = procfs.descendants(self.pid, table), procfs.tree_process_groups(self.pid, table)
        _killpg(self.pid, signal.SIGKILL)
        for group in groups:
            _killpg(group, signal.SIGKILL)
        for pid in pids:
            _kill(pid, signal.SIGKILL)

    def rss_bytes(self):
        return procfs.tree_rss_bytes(self.pid)


def iter_lines(pipe, *, max_bytes=MAX_LINE_BYTES):
    """Decoded lines without their line ending; a line over `max_bytes` is cut and marked.

    Reads in bounded pieces so a learner printing megabytes without a newline can't exhaust memory.
    """
    while True:
        chunk = pipe.readline(max_bytes + 1)
        if not chunk:
            return
        if chunk.endswith(b"\n"):
            yield _decode(chunk[:-1])
            continue
        if len(chunk) <= max_bytes:  # the last line, without a newline
            yield _decode(chunk)
            return
        # Too long: keep the first max_bytes, skip the rest of this line.
        rest = chunk[max_bytes:]
        while not rest.endswith(b"\n"):
            rest = pipe.readline(max_bytes + 1)
            if not rest:
                break
        yield _decode(chunk[:max_bytes]) + TRUNCATED_MARK


def _decode(raw):
    return raw.decode("utf-8", errors="replace").rstrip("\r")


def _kill(pid, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _killpg(group, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
