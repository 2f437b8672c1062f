"""The idle-GPU policy on the live platform: on the local backend with two virtual GPUs, a learner that
sleeps while holding its GPU is halted through its checkpoint within the tenant's window plus one
sampling period (and one pass of the idle-GPU check), its GPU goes to the job queued behind it, a
GPUS_IDLE webhook event reaches the tenant's hook; a learner that computes on its GPU is left alone.

A virtual GPU has no counters: the agents load tests/support/virtual_nvml.py in place of NVML
(TRAINYARD_LOCAL_NVML_MODULE), which reads a virtual GPU's utilisation as the CPU its learner uses."""
import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.browser import log_in
from tests.support.harness import start_session
from tests.support.webhook_receiver import Receiver
from trainyard.packing import code_upload

pytestmark = pytest.mark.e2e
WAIT_MS = 60_000

VIRTUAL_NVML = Path(__file__).resolve().parent.parent / "support" / "virtual_nvml.py"
SAMPLE_S, CHECK_S = 1.0, 1.0
WINDOW_MIN = 0.25  # 15 s
# Records reach the platform a moment after they are sampled (the agent's shipper posts them in batches).
SHIPPING_S = 3.0
SLEEPER = """#!/usr/bin/env bash
# Holds its GPU and does nothing with it; checkpoints and stops when halted.
set -euo pipefail
echo 1 > "$CHECKPOINT_DIR/step-0001.txt"
trap 'echo 2 > "$CHECKPOINT_DIR/step-0002.txt"; echo "checkpointed; stopping"; exit 0' TERM
echo "holding GPU ${CUDA_VISIBLE_DEVICES}, sleeping"
while true; do sleep 0.2; done
"""
BUSY = """#!/usr/bin/env bash
echo "computing on GPU ${CUDA_VISIBLE_DEVICES}"
while true; do :; done
"""
WAITER = """#!/usr/bin/env bash
echo "ran on GPU ${CUDA_VISIBLE_DEVICES}"
"""


def manifest(name):
    return (f"name: {name}\ngpus: 1\ncpus: 1\nmemory: 128MiB\n"
            f"framework: {{name: custom, command: bash run.sh}}\n"
            f"checkpoint: {{signal: SIGTERM, grace_seconds: 10}}\n")


