"""Disk caps on a learner's folders (learner_agent.diskwatch), alone and in a real agent."""
import os
import re
import threading
import time

import pytest

from learner_agent import diskwatch, trees
from tests.support.agent_runs import read_exit, run_agent, write_agent_config

MiB = 2**20


def write(path, size):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\1" * size)


def test_usage_counts_blocks_under_every_folder_and_each_hard_linked_file_once(tmp_path):
    write(tmp_path / "a" / "one", MiB)
    write(tmp_path / "a" / "deep" / "er" / "two", 2 * MiB)
    os.link(tmp_path / "a" / "one", tmp_path / "a" / "one-again")
    write(tmp_path / "b" / "three", MiB)
    os.symlink("/usr", tmp_path / "a" / "usr")  # not followed
    used = diskwatch.usage([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "missing")])
    assert 4 * MiB <= used < 4 * MiB + 100_000


def test_a_sparse_file_in_results_counts_at_its_length(tmp_path):
    # Storing the job's output copies results/ and checkpoints/ whole, and a copy writes a hole as
    # zeros (the push to a local result store on the platform's disk): a file of a hundred times the
    # cap that took one block was within it.
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(100 * MiB)
    for name in ("results", "checkpoints"):
        breach, _ = diskwatch.check([diskwatch.Cap(name, 2 * MiB, (str(tmp_path),))])
        assert breach is not None and breach.used >= 100 * MiB and name in breach.reason
    # The work folder is never copied: there a hole takes no room (np.memmap of a large array).
    assert diskwatch.check([diskwatch.Cap("work", 2 * MiB, (str(tmp_path),))]) == (None, pytest.approx(0, abs=0.01))


def test_each_hard_link_in_results_counts_as_the_copy_it_becomes(tmp_path):
    write(tmp_path / "one", MiB)
    for i in range(9):
        os.link(tmp_path / "one", tmp_path / f"again-{i}")
    breach, _ = diskwatch.check([diskwatch.Cap("results", 2 * MiB, (str(tmp_path),))])
    assert breach is not None and breach.used >= 10 * MiB
    assert diskwatch.check([diskwatch.Cap("work", 2 * MiB, (str(tmp_path),))])[0] is None


def test_a_folder_of_too_many_entries_is_a_breach_of_its_own(tmp_path):
    for i in range(20):
        (tmp_path / f"f{i}").touch()
    cap = diskwatch.Cap("results", 10 * MiB, (str(tmp_path),))
    breach, _ = diskwatch.check([cap], max_entries=10)
    assert breach.too_many and "more than" in breach.reason and "results" in breach.reason


def test_watch_returns_the_first_folder_over_its_cap(tmp_path):
    caps = [diskwatch.Cap("results", 2 * MiB, (str(tmp_path / "r"),)),
            diskwatch.Cap("work", 2 * MiB, (str(tmp_path / "w"), str(tmp_path / "s")))]
    write(tmp_path / "r" / "small", MiB)
    found = []
    watcher = threading.Thread(target=lambda: found.append(diskwatch.watch(caps, threading.Event(), interval=0.05,
                                                                           fast_interval=0.05)))
    watcher.start()
    time.sleep(0.2)
    assert not found
    write(tmp_path / "w" / "code", MiB)
    write(tmp_path / "s" / "big", 2 * MiB)  # work and state count together
    watcher.join(5)
    assert found[0].cap.name == "work"
    # It may measure the state folder while the 2 MiB are still being written: over 2 MiB either way.
    assert re.match(r"disk cap: the work folder used (2\.\d|3\.0)MiB, over its cap of 2\.0MiB", found[0].reason), found[0]


def test_watch_stops_when_asked(tmp_path):
    stopped = threading.Event()
    stopped.set()
    assert diskwatch.watch([diskwatch.Cap("results", MiB, (str(tmp_path),))], stopped) is None


def test_the_file_size_limit_is_the_largest_cap():
    caps = [diskwatch.Cap("results", 5, ("/r",)), diskwatch.Cap("work", 9, ("/w",))]
    assert diskwatch.file_size_limit(caps, 7) == 9
    assert diskwatch.file_size_limit(caps, 20) == 20
    assert diskwatch.file_size_limit((), None) is None


