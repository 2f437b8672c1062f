"""An elastic job for real: the local backend with 4 virtual GPUs, a real Celery worker and beat,
examples/pytorch-elastic's learners (DDP over gloo). The job asks to start at 3 learners while 2
GPUs are busy, so it is admitted at 2; when the busy jobs go, the autoscaler grows it onto the idle
GPUs, to 3 or 4 learners (at most twice the largest shape it has measured: which of the two is
worth more depends on the speed it measured on this machine), at the global batch its measured
gradient noise scale makes worth most; a high-priority job of its tenant then needs 2 GPUs, and
admission shrinks the elastic job to 2 (nobody is preempted); it completes. Between the resizes its
batch may also change inside the running learners, as its noise scale moves. Across the three
attempts every training sample is used exactly once per epoch (the example logs each index), the
loss goes on where it was, and the final accuracy is within ACCURACY_TOLERANCE of the same job run
at a fixed size (1 learner, batch 64).
"""
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.elastic_example import ACCURACY_TOLERANCE, FINAL_LINE, STEP_LINE, assert_every_sample_once
from tests.support.harness import EXAMPLES, start_session

pytestmark = pytest.mark.e2e

RESUMABLE = Path(__file__).parent / "jobs" / "resumable"
EXAMPLE = EXAMPLES / "pytorch-elastic"
EPOCHS = 20
# 20 epochs took 4 s of training on one machine and over a minute on another: the steps are paced
# (0.2 s each, ~90 s at 1 learner) so the grow and the shrink land mid-training on any of them.
STEP_DELAY_S = 0.2
ELASTIC = f"""
name: elastic-e2e
learners: 3
gpus: 1
cpus: 1
memory: 1GiB
framework: {{name: pytorch, version: "2.13", command: python train.py --epochs {EPOCHS} --step-delay {STEP_DELAY_S}}}
elastic: {{min_learners: 1, max_learners: 4, batch_size: {{global: 64, min: 32, max: 128}}, lr_scaling: linear}}
checkpoint: {{signal: SIGTERM, grace_seconds: 60}}
"""


def fixed(name, *, gpus=1, priority="normal", steps=1000):
    return (f"name: {name}\ngpus: {gpus}\ncpus: 0.5\nmemory: 128MiB\npriority: {priority}\n"
            f"framework: {{name: custom, command: bash run.sh {steps}}}\n"
            "checkpoint: {signal: SIGTERM, grace_seconds: 10}\n")


@pytest.fixture
def four_gpus(tmp_path):
    # The autoscaler may resize a job once in ten minutes at most here: the one grow this test expects
    # happens once the two busy jobs' GPUs are both idle (5 s after the last is released), and
    # nothing undoes the shrink before the job ends.
    session = start_session(tmp_path, TRAINYARD_LOCAL_GPUS="4", TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_ELASTIC_INTERVAL="2",
                            TRAINYARD_ELASTIC_GROW_SETTLE="5",
                            TRAINYARD_ELASTIC_MIN_INTERVAL="600", TRAINYARD_ELASTIC_HORIZON="600",
                            # alice is a researcher: priority high is for tenant admins unless the platform says otherwise
                            TRAINYARD_HIGH_PRIORITY="everyone")
    try:
        yield session
    finally:
        session.stop()


