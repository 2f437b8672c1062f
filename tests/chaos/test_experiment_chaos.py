"""Chaos for experiments (jobs.experiments): an ASHA search runs while the Celery worker, the web
server, beat and the scheduling loop are each SIGKILLed once at seeded moments and started again. It
completes with every trial accounted for once: trial numbers 0..n-1, one job each and no job of the
experiment without a trial, every trial ended (completed, or stopped after a pause at a rung), each
rung's pause decided at most once per trial, and the best trial fully trained."""
import json
import random
import time
from pathlib import Path

import pytest
import yaml

from trainyard.packing import code_upload

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]
CODE = Path(__file__).parent / "experiment"
TRIALS, STEPS = 9, 9
EXPERIMENT = {
    "name": "chaos-sweep", "cpus": 0.5, "memory": "256MiB",
    "framework": {"name": "custom", "command": f"python3 train.py {{{{hparams.lr}}}} {STEPS}"},
    "checkpoint": {"signal": "SIGTERM", "grace_seconds": 10},
    "hyperparameters": {"lr": {"type": "log", "minval": 0.0001, "maxval": 1.0}},
    "searcher": {"name": "asha", "metric": "score", "max_trials": TRIALS, "max_concurrent_trials": 3,
                 "max_length": STEPS, "divisor": 3},
}
KILLED = ("worker", "web", "beat", "scheduler")


def create(chaos, seed):
    spec = dict(EXPERIMENT, searcher=dict(EXPERIMENT["searcher"], seed=seed))
    code = code_upload(str(CODE))
    with code.fileobj:
        files = {"manifest": ("experiment.yml", yaml.safe_dump(spec)), "code": (code.filename, code.fileobj.read())}
    response = chaos.api("POST", "/api/v1/experiments/", files=files)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def experiment(chaos, experiment_id):
    return chaos.api("GET", f"/api/v1/experiments/{experiment_id}/").json()


def test_an_asha_experiment_survives_its_platform_being_killed(chaos, seed):
    rng = random.Random(f"experiment:{seed}")
    experiment_id = create(chaos, seed)
    for part in rng.sample(KILLED, len(KILLED)):
        time.sleep(rng.uniform(0.5, 4.0))
        chaos.kill(part, downtime=rng.uniform(0.2, 2.0))
    deadline = time.monotonic() + 300
    while (shown := experiment(chaos, experiment_id))["state"] not in ("COMPLETED", "TERMINATED"):
        assert time.monotonic() < deadline, f"seed {seed}: experiment still {shown['state']}: {json.dumps(shown)[:2000]}"
        time.sleep(1)
    context = f"seed {seed}"
    assert shown["state"] == "COMPLETED", f"{context}: {shown['state_reason']}"
    trials = shown["trials"]
    assert [t["number"] for t in trials] == list(range(TRIALS)), f"{context}: trials {[t['number'] for t in trials]}"
    job_ids = [t["job_id"] for t in trials]
    assert len(set(job_ids)) == TRIALS
    named = [j for j in chaos.api("GET", "/api/v1/jobs/", params={"limit": 200}).json()["results"]
             if j["name"].startswith("chaos-sweep-trial-")]
    mine = {j["id"] for j in named if j["id"] in job_ids}
    assert mine == set(job_ids) and len({j["name"] for j in named if j["id"] in mine}) == TRIALS, (
        f"{context}: a trial job started twice or without its trial")
    for trial in trials:
        assert trial["state"] in ("completed", "stopped"), f"{context}: trial {trial['number']} ended {trial['state']}"
        events = chaos.api("GET", f"/api/v1/jobs/{trial['job_id']}/events/").json()["results"]
        pauses = [e["reason"].split(" (")[0] for e in events if e["reason"].startswith("paused at rung")]
        assert len(pauses) == len(set(pauses)), f"{context}: trial {trial['number']} paused twice at one rung: {pauses}"
        expected = "COMPLETED" if trial["state"] == "completed" else "TERMINATED"
        assert trial["job_status"] == expected, f"{context}: trial {trial['number']} {trial['state']} / {trial['job_status']}"
    best = trials[shown["best_trial"]]
    assert best["state"] == "completed" and best["step"] == STEPS
    assert len([t for t in trials if t["state"] == "completed"]) < TRIALS  # ASHA stopped some early
