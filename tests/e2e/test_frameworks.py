"""Every framework's example, distributed learners and data stores, through the real platform.

Each job trains for a few seconds: CI runs these on 2 cores. The S3 tests run an S3-compatible
server in this process (moto's server mode) with real access-key checking.
"""
import importlib.util
import io
import json
import re
import time
from pathlib import Path

import pytest

from tests.support.optional import skip_or_fail
from tests.support.submitting import manifest_with_command, metrics_of, submit_folder

pytestmark = pytest.mark.e2e

# example, manifest override (shorter runs), the metric it charts, a checkpoint it writes, a needed module
FRAMEWORK_EXAMPLES = [
    ("sklearn-digits", None, "train.val_acc", "checkpoints/attempt-1/epoch-10.pkl", "sklearn"),
    ("jax-regression", None, "mse", "checkpoints/attempt-1/step-500.npz", "jax"),
    ("keras-digits", "python train.py --epochs 3", "train.val_acc", "checkpoints/attempt-1/epoch-3.keras",
     "tensorflow"),
    ("custom-shell", None, "loss", None, None),
]


def artifacts_of(platform, job_id):
    return {a["name"]: a for a in platform.api("GET", f"/api/v1/jobs/{job_id}/artifacts/").json()["results"]}


@pytest.mark.parametrize("example, command, metric, checkpoint, module", FRAMEWORK_EXAMPLES,
                         ids=[e[0] for e in FRAMEWORK_EXAMPLES])
def test_each_framework_example_runs_to_completed_with_metrics_and_checkpoints(
        live_platform, example, command, metric, checkpoint, module):
    if module and importlib.util.find_spec(module) is None:
        skip_or_fail(f"{module} is not installed (pip install -e '.[frameworks]')")
    job = live_platform.submit(example, manifest_text=manifest_with_command(example, command))
    done = live_platform.wait_for(job["id"], timeout=240)
    assert done["status"] == "COMPLETED", done["status_reason"]
    points = [p for p in metrics_of(live_platform, job["id"]) if p["name"] == metric]
    assert len(points) >= 2, f"{metric} was not charted"
    artifacts = artifacts_of(live_platform, job["id"])
    if checkpoint:
        assert artifacts[checkpoint]["complete"] is True
    assert any(name.startswith("results/") for name in artifacts), sorted(artifacts)


DDP = manifest_with_command("pytorch-ddp", "python train.py --epochs 3")


def test_two_pytorch_learners_train_one_model_with_a_synchronised_loss(live_platform):
    job = live_platform.submit("pytorch-ddp", manifest_text=DDP)
    done = live_platform.wait_for(job["id"], timeout=240)
    assert done["status"] == "COMPLETED", done["status_reason"]
    lines = live_platform.all_logs(job["id"])
    epochs = {0: [], 1: []}
    for line in lines:
        match = re.match(r"epoch (\d+)/\d+ loss ([\d.]+) val_acc ([\d.]+) \(learner (\d) of 2\)", line["line"])
        if match:
            assert int(match.group(4)) == line["learner"]  # each learner's lines are tagged as its own
            epochs[line["learner"]].append(match.group(1, 2, 3))
    assert len(epochs[0]) == 3 and epochs[0] == epochs[1]  # the all-reduced loss: the same on both
    losses = {}
    for point in metrics_of(live_platform, job["id"]):
        if point["name"] == "train.loss":
            losses.setdefault(point["learner"], []).append(point["value"])
    assert sorted(losses) == [0, 1] and losses[0] == losses[1]
    assert "checkpoints/attempt-1/epoch-3.pt" in artifacts_of(live_platform, job["id"])


