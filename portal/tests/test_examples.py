"""The bundled example jobs, run bare (without the platform) as real processes.

The PyTorch example is the reference for checkpoint/resume behaviour, so these tests check that a
resumed run continues exactly where the checkpoint left off and that SIGTERM ends it cleanly.
"""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainyard.manifest import parse_manifest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DIGITS = EXAMPLES / "pytorch-digits"
SMALL = ["--width", "8", "--batch-size", "64"]  # the same code, a few times faster than the default


def bare_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RESUME_FROM", "PYTHONPATH")}
    env.update(CHECKPOINT_DIR=str(tmp_path / "checkpoints"), RESULT_DIR=str(tmp_path / "results"),
               OMP_NUM_THREADS="1", **extra)
    return env


def train(tmp_path, *args, **env):
    done = subprocess.run([sys.executable, str(DIGITS / "train.py"), *SMALL, *args], cwd=tmp_path,
                          env=bare_env(tmp_path, **env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def epoch_lines(output):
    """The per-epoch log lines without their timing (and without the "/N" total)."""
    return [re.sub(r"^(epoch \d+)/\d+(.*?)( \(\d+\.\d+s\))?$", r"\1\2", line)
            for line in output.splitlines() if line.startswith("epoch ")]


def metric_points(output):
    return [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("TRAINYARD_METRIC ")]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """Three epochs without interruption: what every resumed run must reproduce line for line."""
    return epoch_lines(train(tmp_path_factory.mktemp("straight"), "--epochs", "3"))


def test_pytorch_digits_resumes_exactly_where_its_checkpoint_left_off(tmp_path, straight_run):
    first = train(tmp_path, "--epochs", "2")
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-1.pt", "epoch-2.pt"]  # no temporary files
    assert_metrics_are_reported_both_ways(first, epochs=2)

    resumed = train(tmp_path, "--epochs", "3", RESUME_FROM=str(checkpoints / "epoch-2.pt"),
                    PYTHONPATH=str(REPO))  # this time with the platform's own `report` helper
    assert f"resuming from {checkpoints / 'epoch-2.pt'} at epoch 3\n" in resumed
    assert [line.split()[1] for line in epoch_lines(resumed)] == ["3"]
    assert [p["step"] for p in metric_points(resumed) if p["name"] == "val_loss"] == [3]
    history = json.loads((tmp_path / "results" / "metrics.json").read_text())["history"]
    assert [entry["epoch"] for entry in history] == [1, 2, 3]
    assert (tmp_path / "results" / "model.pt").stat().st_size > 0
    assert epoch_lines(first) + epoch_lines(resumed) == straight_run


def test_pytorch_digits_checkpoints_on_sigterm_and_resumes_from_there(tmp_path, straight_run):
    learner = subprocess.Popen([sys.executable, str(DIGITS / "train.py"), *SMALL, "--epochs", "500"],
                               cwd=tmp_path, env=bare_env(tmp_path), stdout=subprocess.PIPE, text=True)
    try:
        before = []
        for line in learner.stdout:
            before.append(line)
            if line.startswith("epoch 1/"):
                break
        learner.send_signal(signal.SIGTERM)  # lands in epoch 2 (a partial checkpoint), or just after it
        before += learner.stdout.readlines()
        assert learner.wait(timeout=60) == 0
    finally:
        learner.kill()
    assert "stop requested" in before[-1]
    assert not (tmp_path / "results").exists()
    newest = max((tmp_path / "checkpoints").iterdir(), key=lambda p: p.stat().st_mtime)
    assert re.fullmatch(r"epoch-\d+(-partial)?\.pt", newest.name)

    done_before = epoch_lines("".join(before))
    if len(done_before) < 3:
        resumed = train(tmp_path, "--epochs", "3", RESUME_FROM=str(newest))
        assert done_before + epoch_lines(resumed) == straight_run


def assert_metrics_are_reported_both_ways(output, *, epochs):
    """The manifest's regex finds loss and val_acc in the human line; val_loss comes as TRAINYARD_METRIC."""
    regex = parse_manifest((DIGITS / "manifest.yml").read_bytes()).metric_regexes["train"]
    scraped = [re.search(regex, line).groupdict() for line in output.splitlines() if line.startswith("epoch ")]
    assert [s["epoch"] for s in scraped] == [str(n) for n in range(1, epochs + 1)]
    assert all(0 < float(s["val_acc"]) <= 1 and float(s["loss"]) > 0 for s in scraped)
    assert [p["step"] for p in metric_points(output) if p["name"] == "val_loss"] == list(range(1, epochs + 1))


def test_custom_shell_reports_each_step_and_writes_a_result(tmp_path):
    done = subprocess.run(["bash", str(EXAMPLES / "custom-shell" / "run.sh")], cwd=tmp_path, timeout=60,
                          env=bare_env(tmp_path, STEPS="3"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    points = metric_points(done.stdout)
    assert [p["step"] for p in points] == [1, 2, 3]
    assert points[0]["value"] > points[-1]["value"]
    assert json.loads((tmp_path / "results" / "result.json").read_text())["steps"] == 3


def test_failing_example_writes_both_streams_and_exits_3(tmp_path):
    done = subprocess.run(["bash", str(EXAMPLES / "failing" / "fail.sh")], cwd=tmp_path, timeout=60,
                          env=bare_env(tmp_path), capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stdout.strip() and done.stderr.strip()


@pytest.mark.parametrize("manifest", sorted(EXAMPLES.glob("*/manifest.yml")), ids=lambda p: p.parent.name)
def test_every_example_manifest_names_a_file_that_exists(manifest):
    command = parse_manifest(manifest.read_bytes()).command
    assert (manifest.parent / command.split()[1]).is_file()
