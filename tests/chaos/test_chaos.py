"""Chaos: real jobs on the local backend while one part of the platform is SIGKILLed.

Each scenario submits the deterministic workload (invariants.py), and at a moment and for a downtime
that a seeded generator picks, kills one of: the Celery worker, beat, the ASGI server, Redis, the
agent's upstream connection, the agent itself, the learner itself. Then the job must end as it should with its output
stored exactly once (invariants.check_job). Seeds: TRAINYARD_CHAOS_SEEDS (conftest.chaos_seeds).
"""
import os
import random
import signal
import time
from pathlib import Path

import pytest

from learner_agent import procfs
from tests.chaos.invariants import check_job, lines_by_attempt, printed_by, submit

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

# When the blow falls: seconds after submission (covers admission, deploy, the run and storing the
# results: the job takes ~8 s) or after the job reached PROCESSING (while the learner is printing).
AFTER_SUBMIT = ("submitted", 0.0, 8.0)
WHILE_RUNNING = ("processing", 0.5, 5.0)
DOWNTIME = (0.5, 3.0)


class Moment:
    def __init__(self, component, seed, window):
        rng = random.Random(f"{component}:{seed}")
        self.anchor, low, high = window
        self.delay, self.downtime = rng.uniform(low, high), rng.uniform(*DOWNTIME)
        self.context = (f"{component} seed {seed}: killed {self.delay:.2f}s after {self.anchor}, "
                        f"down {self.downtime:.2f}s")

    def wait(self, chaos, job_id, submitted_at):
        if self.anchor == "processing":
            chaos.wait_for(job_id, {"PROCESSING"}, timeout=30)
            time.sleep(self.delay)
        else:
            time.sleep(max(0.0, submitted_at + self.delay - time.monotonic()))


def kill_part_scenario(chaos, part, seed, window):
    moment = Moment(part, seed, window)
    job_id, submitted_at = submit(chaos)
    moment.wait(chaos, job_id, submitted_at)
    chaos.kill(part, downtime=moment.downtime)
    check_job(chaos, job_id, status="COMPLETED", attempts={1: "complete"}, context=moment.context)


def test_the_celery_worker_is_killed(chaos, seed):
    kill_part_scenario(chaos, "worker", seed, AFTER_SUBMIT)


def test_celery_beat_is_killed(chaos, seed):
    kill_part_scenario(chaos, "beat", seed, AFTER_SUBMIT)


def test_the_asgi_server_is_killed(chaos, seed):
    kill_part_scenario(chaos, "web", seed, WHILE_RUNNING)


@pytest.mark.embedded_smoke
def test_redis_is_killed(chaos, seed):
    if not chaos.platform.embedded_redis:
        # Not skip_or_fail(): CI runs this scenario in its embedded pass (-m embedded_smoke).
        pytest.skip("REDIS_URL names this machine's Redis, which the suite must not kill; the Redis "
                    "scenario runs on the embedded Redis (make test without REDIS_URL, CI's embedded pass)")
    kill_part_scenario(chaos, "redis", seed, AFTER_SUBMIT)


def test_the_agents_upstream_connection_is_cut(chaos, seed):
    moment = Moment("upstream", seed, WHILE_RUNNING)
    connections = chaos.proxy.connections
    job_id, submitted_at = submit(chaos)
    moment.wait(chaos, job_id, submitted_at)
    chaos.proxy.cut(moment.downtime)
    time.sleep(moment.downtime)
    check_job(chaos, job_id, status="COMPLETED", attempts={1: "complete"}, context=moment.context)
    assert chaos.proxy.connections > connections, "the agent did not post through the proxy"