def test_a_two_learner_job_is_halted_and_resumed_as_one(live_platform):
    job = live_platform.submit("pytorch-ddp", manifest_text=manifest_with_command(
        "pytorch-ddp", "python train.py --epochs 60"))
    deadline = time.monotonic() + 180
    while not any(line["line"].startswith("epoch 1/") for line in live_platform.all_logs(job["id"])):
        assert time.monotonic() < deadline, live_platform.job(job["id"])
        time.sleep(0.2)
    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/halt/").status_code == 202
    halted = live_platform.wait_for(job["id"], {"HALTED", "FAILED", "COMPLETED"}, timeout=90)
    assert halted["status"] == "HALTED", halted["status_reason"]
    assert "resume continues from checkpoint" in halted["status_reason"]
    stopped = [line for line in live_platform.all_logs(job["id"]) if "stop requested" in line["line"]]
    assert sorted(line["learner"] for line in stopped) == [0, 1]
    assert len({re.search(r"(epoch \d+|step \d+)", line["line"]).group(1) for line in stopped}) == 1

    assert live_platform.api("POST", f"/api/v1/jobs/{job['id']}/resume/").status_code == 202
    done = live_platform.wait_for(job["id"], timeout=300)
    assert done["status"] == "COMPLETED" and done["attempt"] == 2, done["status_reason"]
    resumed = [line for line in live_platform.all_logs(job["id"]) if "resuming from" in line["line"]]
    assert sorted(line["learner"] for line in resumed) == [0, 1]
    assert all("attempt-1" in line["line"] for line in resumed)


PARTNERS = """
name: partners
learners: 2
cpus: 0.5
memory: 512MiB
framework:
  name: custom
  command: python probe.py {platform_port}
"""

PROBE = r'''
import os, socket, sys, time
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
def reach(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "reached"
    except OSError as e:
        return type(e).__name__
if rank == 0:
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(60)
    conn, _ = server.accept()
    print("learner 0 heard:", conn.recv(100).decode(), flush=True)
else:
    for _ in range(600):
        try:
            conn = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    conn.sendall(b"hello from learner 1")
print(f"learner {rank}: platform", reach("127.0.0.1", int(sys.argv[1])), flush=True)
'''


def test_the_learners_of_one_job_reach_each_other_and_nothing_else(live_platform, tmp_path):
    code = tmp_path / "partners"
    code.mkdir()
    (code / "probe.py").write_text(PROBE)
    (code / "manifest.yml").write_text("")
    port = int(live_platform.url.rsplit(":", 1)[1].strip("/"))
    job = submit_folder(live_platform, code, PARTNERS.format(platform_port=port))
    done = live_platform.wait_for(job["id"], timeout=120)
    assert done["status"] == "COMPLETED", done["status_reason"]
    lines = [line["line"] for line in live_platform.all_logs(job["id"])]
    assert "learner 0 heard: hello from learner 1" in lines
    if any(line.endswith("platform reached") for line in lines):
        skip_or_fail("learners share the host network here (no network namespace: not root?)")
    assert sum(line.endswith("platform ConnectionRefusedError") for line in lines) == 2, lines


GANG = """
name: gang
learners: 2
cpus: 0.5
memory: 256MiB
framework:
  name: custom
  command: 'if [ "$RANK" = 1 ]; then echo learner 1 gives up; sleep 1; exit 7; fi; echo learner 0 waits; sleep 600'
"""


def test_one_failed_learner_fails_the_attempt_and_stops_the_others(live_platform):
    started = time.monotonic()
    job = live_platform.submit("custom-shell", manifest_text=GANG)
    done = live_platform.wait_for(job["id"], timeout=90)
    assert done["status"] == "FAILED"
    assert done["status_reason"].startswith("learner 1 exited with code 7"), done["status_reason"]
    assert time.monotonic() - started < 60  # learner 0 was stopped, not waited for (sleep 600)


# --- data stores ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_server():
    """An S3-compatible server with access-key checking; yields (endpoint, key id, secret)."""
    pytest.importorskip("boto3")
    from tests.support.s3_server import s3_server
    with s3_server({"train-data": {"digits/digits.npz": digits_npz()}, "train-results": {}}) as server:
        yield server