@pytest.fixture
def platform(tmp_path):
    session = start_session(tmp_path / "platform", TRAINYARD_LOCAL_GPUS="2", TRAINYARD_LOCAL_CPUS="4",
                            TRAINYARD_RESOURCE_SAMPLE_S=str(SAMPLE_S), TRAINYARD_IDLE_GPU_INTERVAL=str(CHECK_S),
                            TRAINYARD_LOCAL_NVML_MODULE=str(VIRTUAL_NVML), TRAINYARD_RECONCILE_INTERVAL="2",
                            TRAINYARD_WEBHOOK_ALLOW_PRIVATE="true")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def submit(platform, tmp_path, name, script):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "run.sh").write_text(script)
    code = code_upload(str(folder))
    with code.fileobj:
        response = platform.api("POST", "/api/v1/jobs/", files={
            "manifest": ("manifest.yml", manifest(name)), "code": (code.filename, code.fileobj.read())})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def line_time(platform, job_id, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in platform.all_logs(job_id):
            if text in line["line"]:
                return datetime.fromisoformat(line["time"])
        time.sleep(0.2)
    raise AssertionError(f"{job_id} never logged {text!r}")


@pytest.mark.browser
def test_a_sleeping_learner_is_halted_through_its_checkpoint_and_a_busy_one_left_alone(platform, receiver, tmp_path,
                                                                                       browser):
    admin = platform.add_member(platform.tenant, "root", role="admin")
    response = platform.api("PUT", "/api/v1/tenants/current/idle-gpus/", token=admin,
                            json={"below_percent": 20, "minutes": WINDOW_MIN, "action": "halt"})
    assert response.status_code == 200, response.text
    response = platform.api("POST", "/api/v1/webhooks/", token=admin,
                            json={"url": receiver.url, "format": "json", "scope": "tenant", "events": ["GPUS_IDLE"]})
    assert response.status_code == 201, response.text

    sleeper = submit(platform, tmp_path, "sleeper", SLEEPER)
    busy = submit(platform, tmp_path, "busy", BUSY)
    platform.wait_for(sleeper, {"PROCESSING"}, timeout=60)
    platform.wait_for(busy, {"PROCESSING"}, timeout=60)
    waiter = submit(platform, tmp_path, "waiter", WAITER)  # both GPUs are held: it waits for one
    asleep_at = line_time(platform, sleeper, "sleeping")
    line_time(platform, busy, "computing")

    halted = platform.wait_for(sleeper, {"HALTED", "FAILED", "COMPLETED", "TERMINATED"}, timeout=90)
    assert halted["status"] == "HALTED", halted
    # Idle from the first sample after it went to sleep (a sample's own time, the agent's clock, as its log's).
    since = (datetime.fromisoformat(halted["gpus_idle_since"]) - asleep_at).total_seconds()
    assert -SAMPLE_S <= since <= SAMPLE_S + 0.5, since
    events = platform.api("GET", f"/api/v1/jobs/{sleeper}/events/").json()["results"]
    halting = next(e for e in events if e["to_status"] == "HALTING")
    assert halting["actor"] == "idle-gpu-policy" and "idle GPUs below 20%" in halting["reason"], halting
    took = (datetime.fromisoformat(halting["time"]) - asleep_at).total_seconds()
    window = WINDOW_MIN * 60
    # Not before the window, and within it plus one sampling period, one pass and the records' trip.
    print(f"halted {took:.1f} s after it went to sleep (window {window:g} s)")
    assert window - SAMPLE_S <= took <= window + SAMPLE_S + CHECK_S + SHIPPING_S, took
    assert "resume continues from checkpoint step-0002.txt" in next(
        e for e in events if e["to_status"] == "HALTED")["reason"]
    artifacts = platform.api("GET", f"/api/v1/jobs/{sleeper}/artifacts/").json()["results"]
    assert "checkpoints/attempt-1/step-0002.txt" in {a["name"] for a in artifacts}, artifacts

    # Its GPU is free: the job queued behind it runs on it.
    assert platform.wait_for(waiter, timeout=60)["status"] == "COMPLETED"

    deadline = time.monotonic() + 30
    while not receiver.received and time.monotonic() < deadline:
        time.sleep(0.2)
    (headers, body), = receiver.received
    event = json.loads(body)
    assert event["event"] == "GPUS_IDLE" and event["job"]["id"] == sleeper
    assert event["idle"]["action"] == "halt" and event["idle"]["minutes"] == WINDOW_MIN

    working = platform.job(busy)
    assert working["status"] == "PROCESSING" and working["gpus_idle_since"] is None, working
    samples = platform.api("GET", f"/api/v1/jobs/{busy}/resources/").json()["results"]
    assert samples and all(g["utilization"] is not None for s in samples for g in s["gpus"])

    # Flagged where people look: the job's page and the jobs list; the busy job is not.
    page = log_in(browser, platform.url, platform.username, platform.password, timeout_ms=WAIT_MS)
    try:
        listed = page.locator(f"tr:has(a[href='/jobs/{sleeper}/']) [data-testid=gpus-idle]")
        listed.wait_for(state="visible")
        assert page.locator(f"tr:has(a[href='/jobs/{busy}/']) [data-testid=gpus-idle]").count() == 0
        page.goto(f"{platform.url}/jobs/{sleeper}/")
        note = page.locator("[data-testid=gpus-idle]")
        note.wait_for(state="visible")
        assert "GPUs idle since" in note.inner_text() and "below 20% for 0.25 min" in note.inner_text()
        page.goto(f"{platform.url}/jobs/{busy}/")
        page.locator("[data-testid=job-summary]").wait_for(state="visible")
        assert page.locator("[data-testid=gpus-idle]").count() == 0
    finally:
        page.close()
    platform.api("POST", f"/api/v1/jobs/{busy}/terminate/")
