"""The agent as a real process against the fake ingest endpoint: a learner's whole life."""
import io
import json
import os
import signal
import subprocess
import time

import pytest

from learner_agent import sandbox
from tests.support.agent_runs import (
    agent_command, agent_env, has_status, read_exit, run_agent, stop_process, wait_for,
    write_agent_config)

CHATTY = (
    "echo out1; echo err1 >&2; "
    "echo 'TRAINYARD_METRIC {\"name\": \"loss\", \"value\": 0.5, \"step\": 1}'; "
    "echo 'TRAINYARD_METRIC {broken'; "
    "python3 -c 'from learner_agent import report; report(\"acc\", 0.9, step=2)'; "
    "echo err2 >&2; echo epoch 2 loss 0.25; cat data.txt; exit 3"
)
MODES = ["none", pytest.param("auto", id="auto-" + ("bwrap" if sandbox.bwrap_problem() is None else "none"))]


def kinds(records):
    return [(r["kind"], r.get("state") or r.get("stream") or r.get("name")) for r in records]


def start_agent(config, **env):
    return subprocess.Popen(agent_command(config), env=agent_env(**env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("mode", MODES)
def test_it_runs_a_learner_and_reports_everything_in_order(outside_tmp, ingest, mode):
    config = write_agent_config(outside_tmp, ingest, command=CHATTY, sandbox=mode,
                                files={"data.txt": "from the archive\n"},
                                metric_regexes={"train": r"epoch (?P<epoch>\d+) loss (?P<loss>[\d.]+)"})
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    records = ingest.stored()
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert kinds(records)[:2] == [("status", "preparing"), ("status", "running")]
    assert records[-1] == {**records[-1], "kind": "status", "state": "exited", "exit_code": 3, "reason": ""}
    logs = [r for r in records if r["kind"] == "log"]
    assert [r["line"] for r in logs if r["stream"] == "stdout"] == [
        "out1", 'TRAINYARD_METRIC {"name": "loss", "value": 0.5, "step": 1}', "TRAINYARD_METRIC {broken",
        'TRAINYARD_METRIC {"name": "acc", "value": 0.9, "step": 2}', "epoch 2 loss 0.25", "from the archive"]
    assert [r["line"] for r in logs if r["stream"] == "stderr"] == ["err1", "err2"]
    # Each metric comes right after the line it was found in, with the same time.
    for i, record in enumerate(records):
        if record["kind"] == "metric":
            assert records[i - 1]["kind"] == "log" and records[i - 1]["time"] == record["time"]
    assert [(r["name"], r["value"], r["step"]) for r in records if r["kind"] == "metric"] == [
        ("loss", 0.5, 1), ("acc", 0.9, 2), ("train.loss", 0.25, 2)]
    assert read_exit(config)["exit_code"] == 3
    learner_dir = os.path.dirname(config)
    assert int(open(os.path.join(learner_dir, "agent.pid")).read()) > 0
    assert "started the command" in open(os.path.join(learner_dir, "agent.log")).read()
    assert os.path.isdir(os.path.join(outside_tmp, "job", "results"))


@pytest.mark.parametrize("mode", MODES)
def test_a_regex_that_backtracks_for_ever_costs_the_learner_its_metrics_by_regex_and_nothing_more(
        outside_tmp, ingest, mode):
    """A manifest regex that backtracks catastrophically on a line the learner prints: the search, in
    a process of its own, is stopped after its timeout and the job's log says so; every line still
    arrives and reported metrics still count. (Searched in the agent, it held the interpreter for
    hours: no line shipped, no halt heard.)"""
    command = ("echo 'epoch 1 loss 0.5'; echo " + "a" * 40 + "'!'; echo 'epoch 2 loss 0.25'; "
               "echo 'TRAINYARD_METRIC {\"name\": \"acc\", \"value\": 0.9}'; echo done")
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox=mode,
                                metric_regexes={"train": r"epoch (?P<epoch>\d+) loss (?P<loss>[\d.]+)",
                                                "slow": r"(?P<n>(a+)+)b"})
    began = time.monotonic()
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - began < 30
    records = ingest.stored()
    lines = [r["line"] for r in records if r["kind"] == "log" and r["stream"] == "stdout"]
    assert lines == ["epoch 1 loss 0.5", "a" * 40 + "!", "epoch 2 loss 0.25",
                     'TRAINYARD_METRIC {"name": "acc", "value": 0.9}', "done"]
    notices = [r["line"] for r in records if r["kind"] == "log" and r["stream"] == "system"]
    assert any("a regex of evaluation_metrics searched one line for over 2 s" in line for line in notices), notices
    assert [(r["name"], r["value"]) for r in records if r["kind"] == "metric"] == [("train.loss", 0.5), ("acc", 0.9)]
    assert read_exit(config)["exit_code"] == 0


def test_the_regex_search_spends_the_learners_cpu_quota(outside_tmp, ingest):
    """The process searching the manifest's regexes is in the learner's control group."""
    if sandbox.bwrap_problem() is not None:
        pytest.skip(f"the learner gets a control group of its own in the sandbox only: {sandbox.bwrap_problem()}")
    config = write_agent_config(outside_tmp, ingest, command="echo 'epoch 1 loss 0.5'; sleep 30.25", sandbox="auto",
                                metric_regexes={"train": r"epoch (?P<epoch>\d+) loss (?P<loss>[\d.]+)"})
    agent = start_agent(config)
    try:
        wait_for(lambda: any(r["kind"] == "metric" for r in ingest.stored()))
        agent_pid = wait_for(lambda: _read_pid(config))
        searcher = wait_for(lambda: _process_running("learner_agent.metrics", parent=agent_pid))
        learner = wait_for(lambda: _process_running("sleep 30.25"))
        group = _cgroup_of(learner)
        assert "trainyard" in group and _cgroup_of(searcher) == group
    finally:
        stop_process(agent)


def _process_running(command, *, parent=None):
    """The pid of a process whose command line holds `command` (and whose parent is `parent`), or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found = command in f.read().replace(b"\0", b" ").decode(errors="replace")
            if found and parent is not None:
                with open(f"/proc/{pid}/stat") as f:
                    found = int(f.read().rsplit(")", 1)[1].split()[1]) == parent
            if found:
                return int(pid)
        except OSError:
            pass
    return None


def _cgroup_of(pid):
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def test_a_quick_start_reports_preparing_with_running_in_one_request(outside_tmp, ingest):
    # Not a request of its own in the milliseconds the learner's start waits for (Agent._hold_status).
    config = write_agent_config(outside_tmp, ingest, command="echo hi")
    assert run_agent(config).returncode == 0
    records = ingest.stored()
    assert kinds(records)[:2] == [("status", "preparing"), ("status", "running")]
    assert ingest.batches[0][:2] == [1, 2]
    assert records[0]["time"] <= records[1]["time"]  # preparing keeps the time it began


class RecordingShipper:
    def __init__(self):
        self.batches = []

    def add_many(self, records):
        self.batches.append([(r["state"], r.get("time")) for r in records])


def test_a_slow_preparation_is_reported_while_it_lasts(outside_tmp, ingest):
    from learner_agent.agent import Agent
    from learner_agent.config import load_config
    shipper = RecordingShipper()
    agent = Agent(load_config(write_agent_config(outside_tmp, ingest, command="true")), shipper=shipper)
    began = time.time()
    agent._hold_status("preparing", 0.05)
    assert shipper.batches == []
    wait_for(lambda: shipper.batches, timeout=5)
    (state, when), = shipper.batches[0]
    assert state == "preparing" and began <= when < began + 0.05
    agent._record_status("running")
    assert [[state for state, _ in batch] for batch in shipper.batches] == [["preparing"], ["running"]]


class RefusingShipper:
    """A spool whose disk refuses it twice, as learner_agent.spool raises when not even a segment can be made."""

    def __init__(self):
        self.refusals, self.lines = 2, []

    def wait_for_room(self):
        pass

    def add_many(self, records):
        if self.refusals:
            self.refusals -= 1
            raise OSError(28, "No space left on device")
        self.lines += [r["line"] for r in records if r["kind"] == "log"]


def test_the_learners_output_waits_out_a_spool_that_refuses_it(outside_tmp, ingest, monkeypatch):
    """The reader ended at the first refusal, leaving the learner blocked on a pipe nobody read."""
    from learner_agent import agent as agent_module
    from learner_agent.config import load_config
    monkeypatch.setattr(agent_module, "SPOOL_RETRY_S", 0.01)
    shipper = RefusingShipper()
    agent = agent_module.Agent(load_config(write_agent_config(outside_tmp, ingest, command="true")), shipper=shipper)
    agent._ship_lines(io.BytesIO(b"one\ntwo\n"), "stdout")
    assert shipper.lines == ["one", "two"] and shipper.refusals == 0


def test_it_detaches_and_leaves_no_zombie(outside_tmp, ingest):
    config = write_agent_config(outside_tmp, ingest, command="sleep 2; echo done")
    started = time.monotonic()
    result = subprocess.run(agent_command(config, "--detach"), env=agent_env(), timeout=10)
    assert result.returncode == 0
    assert time.monotonic() - started < 1.5  # the caller doesn't wait for the learner
    pid = wait_for(lambda: _read_pid(config))
    assert pid != os.getpid() and os.getppid() != pid
    with open(f"/proc/{pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid()  # not our child
    exit_info = wait_for(lambda: _exit_if_written(config), timeout=15)
    assert exit_info["exit_code"] == 0
    wait_for(lambda: has_status(ingest, "exited"))
    assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["done"]


def test_it_runs_a_learner_once_however_often_it_is_started(outside_tmp, ingest):
    # Deploy may start a second agent before the first has written its pid (reconcile re-drives a
    # deploy; a worker restarts mid-deploy): only one may run the command, and never twice.
    ran = os.path.join(outside_tmp, "job", "results", "ran.txt")
    config = write_agent_config(outside_tmp, ingest, command=f"echo ran >> {ran}; sleep 1")
    first, second = start_agent(config), start_agent(config)
    try:
        assert {first.wait(15), second.wait(15)} == {0}
        assert run_agent(config).returncode == 0  # ended already: exit.json is there
    finally:
        stop_process(first)
        stop_process(second)
    with open(ran) as f:
        assert f.read() == "ran\n"
    records = ingest.stored()
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert [r.get("state") for r in records if r["kind"] == "status"] == ["preparing", "running", "exited"]


def test_it_reports_a_rejected_archive_without_starting_anything(outside_tmp, ingest):
    config = write_agent_config(outside_tmp, ingest, command="touch started", files={"../evil": "x"})
    result = run_agent(config)
    assert result.returncode == 0
    exit_info = read_exit(config)
    assert exit_info["exit_code"] is None
    assert exit_info["reason"].startswith("code archive rejected: archive member '../evil'")
    assert kinds(ingest.stored()) == [("status", "preparing"), ("status", "exited")]
    assert ingest.stored()[-1]["exit_code"] is None
    assert not os.path.exists(os.path.join(os.path.dirname(config), "work"))


def test_it_kills_a_learner_over_its_memory_limit(outside_tmp, ingest):
    command = ("python3 -c \"import time; x = b'x' * (400 * 2**20); print('allocated', flush=True); "
               "time.sleep(30)\"")
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox="auto",
                                memory_bytes=200 * 2**20)
    started = time.monotonic()
    assert run_agent(config).returncode == 0
    assert time.monotonic() - started < 10
    exit_info = read_exit(config)
    assert exit_info == {**exit_info, "exit_code": 137,
                         "reason": "memory limit 200.0MiB exceeded (OOM killed)"}
    assert ingest.stored()[-1]["reason"] == exit_info["reason"]


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_to_the_agent_terminates_the_learner(outside_tmp, ingest, mode):
    command = "trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.1; done"
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox=mode)
    agent = start_agent(config)
    try:
        wait_for(lambda: any(r.get("line") == "ready" for r in ingest.stored()))
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=10) == 0
    finally:
        stop_process(agent)
    assert read_exit(config) == {**read_exit(config), "exit_code": 7, "reason": "terminated"}
    assert "got TERM" in [r.get("line") for r in ingest.stored()]
    assert ingest.stored()[-1]["state"] == "exited"


def test_halt_sends_the_checkpoint_signal_and_waits_for_the_learner(outside_tmp, ingest):
    command = "trap 'echo saving checkpoint; exit 0' USR2; echo ready; while :; do sleep 0.1; done"
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox="auto",
                                checkpoint_signal="SIGUSR2", grace_seconds=10)
    agent = start_agent(config)
    try:
        wait_for(lambda: any(r.get("line") == "ready" for r in ingest.stored()))
        agent.send_signal(signal.SIGUSR1)
        assert agent.wait(timeout=10) == 0
    finally:
        stop_process(agent)
    assert read_exit(config) == {**read_exit(config), "exit_code": 0, "reason": "halted"}
    assert "saving checkpoint" in [r.get("line") for r in ingest.stored()]


PYTHON_CHECKPOINTER = (
    "echo starting; python3 -c \"import signal, sys, time\n"
    "def save(*_):\n    print('checkpoint written', flush=True); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, save)\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)\n\"")


@pytest.mark.parametrize("mode", MODES)
def test_halt_reaches_a_program_the_shell_started_and_not_the_shell(outside_tmp, ingest, mode):
    # The shell would die of SIGTERM at once (taking the sandbox with it) before python saved.
    config = write_agent_config(outside_tmp, ingest, command=PYTHON_CHECKPOINTER, sandbox=mode,
                                checkpoint_signal="SIGTERM", grace_seconds=10)
    agent = start_agent(config)
    try:
        wait_for(lambda: any(r.get("line") == "ready" for r in ingest.stored()))
        agent.send_signal(signal.SIGUSR1)
        assert agent.wait(timeout=15) == 0
    finally:
        stop_process(agent)
    assert read_exit(config)["exit_code"] == 0 and read_exit(config)["reason"] == "halted"
    assert "checkpoint written" in [r.get("line") for r in ingest.stored()]


def test_halt_kills_a_learner_that_outstays_its_grace_period(outside_tmp, ingest):
    command = "trap '' TERM; echo ready; while :; do sleep 0.1; done"
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox="auto", grace_seconds=1)
    agent = start_agent(config)
    try:
        wait_for(lambda: any(r.get("line") == "ready" for r in ingest.stored()))
        started = time.monotonic()
        agent.send_signal(signal.SIGUSR1)
        assert agent.wait(timeout=10) == 0
        assert 1 <= time.monotonic() - started < 5
    finally:
        stop_process(agent)
    assert read_exit(config) == {**read_exit(config), "exit_code": 137,
                                 "reason": "halted: grace period expired, killed"}


def test_it_terminates_the_learner_when_the_platform_answers_410(outside_tmp, ingest):
    command = "trap 'echo got TERM; exit 5' TERM; while :; do echo tick; sleep 0.1; done"
    config = write_agent_config(outside_tmp, ingest, command=command)
    agent = start_agent(config)
    try:
        wait_for(lambda: has_status(ingest, "running"))
        ingest.gone = True
        assert agent.wait(timeout=10) == 0
    finally:
        stop_process(agent)
    exit_info = read_exit(config)
    assert exit_info["exit_code"] == 5 and exit_info["reason"].startswith("terminated")


def test_it_writes_exit_json_first_and_keeps_delivering_until_the_platform_is_back(outside_tmp, ingest):
    ingest.status_override = 503
    config = write_agent_config(outside_tmp, ingest, command="echo hello; exit 1")
    agent = start_agent(config)
    try:
        exit_info = wait_for(lambda: _exit_if_written(config))
        assert exit_info["exit_code"] == 1
        time.sleep(0.5)
        assert agent.poll() is None and ingest.stored() == []  # still trying
        ingest.status_override = None
        assert agent.wait(timeout=15) == 0
    finally:
        stop_process(agent)
    assert kinds(ingest.stored()) == [("status", "preparing"), ("status", "running"), ("log", "stdout"),
                                      ("status", "exited")]


def test_it_refuses_a_bad_config_before_detaching(tmp_path):
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"job_id": "x"}))
    result = subprocess.run(agent_command(str(path), "--detach"), env=agent_env(), capture_output=True,
                            text=True, timeout=10)
    assert result.returncode == 2
    assert "command: required" in result.stderr


def _read_pid(config):
    try:
        with open(os.path.join(os.path.dirname(config), "agent.pid")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _exit_if_written(config):
    try:
        return read_exit(config)
    except (OSError, ValueError):
        return None


def test_it_does_not_wait_for_background_processes_the_command_left_behind(outside_tmp, ingest):
    config = write_agent_config(outside_tmp, ingest, command="(sleep 30; echo late) & echo bye")
    started = time.monotonic()
    assert run_agent(config).returncode == 0
    assert time.monotonic() - started < 5
    assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["bye"]


def test_sigterm_after_the_learner_ended_gives_up_delivery_soon(outside_tmp, ingest):
    ingest.status_override = 503  # the platform is down: the agent would otherwise keep trying
    config = write_agent_config(outside_tmp, ingest, command="exit 0", flush_timeout_s=3600)
    agent = start_agent(config)
    try:
        wait_for(lambda: _exit_if_written(config))
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=10) == 0
    finally:
        stop_process(agent)
    assert read_exit(config)["reason"] == ""  # the learner had ended on its own


@pytest.mark.parametrize("mode", MODES)
def test_an_agent_started_after_a_sigkill_delivers_the_spool_once_and_reports_the_learner_lost(
        outside_tmp, ingest, mode):
    # The platform acks the first records, then nothing (503): the rest sits in the spool when the
    # agent is killed. The learner prints a numbered line every few ms and would run for minutes.
    config = write_agent_config(outside_tmp, ingest, sandbox=mode, command=(
        "python3 -u -c 'import time\nfor i in range(100000):\n print(f\"line {i}\"); time.sleep(0.002)'"))
    agent = start_agent(config)
    try:
        wait_for(lambda: len(ingest.stored()) > 20)
        ingest.status_override = 503
        spool = os.path.join(os.path.dirname(config), "spool")
        time.sleep(1.0)  # a few hundred lines the platform does not ack
        agent.send_signal(signal.SIGKILL)
        agent.wait()
    finally:
        stop_process(agent)
    spooled = _spooled_lines(spool)
    acked_before = len(ingest.stored())
    ingest.status_override = None
    result = run_agent(config)  # the same command again, as a supervisor (or reconcile) would
    assert result.returncode == 0, result.stderr
    records = ingest.stored()
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    lines = [r["line"] for r in records if r["kind"] == "log"]
    assert len(lines) >= spooled > acked_before + 200  # everything spooled, not just what was acked
    assert lines == [f"line {i}" for i in range(len(lines))]  # once each, in order, the same run
    assert records[-1] == {**records[-1], "kind": "status", "state": "exited", "exit_code": 137}
    assert "its learner agent died" in records[-1]["reason"]
    assert [r.get("state") for r in records if r["kind"] == "status"] == ["preparing", "running", "exited"]
    assert read_exit(config)["exit_code"] == 137
    learner = json.load(open(os.path.join(os.path.dirname(config), "learner.pid")))["pid"]
    wait_for(lambda: not os.path.exists(f"/proc/{learner}") or _is_zombie(learner))  # not left running
    assert not os.path.exists(spool)  # delivered: gone
    assert run_agent(config).returncode == 0 and len(ingest.stored()) == len(records)  # and never again


def _spooled_lines(spool):
    try:
        return sum(open(os.path.join(spool, name), "rb").read().count(b'"kind":"log"')
                   for name in os.listdir(spool) if name.endswith(".seg"))
    except FileNotFoundError:
        return 0


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# A learner that waits for the platform's batch change and applies it (learner_agent.batch_changes).
APPLIES_A_BATCH_CHANGE = (
    "python3 -c '\n"
    "import os, time\n"
    "from learner_agent.batch_changes import BatchChanges\n"
    "changes = BatchChanges()\n"
    "deadline = time.monotonic() + 20\n"
    "while (change := changes.poll()) is None and time.monotonic() < deadline:\n"
    "    print(\"waiting\", flush=True); time.sleep(0.2)\n"
    "print(\"control\", os.environ[\"TRAINYARD_BATCH_CONTROL\"], change, flush=True)\n"
    "changes.applied(change, step=7)\n"
    "try:\n"
    "    open(os.environ[\"TRAINYARD_BATCH_CONTROL\"], \"w\")\n"
    "except OSError:\n"
    "    print(\"read-only\", flush=True)\n'"
)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_change_in_the_platforms_answer_reaches_the_learner(outside_tmp, ingest, mode):
    ingest.answer_extra = {"batch": {"id": 12, "global_batch": 256, "local_batch": 128, "lr_scale": 2.0}}
    config = write_agent_config(outside_tmp, ingest, command=APPLIES_A_BATCH_CHANGE, sandbox=mode)
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    records = ingest.stored()
    metrics = [(r["name"], r["value"], r.get("step")) for r in records if r["kind"] == "metric"]
    assert metrics == [("batch_changes", 1.0, None), ("batch_applied", 12.0, 7)]
    lines = [r["line"] for r in records if r["kind"] == "log" and r["stream"] == "stdout"]
    control = next(line for line in lines if line.startswith("control "))
    assert control.endswith("BatchChange(id=12, global_batch=256, local_batch=128, lr_scale=2.0)")
    assert read_exit(config)["exit_code"] == 0
    if mode != "none" and sandbox.bwrap_problem() is None:
        assert "read-only" in lines  # the learner reads the platform's request and cannot rewrite it