WRITER = ("python3 -c \"import os, time\n"
          "with open(os.environ['RESULT_DIR'] + '/big', 'wb') as f:\n"
          "    for i in range(200):\n"
          "        f.write(bytes(2**20)); f.flush(); time.sleep(0.02)\n"
          "print('wrote all', flush=True)\"")


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_the_agent_kills_a_learner_whose_results_pass_their_cap(outside_tmp, ingest, mode):
    results = os.path.join(outside_tmp, "job", "results")
    config = write_agent_config(outside_tmp, ingest, command=WRITER, sandbox=mode,
                                env={"RESULT_DIR": results},
                                disk_caps=[{"name": "results", "bytes": 20 * MiB, "paths": [results]}])
    assert run_agent(config).returncode == 0
    exit_info = read_exit(config)
    assert exit_info["exit_code"] == 137, exit_info
    assert exit_info["reason"].startswith("disk cap: the results folder used "), exit_info
    assert "over its cap of 20.0MiB" in exit_info["reason"]
    assert os.path.getsize(os.path.join(results, "big")) < 200 * MiB
    assert not any(r.get("line") == "wrote all" for r in ingest.stored())


def test_a_learner_that_exits_at_once_past_its_cap_still_fails(outside_tmp, ingest):
    results = os.path.join(outside_tmp, "job", "results")
    command = f"head -c {30 * MiB} /dev/zero > $RESULT_DIR/big; exit 0"
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox="none", env={"RESULT_DIR": results},
                                disk_caps=[{"name": "results", "bytes": 20 * MiB, "paths": [results]}])
    assert run_agent(config).returncode == 0
    exit_info = read_exit(config)
    # 1 when it exits before the watchdog's next look (measured at its end), 137 when the watchdog
    # kills it first: never 0, whichever way the race between them goes.
    assert exit_info["exit_code"] in (1, 137), exit_info
    assert exit_info["reason"].startswith("disk cap: the results folder"), exit_info


def test_code_that_unpacks_past_the_work_cap_is_not_run_and_says_so(outside_tmp, ingest):
    work = os.path.join(outside_tmp, "job", "attempt-1", "learner-0", "work")
    config = write_agent_config(outside_tmp, ingest, command="touch started", sandbox="none",
                                files={"big.bin": b"\0" * (3 * MiB)},
                                disk_caps=[{"name": "work", "bytes": 2 * MiB, "paths": [work]}])
    assert run_agent(config).returncode == 0
    exit_info = read_exit(config)
    assert exit_info["exit_code"] is None
    assert exit_info["reason"].startswith("disk cap: the code archive unpacks to more than the work folder's cap "
                                          "of 2.0MiB"), exit_info
    assert not os.path.exists(work)


def test_the_work_and_state_folders_go_when_the_learner_ends(outside_tmp, ingest):
    learner_dir = os.path.join(outside_tmp, "job", "attempt-1", "learner-0")
    state = os.path.join(learner_dir, "state")
    config = write_agent_config(outside_tmp, ingest, command="echo hi > scratch; echo s > $JOB_STATE_DIR/s",
                                sandbox="none", env={"JOB_STATE_DIR": state})
    assert run_agent(config).returncode == 0
    assert read_exit(config)["exit_code"] == 0
    assert not os.path.exists(os.path.join(learner_dir, "work")) and not os.path.exists(state)
    assert os.path.exists(os.path.join(learner_dir, "exit.json"))


DEEP_CHAIN = ("python3 -c \"import os\nfor _ in range(1500): os.mkdir('d'); os.chdir('d')\n"
              "open('data', 'wb').write(b'x' * {size})\"")


def test_folders_nested_past_the_depth_a_walk_can_follow_are_a_breach(tmp_path):
    deep = tmp_path
    for _ in range(diskwatch.MAX_DEPTH + 1):
        deep = deep / "d"
    deep.mkdir(parents=True)
    cap = diskwatch.Cap("results", 10 * MiB, (str(tmp_path),))
    breach, _ = diskwatch.check([cap])
    assert breach.reason == f"disk cap: the results folder cannot be measured: its folders nest deeper than " \
                            f"{diskwatch.MAX_DEPTH} levels; killed"


def test_a_learner_nesting_its_work_folder_thousands_deep_fails_and_the_folder_still_goes(outside_tmp, ingest):
    """Past PATH_MAX a walk by path counted nothing below; past a thousand levels rmtree raised."""
    learner_dir = os.path.join(outside_tmp, "job", "attempt-1", "learner-0")
    work = os.path.join(learner_dir, "work")
    config = write_agent_config(outside_tmp, ingest, command=DEEP_CHAIN.format(size=4 * MiB), sandbox="none",
                                disk_caps=[{"name": "work", "bytes": 2 * MiB, "paths": [work]}])
    try:
        assert run_agent(config).returncode == 0
        exit_info = read_exit(config)
        assert exit_info["exit_code"] in (1, 137), exit_info
        assert exit_info["reason"].startswith("disk cap: the work folder"), exit_info
        assert not os.path.exists(work)
    finally:
        trees.remove(work)  # were it left, pytest's own clean-up of old temporary folders would raise