def fixed_size_run(folder):
    """The same job at a fixed size (1 learner, the manifest's batch), bare: the accuracy reference."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "RESUME_FROM")
           and not key.startswith("TRAINYARD_")}
    env.update(PYTHONPATH=str(EXAMPLES.parent), OMP_NUM_THREADS="1", CHECKPOINT_DIR=str(folder / "checkpoints"),
               RESULT_DIR=str(folder / "results"))
    return subprocess.Popen([sys.executable, "train.py", "--epochs", str(EPOCHS)], cwd=EXAMPLE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_training(session, job_id, attempt, *, timeout=120):
    """Until learner 0 of `attempt` has trained a step (its `samples` report past where it started):
    the next change then lands mid-training, not while the learners still import torch."""
    def trained(job):
        points = session.api("GET", f"/api/v1/jobs/{job_id}/metrics/", params={"name": "samples"}).json()["results"]
        values = [p["value"] for p in points if p["attempt"] == attempt and p["learner"] == 0]
        return len(values) >= 2 and values[-1] > values[0]
    return session.wait_until(job_id, trained, timeout=timeout)


def test_an_elastic_job_starts_small_grows_shrinks_for_its_tenant_and_completes(four_gpus, tmp_path):
    session = four_gpus
    busy = [session.submit(str(RESUMABLE), manifest_text=fixed(f"busy-{i}"))["id"] for i in range(2)]
    for job_id in busy:
        session.wait_for(job_id, {"PROCESSING"}, timeout=60)
    job_id = session.submit("pytorch-elastic", manifest_text=ELASTIC)["id"]
    started = session.wait_for(job_id, {"PROCESSING"}, timeout=90)
    assert started["learners"] == 2 and started["elastic"]["learners"] == 2  # 3 asked, 2 GPUs free
    reference = fixed_size_run(tmp_path / "fixed")  # meanwhile: the busy jobs only sleep
    wait_training(session, job_id, 1)

    for busy_id in busy:  # the GPUs free up: the autoscaler grows the job onto them
        assert session.api("POST", f"/api/v1/jobs/{busy_id}/terminate/").status_code == 202
    grown = session.wait_until(job_id, lambda j: j["attempt"] == 2 and j["status"] == "PROCESSING", timeout=120)
    size = grown["learners"]
    assert size in (3, 4), grown
    wait_training(session, job_id, 2)

    urgent = session.submit(str(RESUMABLE), manifest_text=fixed("urgent", gpus=2, priority="high", steps=5))["id"]
    assert session.wait_for(urgent, timeout=120)["status"] == "COMPLETED"
    done = session.wait_for(job_id, timeout=300)
    assert done["status"] == "COMPLETED", done["status_reason"]
    reference_out, _ = reference.communicate(timeout=120)

    timeline = session.api("GET", f"/api/v1/jobs/{job_id}/allocations/").json()
    timeline = timeline.get("results", timeline)
    # Each attempt's first row; between resizes the batch may also change inside the running learners.
    restarts = [row for row in timeline if row["kind"] != "batch"]
    assert [row["learners"] for row in restarts] == [2, size, 2], timeline
    assert all(row["started_at"] for row in timeline)
    grow, shrink = restarts[1], restarts[2]
    last_of = {row["attempt"]: row for row in timeline}  # the shape each attempt ended at
    # The grow's batch is the optimizer's, from the noise scale the learners reported; the shrink keeps it.
    assert timeline[0]["global_batch"] == 64 and 32 <= grow["global_batch"] <= 128
    assert grow["reason"] == (f"resized 2→{size} learners, batch {last_of[1]['global_batch']}→{grow['global_batch']}: "
                              "idle GPUs")
    assert shrink["reason"] == (f"resized {size}→2 learners, batch {last_of[2]['global_batch']}→"
                                f"{shrink['global_batch']}: making room for job {urgent}")
    assert all(row["resize_cost_s"] > 0 for row in (grow, shrink))
    print(f"\nresize costs (signal -> all learners running): grow {grow['resize_cost_s']:.1f}s, "
          f"shrink {shrink['resize_cost_s']:.1f}s; samples/s by attempt: "
          f"{[row['samples_per_s'] and round(row['samples_per_s']) for row in timeline]}")

    noise = session.api("GET", f"/api/v1/jobs/{job_id}/metrics/", params={"name": "noise_scale"}).json()["results"]
    print(f"(attempt, global batch) by stretch: {[(row['attempt'], row['global_batch']) for row in timeline]}; "
          f"noise scale reported "
          f"(samples): {[round(p['value']) for p in noise]}")
    assert noise and all(p["value"] > 0 for p in noise)

    events = session.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    assert [e["to_status"] for e in events].count("QUEUED") == 1  # submitted; resizes skip the queue
    assert any(e["actor"] == "autoscaler" and e["to_status"] == "HALTING" for e in events)
    assert any(e["actor"] == "scheduler" and e["to_status"] == "HALTING" and urgent in e["reason"] for e in events)
    assert all(session.job(b)["status"] == "TERMINATED" and session.job(b)["attempt"] == 1 for b in busy)

    lines = session.all_logs(job_id)
    attempts = by_attempt(lines)
    assert [world for world, _ in attempts] == [2, size, 2]
    assert_every_sample_once(lines, EPOCHS)
    assert_loss_continues([losses for _, losses in attempts])

    elastic_acc = float(next(m.group(1) for e in lines if (m := FINAL_LINE.search(e["line"]))))
    fixed_acc = float(next(m.group(1) for line in reference_out.splitlines() if (m := FINAL_LINE.search(line))))
    print(f"final val_acc: elastic {elastic_acc:.4f}, fixed size {fixed_acc:.4f}")
    assert fixed_acc > 0.9 and abs(elastic_acc - fixed_acc) <= ACCURACY_TOLERANCE, (elastic_acc, fixed_acc)


def by_attempt(lines):
    """[(world size, [(step, loss)] of learner 0)] per attempt, from learner 0's output in order: the
    attempts of a job run one after the other, and each starts with its "learner 0 of N:" line."""
    attempts = []
    for entry in lines:
        if entry["learner"] != 0:
            continue
        if banner := re.match(r"learner 0 of (\d+): ", entry["line"]):
            attempts.append((int(banner.group(1)), []))
        elif step := STEP_LINE.match(entry["line"]):
            attempts[-1][1].append((int(step.group(1)), float(step.group(3))))
    return attempts


def assert_loss_continues(losses):
    initial = losses[0][0][1]
    for before, after in zip(losses, losses[1:]):
        assert after[0][0] == before[-1][0] + 1  # the step count continues
        resumed = [loss for _, loss in after[:5]]
        stopped = [loss for _, loss in before[-5:]]
        # A resume that lost the model would start again near the initial loss (about ln 10 = 2.3).
        assert max(resumed) < initial / 3, (initial, stopped, resumed)
        # Means over what each attempt logged: an attempt resized early may have logged fewer than 5.
        assert statistics.mean(resumed) < 2 * statistics.mean(stopped) + 0.05, (stopped, resumed)
