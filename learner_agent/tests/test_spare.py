"""Spare agents (learner_agent.spare): started ahead of a learner, handed one through a FIFO, and
exactly one deploy gets each; an idle or dead spare costs nothing but speed."""
import json
import os
import subprocess
import threading
import time

import pytest

from learner_agent import cgroups, procfs, sandbox, spare
from learner_agent.agent import clean_environment
from tests.support.agent_runs import (CPU_BURNER, agent_env, needs_cgroups, read_exit, stop_process, wait_for,
                                      write_agent_config)


@pytest.fixture
def spare_dir(outside_tmp):
    path = os.path.join(outside_tmp, "spares")
    os.makedirs(path, mode=0o700)
    return path


def start_spares(directory, count, *, idle_s=60, env=None):
    """Real spare processes on fresh FIFOs, as the backend starts them (its clean environment)."""
    started = []
    env = env or clean_environment({"PATH": os.environ["PATH"], "LANG": "C.UTF-8"})
    spare.replenish(directory, count, lambda fifo: started.append(subprocess.Popen(
        spare.spare_argv(fifo, idle_s=idle_s), cwd=directory, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    return started


def start_spare(directory, *, idle_s=60, env=None):
    [process] = start_spares(directory, 1, idle_s=idle_s, env=env)
    return process


def names(directory):
    return sorted(name.rsplit(".", 1)[1] for name in os.listdir(directory))


def test_a_spare_becomes_the_agent_of_the_learner_it_is_handed(outside_tmp, ingest, spare_dir):
    process = start_spare(spare_dir)
    try:
        wait_for(lambda: names(spare_dir) == ["ready"], timeout=20)
        config = write_agent_config(outside_tmp, ingest, command="sleep 1; echo done")
        folder = os.path.dirname(config)
        assert spare.hand_over(spare_dir, config)
        assert names(spare_dir) == []  # nobody else can take it now
        assert wait_for(lambda: procfs.agent_running(folder))
        assert int(open(os.path.join(folder, "agent.pid")).read()) == process.pid
        assert process.wait(timeout=30) == 0
        assert read_exit(config)["exit_code"] == 0
        assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["done"]
        assert not procfs.agent_running(folder)
        assert "agent %d for training-test0001" % process.pid in open(os.path.join(folder, "agent.log")).read()
    finally:
        stop_process(process)


def test_a_spare_started_with_secrets_in_its_environment_drops_them_before_it_runs_a_learner(
        outside_tmp, ingest, spare_dir):
    process = start_spare(spare_dir, env=agent_env(PLATFORM_SECRET="s3cret"))
    try:
        wait_for(lambda: names(spare_dir) == ["ready"], timeout=20)
        config = write_agent_config(outside_tmp, ingest, command="sleep 2")
        assert spare.hand_over(spare_dir, config)
        wait_for(lambda: procfs.argv(process.pid)[-2:] == ["--config", config])  # re-executed as a cold agent
        assert b"PLATFORM_SECRET" not in open(f"/proc/{process.pid}/environ", "rb").read()
        assert process.wait(timeout=30) == 0
        assert read_exit(config)["exit_code"] == 0
    finally:
        stop_process(process)


def test_hand_over_declines_when_no_spare_is_ready_and_clears_a_dead_ones_fifo(outside_tmp, spare_dir):
    config = os.path.join(outside_tmp, "agent.json")
    assert not spare.hand_over(spare_dir, config)  # none at all
    os.mkfifo(os.path.join(spare_dir, "a" + spare.STARTING))  # still starting: not offered
    dead = os.path.join(spare_dir, "b" + spare.READY)
    os.mkfifo(dead)  # ready once, but nothing holds it open any more
    assert not spare.hand_over(spare_dir, config)
    assert names(spare_dir) == ["starting"]


def test_of_two_deploys_racing_for_one_spare_exactly_one_gets_it(outside_tmp, spare_dir):
    fifo = os.path.join(spare_dir, "only" + spare.READY)
    os.mkfifo(fifo, 0o600)
    held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the spare's end
    try:
        barrier, results = threading.Barrier(2), []

        def deploy(name):
            barrier.wait()
            results.append((name, spare.hand_over(spare_dir, os.path.join(outside_tmp, name, "agent.json"))))
        threads = [threading.Thread(target=deploy, args=(name,)) for name in ("one", "two")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [name for name, took in results if took]
        assert len(winners) == 1
        assert os.read(held, 4096) == os.path.join(outside_tmp, winners[0], "agent.json").encode() + b"\n"
        with pytest.raises(BlockingIOError):
            os.read(held, 4096)  # the loser wrote nothing
    finally:
        os.close(held)


def test_an_idle_spare_takes_its_fifo_and_exits(spare_dir):
    process = start_spare(spare_dir, idle_s=0.5)
    try:
        assert process.wait(timeout=20) == 0
        assert names(spare_dir) == []
    finally:
        stop_process(process)


def test_retired_spares_exit_without_running_anything(spare_dir):
    processes = start_spares(spare_dir, 2)
    try:
        wait_for(lambda: names(spare_dir) == ["ready", "ready"], timeout=20)
        assert spare.retire(spare_dir) == 2
        assert [process.wait(timeout=20) for process in processes] == [0, 0]
        assert names(spare_dir) == []
    finally:
        for process in processes:
            stop_process(process)


def test_replenish_tops_up_to_the_count_and_clears_fifos_whose_spare_never_came(spare_dir):
    started = []
    assert spare.replenish(spare_dir, 2, started.append) == 2
    assert spare.replenish(spare_dir, 2, started.append) == 0  # starting ones count
    assert [os.path.dirname(f) for f in started] == [spare_dir] * 2
    long_ago = time.time() - spare.STALE_S - 1
    os.utime(started[0], (long_ago, long_ago))
    assert spare.replenish(spare_dir, 2, started.append) == 1
    assert not os.path.exists(started[0])
    assert names(spare_dir) == ["starting", "starting"]


def test_replenish_replaces_a_ready_spare_that_was_killed(spare_dir):
    process = start_spare(spare_dir)
    try:
        wait_for(lambda: names(spare_dir) == ["ready"], timeout=20)
        assert spare.replenish(spare_dir, 1, lambda fifo: None) == 0  # alive: it counts
        stop_process(process)  # SIGKILL: it could not tidy up
        assert names(spare_dir) == ["ready"]
        assert spare.replenish(spare_dir, 1, lambda fifo: None) == 1
        assert names(spare_dir) == ["starting"]
    finally:
        stop_process(process)


def test_a_failed_start_leaves_no_fifo(spare_dir):
    def fail(fifo):
        raise OSError("no")
    with pytest.raises(OSError):
        spare.replenish(spare_dir, 1, fail)
    assert names(spare_dir) == []


def test_an_agent_pid_counts_only_for_the_process_that_wrote_it(outside_tmp, spare_dir):
    """agent_running: a spare counts as the folder's agent only if it started before agent.pid was
    written; a process that took the pid over later, or any other program, does not."""
    process = start_spare(spare_dir)
    other = subprocess.Popen(["sleep", "30"])
    try:
        wait_for(lambda: names(spare_dir) == ["ready"], timeout=20)
        pid_file = os.path.join(outside_tmp, "agent.pid")
        with open(pid_file, "w") as f:
            f.write(f"{process.pid}\n")
        assert procfs.agent_running(outside_tmp)
        an_hour_ago = time.time() - 3600  # written before this process existed: a recycled pid
        os.utime(pid_file, (an_hour_ago, an_hour_ago))
        assert not procfs.agent_running(outside_tmp)
        with open(pid_file, "w") as f:
            f.write(f"{other.pid}\n")
        assert not procfs.agent_running(outside_tmp)
    finally:
        stop_process(process)
        stop_process(other)


needs_bwrap = pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason=f"no sandbox: {sandbox.bwrap_problem()}")


def ready_spare_with_launcher(spare_dir, **kwargs):
    """A spare that is ready, and the launcher it started ahead: its one child, waiting on its stdin."""
    process = start_spare(spare_dir, **kwargs)
    try:
        wait_for(lambda: names(spare_dir) == ["ready"], timeout=20)
        children = wait_for(lambda: procfs.descendants(process.pid), timeout=20)
        assert len(children) == 1
        assert procfs.argv(children[0])[-2:] == [sandbox.LAUNCHER, "-"]
    except BaseException:
        stop_process(process)
        raise
    return process, children[0]


@needs_bwrap
def test_a_spare_starts_its_learners_launcher_ahead_and_hands_it_the_plan(outside_tmp, ingest, spare_dir):
    process, launcher = ready_spare_with_launcher(spare_dir)
    try:
        # Started before any job: the fixed environment, nothing of the spare's.
        assert open(f"/proc/{launcher}/environ", "rb").read().split(b"\0")[:-1] == [
            f"{key}={value}".encode() for key, value in sandbox.LAUNCHER_ENV.items()]
        config = write_agent_config(outside_tmp, ingest, command="echo inside $TRAINYARD_JOB_ID", sandbox="bwrap")
        assert spare.hand_over(spare_dir, config)
        assert process.wait(timeout=30) == 0
        assert json.load(open(os.path.join(os.path.dirname(config), "learner.pid")))["pid"] == launcher
        assert read_exit(config)["exit_code"] == 0
        assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["inside training-test0001"]
    finally:
        stop_process(process)


@needs_bwrap
def test_a_launcher_started_ahead_that_no_learner_takes_is_ended(outside_tmp, ingest, spare_dir):
    # Handed a learner without a sandbox:
    process, launcher = ready_spare_with_launcher(spare_dir)
    try:
        config = write_agent_config(outside_tmp, ingest, command="echo plain", sandbox="none")
        assert spare.hand_over(spare_dir, config)
        assert process.wait(timeout=30) == 0
        assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["plain"]
        assert not os.path.exists(f"/proc/{launcher}")
    finally:
        stop_process(process)
    # ... and a spare that expires:
    process, launcher = ready_spare_with_launcher(spare_dir, idle_s=1.5)
    try:
        assert process.wait(timeout=30) == 0
        assert not os.path.exists(f"/proc/{launcher}")
    finally:
        stop_process(process)


def cgroup_of(pid):
    """The folder of the pid's group in the cpu hierarchy (v1), or None once it has gone."""
    try:
        lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    except OSError:
        return None
    path = next(line.split(":", 2)[2] for line in lines if "cpu" in line.split(":")[1].split(","))
    return os.path.join(cgroups._hierarchies("/proc/self/mounts")[1]["cpu"], path.lstrip("/"))


@needs_cgroups
def test_a_spares_launcher_waits_in_a_standby_group_that_becomes_the_learners_with_its_limits(
        outside_tmp, ingest, spare_dir):
    process, launcher = ready_spare_with_launcher(spare_dir)
    try:
        waiting = cgroup_of(launcher)
        assert os.path.basename(waiting).startswith(cgroups.STANDBY), waiting  # joined before it was ready
        learners = os.path.join(os.path.dirname(waiting), "training-test0001-a1-l0")
        config = write_agent_config(outside_tmp, ingest, command=CPU_BURNER, sandbox="bwrap", cpus=0.3)
        assert spare.hand_over(spare_dir, config)
        # The launcher became bubblewrap, in the group it waited in, now named and limited as the learner's.
        assert wait_for(lambda: cgroup_of(launcher) == learners, timeout=20)
        assert open(os.path.join(learners, "cpu.cfs_quota_us")).read().strip() == "30000"
        assert not os.path.exists(waiting)
        assert process.wait(timeout=60) == 0
        lines = [r["line"] for r in ingest.stored() if r["kind"] == "log"]
        assert float(next(line for line in lines if line.startswith("cpu share")).split()[-1]) < 0.45, lines
        assert not os.path.exists(learners)  # removed with the learner
    finally:
        stop_process(process)


@needs_cgroups
def test_a_spare_that_no_learner_takes_removes_its_standby_group(spare_dir):
    process, launcher = ready_spare_with_launcher(spare_dir, idle_s=1.5)
    try:
        waiting = cgroup_of(launcher)
        assert os.path.basename(waiting).startswith(cgroups.STANDBY) and os.path.isdir(waiting)
        assert process.wait(timeout=30) == 0
        assert not os.path.exists(waiting)
    finally:
        stop_process(process)