def digits_npz():
    import numpy as np
    from sklearn.datasets import load_digits
    digits = load_digits()
    buffer = io.BytesIO()
    np.savez(buffer, x=digits.images.reshape(-1, 64) / 16.0, y=digits.target)
    return buffer.getvalue()


S3_JOB = """
name: sklearn-from-s3
cpus: 1
memory: 1GiB
framework: {{name: sklearn, command: python train.py --epochs 4}}
data_stores:
  - id: lake
    type: {kind}
    training_data: {{container: train-data/digits}}
    training_results: {{container: train-results}}
    connection:
      auth_url: {endpoint}
      user_name: {key}
      password: {secret}  # the secret: never stored in clear, shown back or logged
"""


def test_s3_round_trip_data_in_results_and_checkpoints_out(live_platform, s3_server):
    import boto3
    endpoint, key, secret = s3_server
    job = live_platform.submit("sklearn-digits", manifest_text=S3_JOB.format(kind="mount_cos", endpoint=endpoint,
                                                                             key=key, secret=secret))
    detail = live_platform.job(job["id"])
    assert secret not in json.dumps(detail) and key not in json.dumps(detail)
    assert "<redacted>" in detail["manifest_yaml"] and "never stored in clear" in detail["manifest_yaml"]
    done = live_platform.wait_for(job["id"], timeout=180)
    assert done["status"] == "COMPLETED", done["status_reason"]
    events = [e["to_status"] for e in live_platform.api("GET", f"/api/v1/jobs/{job['id']}/events/").json()["results"]]
    assert events[:3] == ["QUEUED", "PENDING", "DOWNLOADING"]
    lines = [line["line"] for line in live_platform.all_logs(job["id"])]
    assert any(line.startswith("[trainyard] downloading from data store 'lake'") and "1/1 files" in line
               for line in lines), lines
    assert any(re.match(r"data: .*/digits\.npz \(1797 samples\)", line) for line in lines), lines
    assert not any(secret in line for line in lines)

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key,
                      aws_secret_access_key=secret)
    stored = {o["Key"] for o in s3.list_objects_v2(Bucket="train-results", Prefix=job["id"])["Contents"]}
    assert f"{job['id']}/results/model.pkl" in stored
    assert f"{job['id']}/checkpoints/attempt-1/epoch-4.pkl" in stored
    assert f"{job['id']}/logs/training.log" in stored
    assert credentials_deleted(live_platform, job["id"])  # when the job ended
    for path in live_platform.platform.log_dir.glob("*"):
        assert secret not in path.read_text(errors="replace"), path


def test_wrong_s3_credentials_fail_the_job_at_downloading_with_the_reason(live_platform, s3_server):
    endpoint, key, _ = s3_server
    started = time.monotonic()
    job = live_platform.submit("sklearn-digits", manifest_text=S3_JOB.format(kind="s3_datastore", endpoint=endpoint,
                                                                             key=key, secret="not-the-secret"))
    done = live_platform.wait_for(job["id"], timeout=60)
    assert done["status"] == "FAILED"
    assert "downloading training data failed" in done["status_reason"]
    assert "refused the credentials (SignatureDoesNotMatch)" in done["status_reason"]
    events = [e["to_status"] for e in live_platform.api("GET", f"/api/v1/jobs/{job['id']}/events/").json()["results"]]
    assert events == ["QUEUED", "PENDING", "DOWNLOADING", "FAILED"]
    assert time.monotonic() - started < 45
    assert credentials_deleted(live_platform, job["id"])
    folder = next(live_platform.data_dir.glob(f"storage/*/{job['id']}"))
    assert not list(Path(folder).glob("attempt-*"))  # no learner was started


def credentials_deleted(platform, job_id, timeout=10):
    """The sealed credentials go right after the final status commits (in the worker that set it)."""
    folder = next(platform.data_dir.glob(f"storage/*/{job_id}"))
    deadline = time.monotonic() + timeout
    while (folder / ".credentials.sealed").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
