"""Batch changes inside a running attempt, for real: the local backend with 4 virtual GPUs, a real
Celery worker, beat and scheduling loop, examples/pytorch-elastic's learners (DDP over gloo).

A fixed job holds 2 GPUs and the elastic job (2 to 4 learners) runs on the other 2; a second fixed
job waits for 2.
When the first ends, the waiting job is admitted in the next cycle, although the elastic job could
have grown onto those GPUs. The elastic job then reports a small gradient noise scale, and later a
large one. Its noise scale is scripted here (`--noise-scale-schedule`), so that what the autoscaler
should decide is known in advance: the estimator itself is tested in learner_agent/tests/test_goodput.py
and by tests/e2e/test_elastic.py, which trains on what the learners measure. While it is small the
job is never given a larger batch; once it is large the job gets one, inside the running learners:
both switch after the same step, the timeline gains a `batch` stretch in the same attempt, nothing
halts or restarts, and every training sample is still used exactly once per epoch.
"""
import re
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.elastic_example import assert_every_sample_once
from tests.support.harness import start_session

pytestmark = pytest.mark.e2e

RESUMABLE = Path(__file__).parent / "jobs" / "resumable"
EPOCHS = 8
LARGE_FROM_STEP = 50  # the scripted noise scale is small before this step, large from it on
SMALL, LARGE = 8, 100_000
ELASTIC = f"""
name: elastic-batch-e2e
learners: 2
gpus: 1
cpus: 1
memory: 1GiB
framework:
  name: pytorch
  version: "2.13"
  command: python train.py --epochs {EPOCHS} --step-delay 0.2 --report-every 5 --noise-scale-schedule 0:{SMALL},{LARGE_FROM_STEP}:{LARGE}
elastic: {{min_learners: 2, max_learners: 4, batch_size: {{global: 64, min: 32, max: 256}}, lr_scaling: linear}}
checkpoint: {{signal: SIGTERM, grace_seconds: 60}}
"""
SWITCH_LINE = re.compile(r"^learner (\d): global batch (\d+) -> (\d+) after step (\d+) ")


def fixed(name, *, steps=1000):
    return (f"name: {name}\ngpus: 2\ncpus: 0.5\nmemory: 128MiB\n"
            f"framework: {{name: custom, command: bash run.sh {steps}}}\n"
            "checkpoint: {signal: SIGTERM, grace_seconds: 10}\n")


@pytest.fixture
def four_gpus(tmp_path):
    session = start_session(tmp_path, TRAINYARD_LOCAL_GPUS="4", TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_ELASTIC_INTERVAL="2",
                            # Resizes (restarts) once in ten minutes at most; batch changes inside the
                            # learners do not wait for that.
                            TRAINYARD_ELASTIC_GROW_SETTLE="0", TRAINYARD_ELASTIC_MIN_INTERVAL="600")
    try:
        yield session
    finally:
        session.stop()


def test_the_batch_follows_the_noise_scale_inside_the_running_attempt(four_gpus):
    session = four_gpus
    busy = session.submit(str(RESUMABLE), manifest_text=fixed("busy"))["id"]
    session.wait_for(busy, {"PROCESSING"}, timeout=60)
    job_id = session.submit("pytorch-elastic", manifest_text=ELASTIC)["id"]
    assert session.wait_for(job_id, {"PROCESSING"}, timeout=90)["learners"] == 2
    waiting = session.submit(str(RESUMABLE), manifest_text=fixed("waiting"))["id"]
    assert session.job(waiting)["status"] == "QUEUED"

    # Capacity appears: the queued job gets it in the next cycle, not the elastic job.
    session.wait_until(job_id, lambda job: samples(session, job_id), timeout=120, poll=0.5)  # it has a measured speed
    freed = time.monotonic()
    assert session.api("POST", f"/api/v1/jobs/{busy}/terminate/").status_code == 202
    session.wait_for(waiting, {"PENDING", "DOWNLOADING", "PROCESSING"}, timeout=30)
    admitted_s = time.monotonic() - freed
    print(f"\nqueued job admitted {admitted_s:.1f}s after the GPUs were freed")
    assert admitted_s < 10

    done = session.wait_for(job_id, timeout=300, poll=0.5)
    assert done["status"] == "COMPLETED", done["status_reason"]
    assert session.api("POST", f"/api/v1/jobs/{waiting}/terminate/").status_code == 202
    assert done["attempt"] == 1  # no resize, no restart
    events = session.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    assert "HALTING" not in [e["to_status"] for e in events]

    timeline = session.api("GET", f"/api/v1/jobs/{job_id}/allocations/").json()["results"]
    print("timeline:", [(r["kind"], r["learners"], r["global_batch"], r["resize_requested_at"], r["reason"])
                        for r in timeline])
    assert {r["attempt"] for r in timeline} == {1} and {r["learners"] for r in timeline} == {2}
    assert timeline[0]["kind"] == "start" and all(r["kind"] == "batch" for r in timeline[1:])
    assert all(r["started_at"] and r["ended_at"] for r in timeline)  # every change asked was applied
    large_since = first_report(session, job_id, "noise_scale", LARGE)
    before = [r for r in timeline[1:] if moment(r["resize_requested_at"]) < large_since]
    after = [r for r in timeline[1:] if moment(r["resize_requested_at"]) >= large_since]
    assert all(r["global_batch"] <= 64 for r in before), before  # a small noise scale: no larger batch
    assert after and after[-1]["global_batch"] > 64, timeline  # a large one: a larger batch, no restart

    lines = session.all_logs(job_id)
    switches = [m.groups() for e in lines if (m := SWITCH_LINE.match(e["line"]))]
    by_learner = {learner: [s[1:] for s in switches if s[0] == learner] for learner in ("0", "1")}
    assert by_learner["0"] == by_learner["1"] and len(by_learner["0"]) == len(timeline) - 1, switches
    assert [int(new) for _, new, _ in by_learner["0"]] == [r["global_batch"] for r in timeline[1:]]
    assert_every_sample_once(lines, EPOCHS)


def samples(session, job_id):
    """Learner 0's `samples` reports of the first attempt, once it has trained two of them."""
    points = session.api("GET", f"/api/v1/jobs/{job_id}/metrics/", params={"name": "samples"}).json()["results"]
    values = [p["value"] for p in points if p["learner"] == 0]
    return len(values) >= 2 and values[-1] > values[0]


def first_report(session, job_id, name, value):
    points = session.api("GET", f"/api/v1/jobs/{job_id}/metrics/", params={"name": name}).json()["results"]
    return min(moment(p["time"]) for p in points if p["value"] == value)


def moment(iso):
    return datetime.fromisoformat(iso)