def test_the_learner_is_killed_and_the_job_fails_saying_so(chaos, seed):
    moment = Moment("learner", seed, WHILE_RUNNING)
    job_id, submitted_at = submit(chaos)
    moment.wait(chaos, job_id, submitted_at)
    os.kill(learner_pid(chaos, job_id, attempt=1), signal.SIGKILL)
    job = check_job(chaos, job_id, status="FAILED", attempts={1: "killed"}, context=moment.context)
    assert job["exit_code"] == 137
    assert job["status_reason"].startswith("learner 0 exited with code 137"), job["status_reason"]


def test_the_learner_is_killed_and_restarts_as_the_next_attempt(chaos, seed):
    moment = Moment("learner-retry", seed, WHILE_RUNNING)
    job_id, submitted_at = submit(chaos, max_retries=1)
    moment.wait(chaos, job_id, submitted_at)
    os.kill(learner_pid(chaos, job_id, attempt=1), signal.SIGKILL)
    job = check_job(chaos, job_id, status="COMPLETED", attempts={1: "killed", 2: "complete"},
                    context=moment.context)
    assert job["retries"] == 1


def learner_pid(chaos, job_id, *, attempt, timeout=10):
    """The user's python, found under the learner's agent (inside the sandbox, if there is one)."""
    agent_pid_file = next(chaos.session.data_dir.glob(f"storage/*/{job_id}/attempt-{attempt}/learner-0/agent.pid"))
    agent = int(Path(agent_pid_file).read_text())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in procfs.descendants(agent):
            argv = procfs.argv(pid)
            if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") and argv[1] == "chatter.py":
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no learner process under agent {agent} of {job_id}")


# Early enough that the learner is still printing when it is frozen (it runs ~6 s).
AGENT_KILLED = ("processing", 0.3, 2.0)


def test_the_agent_is_killed_and_a_second_one_delivers_its_spool_exactly_once(chaos, seed):
    """The agent SIGKILLed while the platform had not acked the learner's latest lines (its link is
    cut). The learner dies with it; the platform starts a second agent, which delivers what the first
    spooled, exactly once, and reports the learner killed (137); the job's retry runs attempt 2.

    To know exactly what the learner wrote, it is frozen (SIGSTOP) before the kill and the bytes it
    wrote are read from /proc/<pid>/io; the agent gets half a second to read its pipe dry."""
    moment = Moment("agent", seed, AGENT_KILLED)
    job_id, submitted_at = submit(chaos, max_retries=1)
    moment.wait(chaos, job_id, submitted_at)
    learner = learner_pid(chaos, job_id, attempt=1)
    agent_folder = next(chaos.session.data_dir.glob(f"storage/*/{job_id}/attempt-1/learner-0"))
    agent = int((agent_folder / "agent.pid").read_text())
    chaos.proxy.cut(60)  # nothing the agent sends now is acked
    time.sleep(min(moment.downtime, 1.5))
    os.kill(learner, signal.SIGSTOP)
    time.sleep(0.5)
    written = bytes_written(learner)
    os.kill(agent, signal.SIGKILL)
    chaos.proxy.cut(0)  # the link is back; the dead agent's records are only in its spool now
    job = check_job(chaos, job_id, status="COMPLETED", attempts={1: "killed", 2: "complete"},
                    context=moment.context)
    assert job["retries"] == 1
    first = [x["line"] for x in lines_by_attempt(chaos.session.all_logs(job_id))[1]]
    assert first == lines_within(printed_by(1), written), (
        f"{moment.context}: attempt 1 stored {len(first)} lines; the learner wrote {written} bytes, "
        f"{len(lines_within(printed_by(1), written))} whole lines")
    assert (agent_folder / "agent.restarted").exists(), "the platform did not start a second agent"


def bytes_written(pid):
    """What the process has written so far (all of it to its stdout, for chatter.py)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar in /proc/{pid}/io")


def lines_within(printed, written):
    """The lines of `printed` wholly inside its first `written` bytes."""
    lines, used = [], 0
    for line, _ in printed:
        used += len(line.encode()) + 1
        if used > written:
            break
        lines.append(line)
    return lines
