"""Spare agents: agent processes started before their learner exists, so that a deploy on the local
backend hands the learner to an interpreter that has already started and imported the agent.

A cold start costs each learner time before its command can begin (the interpreter, then the
agent's modules), which a short job feels. A spare pays it ahead of time, while no job is waiting.

The spares live in one directory of the backend's (0700, under the platform's data directory,
which learners never see): one FIFO each, moved between names by atomic renames, so any number of
deploying workers and the spares themselves agree on who owns which (only one rename of a name wins):

    <id>.starting  made by the backend (`replenish`), which then starts `python -m learner_agent spare`
                   on it;
    <id>.ready     the spare opened it (for reading and writing, so it never sees end-of-file) and
                   imported and probed everything a run needs;
    <id>.taken     a deploy renamed it (`hand_over`), wrote the config's path into it and removed it;
                   the spare reads the path and becomes that learner's agent (agent.run_agent) in the
                   learner's folder, with its stdout and stderr on the learner's agent.log;
    <id>.expired   the spare waited IDLE_S without a learner: it takes its own FIFO the same way and
                   exits. One that loses that race to a deploy reads the path and runs it.

A worker that starts `retire`s the ready spares (an empty line instead of a path: exit), so those of
the code it replaced (an upgrade) never run a learner.

`replenish` removes what a spare left behind: a `.ready` FIFO nobody holds open (its spare was killed,
as a platform stop does) and one still `.starting` after STALE_S (its spare never came up).
A spare holds nothing of any job until it is handed one, and its environment is the clean one a
cold-started agent gets (agent.clean_environment).
"""
import contextlib
import os
import select
import sys
import time
import uuid

STARTING, READY, TAKEN, EXPIRED = ".starting", ".ready", ".taken", ".expired"
IDLE_S = 600.0  # then it exits, so an upgraded platform's code reaches every agent within this
STALE_S = 30.0
HANDOFF_WAIT_S = 10.0  # a deploy that took the FIFO writes the path at once; this is for a stuck one
MAX_MESSAGE = 4096  # PIPE_BUF: a write this size reaches the reader whole
RETIRE = b"\n"  # instead of a config path: exit


def spare_argv(fifo, *, idle_s=IDLE_S):
    """The command line of a spare waiting on `fifo` (`-S` as for a cold start: agent.agent_argv)."""
    return [sys.executable, "-S", "-m", "learner_agent", "spare", "--fifo", str(fifo), "--idle-s", f"{idle_s:g}"]


# --- the backend's side --------------------------------------------------------------------------

def hand_over(directory, config_path):
    """Give the learner whose config is `config_path` to a ready spare; False if none took it (then
    the caller starts an agent itself)."""
    message = os.fsencode(os.path.abspath(config_path)) + b"\n"
    return len(message) <= MAX_MESSAGE and any(_send(taken, message) for taken in _take_ready(directory))


def retire(directory):
    """Tell every ready spare to exit (an empty line instead of a path): a restarted worker, maybe
    of an upgraded platform, starts its spares afresh from the code now on disk. How many were told."""
    return sum(_send(taken, RETIRE) for taken in _take_ready(directory))


def _take_ready(directory):
    """Ready FIFOs, each renamed to taken just before it is yielded (only one rename of a name wins:
    another deploy, or a spare's own idle timeout, may take one first); a caller that stops asking
    leaves the rest ready."""
    for ready in _named(directory, READY):
        taken = ready[:-len(READY)] + TAKEN
        try:
            os.rename(ready, taken)
        except FileNotFoundError:
            continue
        yield taken


