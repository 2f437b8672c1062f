"""The spine, end to end: real web server, Celery worker, beat, Redis and learner processes."""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.support.harness import EXAMPLES

pytestmark = pytest.mark.e2e

LINES_100K = """
name: hundred-thousand-lines
cpus: 1
memory: 1GiB
framework: {name: custom, command: "python3 -c \\"import sys\\nfor i in range(1, 100001): print(f'line {i}')\\""}
"""

SLEEPER = """
name: sleeper
cpus: 1
memory: 1GiB
framework: {name: custom, command: "echo started; sleep 600"}
"""


@pytest.mark.embedded_smoke
def test_it_trains_the_pytorch_example_through_the_cli(live_platform):
    folder = EXAMPLES / "pytorch-digits"
    result = live_platform.cli("train", str(folder / "manifest.yml"), str(folder), "--follow", timeout=300)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[0]
    assert job_id.startswith("training-")
    assert "val_acc" in result.stdout  # the training log was streamed

    shown = json.loads(live_platform.cli("show", job_id, "--json").stdout)
    assert shown["status"] == "COMPLETED" and shown["exit_code"] == 0
    assert shown["latest_metrics"]["train.val_acc"]["value"] > 0.8
    assert shown["latest_metrics"]["train.loss"]["step"] == 8

    events = live_platform.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    assert [e["to_status"] for e in events] == ["QUEUED", "PENDING", "DOWNLOADING", "PROCESSING", "STORING",
                                                "COMPLETED"]
    artifacts = {a["name"]: a for a in live_platform.api("GET", f"/api/v1/jobs/{job_id}/artifacts/").json()["results"]}
    checkpoint = artifacts["checkpoints/attempt-1/epoch-8.pt"]
    assert checkpoint["kind"] == "checkpoint" and checkpoint["complete"] is True
    assert "checkpoints/attempt-1/epoch-1.pt" not in artifacts  # retention keeps the newest 5
    assert "results/model.pt" in artifacts and "logs/training.log" in artifacts
    download = live_platform.api("GET", artifacts["results/model.pt"]["url"])
    assert download.status_code == 200 and len(download.content) == artifacts["results/model.pt"]["size"]


@pytest.mark.embedded_smoke
def test_a_failing_command_ends_failed_with_its_exit_code_and_last_lines(live_platform):
    job = live_platform.submit("failing")
    done = live_platform.wait_for(job["id"])
    assert done["status"] == "FAILED"
    assert done["exit_code"] == 3
    assert "exited with code 3" in done["status_reason"]
    lines = [x["line"] for x in live_platform.all_logs(job["id"])]
    assert lines and lines[-1] in done["status_reason"]


def test_it_loses_no_line_of_a_hundred_thousand(live_platform):
    job = live_platform.submit("custom-shell", manifest_text=LINES_100K)
    done = live_platform.wait_for(job["id"], timeout=300)
    assert done["status"] == "COMPLETED", done["status_reason"]
    lines = live_platform.all_logs(job["id"])
    assert len(lines) == 100_000
    assert [x["seq"] for x in lines] == list(range(1, 100_001))
    assert lines[0]["line"] == "line 1" and lines[-1]["line"] == "line 100000"
    assert len({x["line"] for x in lines}) == 100_000


