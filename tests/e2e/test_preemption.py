"""Preemption for real: on the local backend with 4 virtual GPUs, a high-priority job submitted
while four 1-GPU low-priority jobs run makes one of them halt through its checkpoint; the high job
runs, and the halted job resumes from its checkpoint and completes."""
import re
from pathlib import Path

import pytest

from tests.support.harness import start_session

pytestmark = pytest.mark.e2e

RESUMABLE = Path(__file__).parent / "jobs" / "resumable"


def manifest(name, priority, steps):
    return (f"name: {name}\ngpus: 1\ncpus: 0.5\nmemory: 128MiB\npriority: {priority}\n"
            f"framework: {{name: custom, command: bash run.sh {steps}}}\n"
            f"checkpoint: {{signal: SIGTERM, grace_seconds: 10}}\n")


@pytest.fixture
def four_gpus(tmp_path):
    # alice is a researcher: priority high is for tenant admins unless the platform says otherwise
    session = start_session(tmp_path, TRAINYARD_LOCAL_GPUS="4", TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_HIGH_PRIORITY="everyone")
    try:
        yield session
    finally:
        session.stop()


def test_a_high_priority_job_preempts_one_low_job_which_resumes_later(four_gpus):
    session = four_gpus
    low = [session.submit(str(RESUMABLE), manifest_text=manifest(f"low-{i}", "low", 40))["id"] for i in range(4)]
    for job_id in low:
        session.wait_for(job_id, {"PROCESSING"}, timeout=60)
        # Its first step logged, so its script's SIGTERM trap is set and a halt leaves a checkpoint. A
        # learner halted before that has none to resume from (the platform says so): not this test.
        session.wait_until(job_id, lambda _, job_id=job_id: any(
            x["line"].startswith("step 1/") for x in session.all_logs(job_id)), timeout=60)
    high = session.submit(str(RESUMABLE), manifest_text=manifest("urgent", "high", 3))["id"]

    assert session.wait_for(high, timeout=120)["status"] == "COMPLETED"
    finished = {job_id: session.wait_for(job_id, timeout=180) for job_id in low}
    assert all(job["status"] == "COMPLETED" for job in finished.values())

    preempted = [job_id for job_id, job in finished.items() if job["attempt"] == 2]
    assert len(preempted) == 1, {job_id: job["attempt"] for job_id, job in finished.items()}
    victim = preempted[0]
    events = session.api("GET", f"/api/v1/jobs/{victim}/events/").json()["results"]
    path = [(e["to_status"], e["actor"]) for e in events]
    assert ("HALTING", "scheduler") in path and ("QUEUED", "scheduler") in path
    halting = next(e for e in events if e["to_status"] == "HALTING")
    assert halting["reason"].startswith("preempted:") and high in halting["reason"]
    halted = next(e for e in events if e["to_status"] == "HALTED")
    assert "resume continues from checkpoint" in halted["reason"]

    lines = [x["line"] for x in session.all_logs(victim)]
    stopped_at = int(re.search(r"checkpointed at step (\d+)", "\n".join(lines)).group(1))
    assert f"resuming from step {stopped_at} (step-{stopped_at:04d}.txt)" in lines
    assert lines[-1] == "finished 40 steps"
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/40", line))]
    assert steps == list(range(1, 41))  # the second attempt continued where the first stopped: nothing redone