def _send(taken, message):
    """Write `message` into a taken FIFO and remove it; False if its spare is gone."""
    try:
        fd = os.open(taken, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # ENXIO: nobody holds it open any more, its spare died
        _remove(taken)
        return False
    try:
        written = os.write(fd, message)
    except OSError:  # EPIPE: it died just now
        written = 0
    finally:
        os.close(fd)
        _remove(taken)  # the message stays in the pipe for the spare, which still holds it open
    return written == len(message)


def replenish(directory, count, start):
    """Make sure `count` spares are ready or starting in `directory`; `start(fifo)` starts one on a
    FIFO made for it. Returns how many were started."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    now = time.time()
    live = 0
    for path in _named(directory, STARTING, READY, TAKEN):
        if path.endswith(READY):
            gone = not _held_open(path)  # its spare was killed (a platform stop, SIGKILL)
        else:
            gone = now - _mtime(path, now) > STALE_S  # its spare never came up, or a deploy died
        if gone:
            _remove(path)
        elif not path.endswith(TAKEN):
            live += 1
    started = 0
    for _ in range(count - live):
        fifo = os.path.join(directory, uuid.uuid4().hex + STARTING)
        os.mkfifo(fifo, 0o600)
        try:
            start(fifo)
        except BaseException:
            _remove(fifo)
            raise
        started += 1
    return started


# --- the spare's side ----------------------------------------------------------------------------

def main(argv):
    """`python -m learner_agent spare --fifo PATH [--idle-s S]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m learner_agent spare",
                                     description="wait for a learner to be handed over, then run its agent")
    parser.add_argument("--fifo", required=True, help="the FIFO the platform made for this spare")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="exit after this long without a learner")
    args = parser.parse_args(argv)
    return serve(args.fifo, idle_s=args.idle_s)


def serve(fifo, *, idle_s=IDLE_S):
    """Wait on `fifo` for a learner and run its agent; the exit code (0 when none came)."""
    try:
        fd = os.open(fifo, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0  # removed as stale before this process got here
    _warm_up()
    launcher = _start_launcher()
    standby = _standby_group(fifo, launcher)
    try:
        return _wait_and_serve(fifo, fd, idle_s, launcher, standby)
    finally:
        if launcher is not None and launcher.stdin is not None:  # no learner was handed it
            from learner_agent.learner import end_process
            end_process(launcher)
        if standby is not None and standby.standing_by:  # no agent adopted it
            standby.remove()


def _wait_and_serve(fifo, fd, idle_s, launcher, standby):
    ready = fifo[:-len(STARTING)] + READY
    try:
        os.rename(fifo, ready)
    except FileNotFoundError:
        return 0
    config_path = _read_path(fd, idle_s)
    if config_path is None:
        try:
            os.rename(ready, ready[:-len(READY)] + EXPIRED)
        except FileNotFoundError:  # a deploy took it meanwhile: its path is on the way
            config_path = _read_path(fd, HANDOFF_WAIT_S)
        else:
            _remove(ready[:-len(READY)] + EXPIRED)
    os.close(fd)
    if not config_path:  # none came, or told to retire
        return 0
    return _become_agent(config_path, launcher, standby)


def _warm_up():
    """Everything a run imports or probes before its command starts, done while no job waits."""
    from learner_agent import agent, sandbox  # noqa: F401 - the imports are the point
    # The shipper imports it on its first post (learner_agent.shipper: a cold start's command need
    # not wait for it); a spare has the time now. Without this, a job that ends within a few tens of
    # milliseconds of its start waited for that import before its end was reported.
    import http.client  # noqa: F401
    sandbox.bwrap_problem()


def _start_launcher():
    """The sandbox launcher of the learner this spare will run, started now (Agent._launch): its
    interpreter's start-up is then not the learner's to wait for. None where no learner would get a
    sandbox, or where this spare will re-execute itself first (_become_agent)."""
    from learner_agent import sandbox
    from learner_agent.agent import _CLEAN_ENV_MARK
    from learner_agent.learner import LearnerProcess
    if sandbox.bwrap_problem() is not None or not os.environ.get(_CLEAN_ENV_MARK):
        return None
    try:
        return LearnerProcess.start_ahead(sandbox.launcher_argv("-"), env=sandbox.LAUNCHER_ENV,
                                          cwd=sandbox.PACKAGE_PARENT)
    except OSError as e:
        print(f"learner_agent spare {os.getpid()}: no launcher started ahead ({e})", file=sys.stderr, flush=True)
        return None


def _standby_group(fifo, launcher):
    """A control group the launcher started ahead waits in, for the learner's agent to adopt as the
    learner's (learner_agent.cgroups: moving a process into a group is the slow step, so it is done
    now, while no job waits); None where there is none to be had (no launcher, not root, cgroup v2).
    Those that killed spares left behind are removed first."""
    if launcher is None:
        return None
    from learner_agent import cgroups
    try:
        cgroups.remove_stale_standby()
        group = cgroups.standby(os.path.basename(fifo).split(".")[0])
    except (cgroups.CgroupError, OSError):
        return None
    try:
        group.join(launcher.pid)
    except OSError as e:
        print(f"learner_agent spare {os.getpid()}: the launcher waits outside a control group ({e})",
              file=sys.stderr, flush=True)
        group.remove()  # kills a launcher that got into part of it; the agent then starts another
        return None
    return group


def _read_path(fd, timeout):
    readable, _, _ = select.select([fd], [], [], timeout)
    if not readable:
        return None
    message = os.read(fd, MAX_MESSAGE)
    if not message.endswith(b"\n"):
        print(f"learner_agent spare {os.getpid()}: ignoring a malformed hand-over {message[:80]!r}",
              file=sys.stderr, flush=True)
        return None
    return os.fsdecode(message[:-1])


def _become_agent(config_path, launcher=None, standby=None):
    """What `python -m learner_agent run --config PATH` started by setsid would do, in this process."""
    from learner_agent.agent import _drop_inherited_environment, run_agent, settle_in
    from learner_agent.config import ConfigError, load_config

    settle_in(os.path.dirname(config_path))
    try:
        config = load_config(config_path)
    except ConfigError as e:
        print(f"learner_agent: {e}", file=sys.stderr, flush=True)
        return 2
    # The backend starts spares with the agent's clean environment; one started otherwise becomes a
    # cold-started agent instead (a re-exec) rather than hand its environment to the learner's agent.
    _drop_inherited_environment(config)
    return run_agent(config, launcher=launcher, standby=standby)


# --- helpers -------------------------------------------------------------------------------------

def _named(directory, *suffixes):
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    return [os.path.join(directory, name) for name in names if name.endswith(suffixes)]


def _held_open(fifo):
    """Whether some process has the FIFO open for reading (opening it to write fails otherwise)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError:
        return False
    return True


def _mtime(path, default):
    try:
        return os.stat(path).st_mtime
    except OSError:
        return default


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