def test_a_file_deleted_but_kept_open_is_counted_against_the_work_cap(tmp_path):
    caps = (diskwatch.Cap("results", 100 * MiB, (str(tmp_path / "results"),)),
            diskwatch.Cap("work", 2 * MiB, (str(tmp_path / "work"),)))
    for cap in caps:
        os.makedirs(cap.paths[0])
    with open(tmp_path / "work" / "held", "wb") as held:
        os.unlink(tmp_path / "work" / "held")
        held.write(b"\1" * 3 * MiB)
        held.flush()
        os.fsync(held.fileno())
        assert diskwatch.check(caps)[0] is None  # no walk finds it
        assert diskwatch.deleted_bytes([os.getpid()], caps) >= 3 * MiB
        breach, _ = diskwatch.check(caps, pids=[os.getpid()])
        assert breach.cap.name == "work" and breach.deleted >= 3 * MiB
        assert "in files it deleted but keeps open" in breach.reason


HOLDER = ("python3 -c \"import os, time\n"
          "f = open('held', 'wb'); os.unlink('held')\n"
          "for i in range(64):\n"
          "    f.write(bytes(2**20)); f.flush(); os.fsync(f.fileno()); time.sleep(0.02)\n"
          "time.sleep(2); print('held all', flush=True)\"")


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_the_agent_kills_a_learner_holding_deleted_files_past_its_work_cap(outside_tmp, ingest, mode):
    work = os.path.join(outside_tmp, "job", "attempt-1", "learner-0", "work")
    config = write_agent_config(outside_tmp, ingest, command=HOLDER, sandbox=mode,
                                disk_caps=[{"name": "work", "bytes": 8 * MiB, "paths": [work]}])
    assert run_agent(config).returncode == 0
    exit_info = read_exit(config)
    assert exit_info["exit_code"] == 137, exit_info
    assert exit_info["reason"].startswith("disk cap: the work folder used "), exit_info
    assert "in files it deleted but keeps open" in exit_info["reason"], exit_info
    assert not any(r.get("line") == "held all" for r in ingest.stored())


FALLOCATOR = ("python3 -c \"import ctypes, os\n"
              "libc = ctypes.CDLL(None, use_errno=True)\n"
              "fd = os.open(os.environ['RESULT_DIR'] + '/big', os.O_WRONLY | os.O_CREAT)\n"
              "got = libc.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(2**30))\n"
              "print('fallocate', got, ctypes.get_errno(), os.fstat(fd).st_blocks * 512, flush=True)\"")


def test_fallocate_is_refused_in_the_sandbox(outside_tmp, ingest):
    """fallocate takes a file's blocks without writing them: a gigabyte at once, far past a cap before
    the next measurement. The sandbox answers it as a file system without it does."""
    from learner_agent import sandbox
    from tests.support.optional import skip_or_fail
    if sandbox.bwrap_problem() is not None:
        skip_or_fail(f"the sandbox's seccomp filter needs bubblewrap: {sandbox.bwrap_problem()}")
    results = os.path.join(outside_tmp, "job", "results")
    config = write_agent_config(outside_tmp, ingest, command=FALLOCATOR, sandbox="bwrap", env={"RESULT_DIR": results},
                                disk_caps=[{"name": "results", "bytes": 20 * MiB, "paths": [results]}])
    assert run_agent(config).returncode == 0
    lines = [r["line"] for r in ingest.stored() if r.get("line", "").startswith("fallocate")]
    assert lines == ["fallocate -1 95 0"], lines
    assert read_exit(config)["exit_code"] == 0


class StubLearner:
    pid = 4242


class StubGroup:
    def pids(self):
        return {4242, 4243}


def test_the_disk_watch_reads_the_learners_processes_from_its_control_group(monkeypatch):
    """Walking every process on the machine at each measurement, in every agent, took most of a busy
    machine's CPU: with a control group the watch reads only its list."""
    from learner_agent import agent, procfs

    def walked(_pid):
        raise AssertionError("walked the whole process table")

    monkeypatch.setattr(procfs, "descendants", walked)
    assert agent.learner_pids(StubLearner(), StubGroup()) == {4242, 4243}
    monkeypatch.setattr(procfs, "descendants", lambda pid: [pid + 1])
    assert agent.learner_pids(StubLearner(), None) == [4242, 4243]