def test_terminate_stops_a_running_job_for_good(live_platform):
    job = live_platform.submit("custom-shell", manifest_text=SLEEPER)
    live_platform.wait_for(job["id"], {"PROCESSING"}, timeout=60)
    response = live_platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/")
    assert response.status_code == 202
    assert live_platform.wait_for(job["id"], timeout=10)["status"] == "TERMINATED"
    learner_dir = next(live_platform.data_dir.glob(f"storage/*/{job['id']}/attempt-1/learner-0"))
    deadline = time.monotonic() + 20
    while not (learner_dir / "exit.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert json.loads((learner_dir / "exit.json").read_text())["reason"].startswith("terminated")
    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/").status_code == 409
    # nothing the job started survives (the agent itself exits right after writing exit.json)
    job_dir = learner_dir.parent.parent
    while processes_inside(job_dir) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    assert processes_inside(job_dir) == []


def processes_inside(folder):
    """Pids whose command line or working directory lies in `folder`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(str(folder)) or str(folder) in cmdline:
            found.append(int(proc.name))
    return found


STUBBORN = """
name: stubborn
cpus: 1
memory: 512MiB
checkpoint: {signal: SIGTERM, grace_seconds: 2}
framework:
  name: custom
  command: |
    python3 -c "import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print('ignoring SIGTERM', flush=True)
    time.sleep(600)"
"""


def test_a_learner_that_ignores_halt_is_killed_after_the_grace_period(live_platform):
    job = live_platform.submit("custom-shell", manifest_text=STUBBORN)
    live_platform.wait_for(job["id"], {"PROCESSING"}, timeout=60)
    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/halt/").status_code == 202
    halted = live_platform.wait_for(job["id"], {"HALTED", "FAILED"}, timeout=30)
    assert halted["status"] == "HALTED"
    assert "no checkpoint was written" in halted["status_reason"]
    assert "ignored the signal and was killed" in halted["status_reason"]


def test_bad_manifest_is_refused_and_nothing_is_stored(live_platform):
    before = live_platform.api("GET", "/api/v1/jobs/").json()["count"]
    manifest = (EXAMPLES / "custom-shell" / "manifest.yml").read_text()
    assert "memory: 256MiB" in manifest
    broken = manifest.replace("memory: 256MiB", "memory: 12 bananas")
    response = live_platform.api("POST", "/api/v1/jobs/", files={"manifest": ("m.yml", broken),
                                                                 "code": ("c.tar.gz", b"")})
    assert response.status_code == 400 and response.json()["field"] == "memory"
    assert live_platform.api("GET", "/api/v1/jobs/").json()["count"] == before


def test_halt_checkpoints_and_resume_continues_from_it(live_platform):
    manifest = (EXAMPLES / "pytorch-digits" / "manifest.yml").read_text().replace("--epochs 8", "--epochs 40")
    job = live_platform.submit("pytorch-digits", manifest_text=manifest)
    deadline = time.monotonic() + 120
    while not live_platform.job(job["id"])["latest_metrics"].get("train.loss") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/halt/").status_code == 202
    halted = live_platform.wait_for(job["id"], {"HALTED", "FAILED", "COMPLETED"}, timeout=60)
    assert halted["status"] == "HALTED", halted["status_reason"]
    assert "resume continues from checkpoint" in halted["status_reason"]
    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/halt/").status_code == 409

    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/resume/").status_code == 202
    done = live_platform.wait_for(job["id"], timeout=300)
    assert done["status"] == "COMPLETED" and done["attempt"] == 2, done["status_reason"]
    lines = [x["line"] for x in live_platform.all_logs(job["id"])]
    resumed_at = next(i for i, line in enumerate(lines) if line.startswith("resuming from"))
    epochs = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("epoch ")]
    before = [int(line.split()[1].split("/")[0]) for line in lines[:resumed_at] if line.startswith("epoch ")]
    after = epochs[len(before):]
    # the epoch counter continues from the checkpoint instead of starting again at 1
    assert after[0] in (before[-1], before[-1] + 1) and after[-1] == 40
    assert "attempt-1" in lines[resumed_at]
    statuses = [e["to_status"] for e in live_platform.api("GET", f"/api/v1/jobs/{job['id']}/events/").json()["results"]]
    assert statuses[statuses.index("HALTING"):] == ["HALTING", "STORING", "HALTED", "QUEUED", "PENDING", "DOWNLOADING",
                                                    "PROCESSING", "STORING", "COMPLETED"]


def test_reconcile_fails_a_job_whose_learner_vanished(live_platform):
    job = live_platform.submit("custom-shell", manifest_text=SLEEPER)
    live_platform.wait_for(job["id"], {"PROCESSING"}, timeout=60)
    learner_dir = next(live_platform.data_dir.glob(f"storage/*/{job['id']}/attempt-1/learner-0"))
    shutil.rmtree(learner_dir / "spool")  # nothing a second agent could take over from
    os.kill(int((learner_dir / "agent.pid").read_text()), signal.SIGKILL)  # no report can follow
    done = live_platform.wait_for(job["id"], timeout=30)
    assert done["status"] == "FAILED"
    assert "learner 0 was lost" in done["status_reason"]


def test_a_second_agent_reports_the_learner_of_one_that_was_killed(live_platform):
    job = live_platform.submit("custom-shell", manifest_text=SLEEPER)
    live_platform.wait_for(job["id"], {"PROCESSING"}, timeout=60)
    learner_dir = next(live_platform.data_dir.glob(f"storage/*/{job['id']}/attempt-1/learner-0"))
    os.kill(int((learner_dir / "agent.pid").read_text()), signal.SIGKILL)
    done = live_platform.wait_for(job["id"], timeout=30)
    assert done["status"] == "FAILED" and done["exit_code"] == 137
    assert done["status_reason"].startswith(
        "learner 0 exited with code 137 (killed: its learner agent died while it ran"), done["status_reason"]
    assert (learner_dir / "agent.restarted").exists()


CRASH_ONCE = """
name: crash-once
cpus: 1
memory: 512MiB
restart_policy: {max_retries: 2}
framework:
  name: custom
  command: 'echo attempt $TRAINYARD_ATTEMPT; if [ "$TRAINYARD_ATTEMPT" = 1 ]; then exit 5; fi'
"""


def test_a_crashed_learner_with_retries_left_restarts_as_the_next_attempt(live_platform):
    job = live_platform.submit("custom-shell", manifest_text=CRASH_ONCE)
    done = live_platform.wait_for(job["id"], timeout=90)
    assert (done["status"], done["attempt"], done["retries"]) == ("COMPLETED", 2, 1), done["status_reason"]
    events = live_platform.api("GET", f"/api/v1/jobs/{job['id']}/events/").json()["results"]
    restart = next(e for e in events if e["to_status"] == "QUEUED" and e["from_status"])
    assert restart["reason"].startswith("restart 1 of 2") and "exited with code 5" in restart["reason"]
    assert [x["line"] for x in live_platform.all_logs(job["id"])] == ["attempt 1", "attempt 2"]


def test_a_learner_that_keeps_crashing_fails_once_retries_run_out(live_platform):
    always = CRASH_ONCE.replace('[ "$TRAINYARD_ATTEMPT" = 1 ]', "true").replace("max_retries: 2", "max_retries: 1")
    job = live_platform.submit("custom-shell", manifest_text=always)
    done = live_platform.wait_for(job["id"], timeout=90)
    assert (done["status"], done["attempt"], done["exit_code"]) == ("FAILED", 2, 5)
