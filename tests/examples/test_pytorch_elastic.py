"""examples/pytorch-elastic without the platform: real learner processes, real torch.distributed (gloo
on 127.0.0.1), the environment Trainyard gives each attempt, and the checkpoint signal sent as the
platform sends it. One job is started at 1 learner, stopped mid-training, resumed at 4 learners with a
larger batch, stopped again, resumed at 2 with another batch and left to finish; the logs must show
every training sample exactly once per epoch over the attempts, a loss that continues after each
resume, and a final accuracy close to the same job's at a fixed size.
"""
import collections
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from jobs import checkpoints
from tests.support.elastic_example import (ACCURACY_TOLERANCE, FINAL_LINE, SAMPLES_LINE, STEP_LINE, STOP_LINE,
                                           TOTAL, TRAINING_SET, expand)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pytorch-elastic"
MANIFEST = yaml.safe_load((EXAMPLE / "manifest.yml").read_text())
COMMAND = [sys.executable if word == "python" else word for word in shlex.split(MANIFEST["framework"]["command"])]
if "--sample-delay" in COMMAND:  # a virtual GPU's pace (the manifest's): here only the samples matter
    del COMMAND[COMMAND.index("--sample-delay"):COMMAND.index("--sample-delay") + 2]
BASE_BATCH = MANIFEST["elastic"]["batch_size"]["global"]
ATTEMPT_TIMEOUT = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Attempt:
    """One attempt of the job: `world` learner processes with the environment the platform sets.

    A reader thread per learner collects its output; the one of learner 0 sends the checkpoint signal
    to every learner as soon as the job has done `stop_at` of its samples (from inside the reader, so
    the signal lands mid-training however loaded the machine is).
    """

    def __init__(self, job_dir, number, world, global_batch, *, stop_at=None):
        self.job_dir, self.number, self.world, self.global_batch = Path(job_dir), number, world, global_batch
        self.stop_at, self.total = stop_at, None
        self.signalled = threading.Event()
        self.lines = {rank: [] for rank in range(world)}
        resume_from = checkpoints.last_good(job_dir, number)  # how the platform picks RESUME_FROM
        self.resume_from = str(resume_from) if resume_from else None
        port = free_port()
        self.processes, self.readers = [], []
        for rank in range(world):
            env = self.environment(job_dir, rank, port)
            process = subprocess.Popen(COMMAND, cwd=EXAMPLE, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, bufsize=1)
            self.processes.append(process)
            reader = threading.Thread(target=self.read, args=(rank, process), daemon=True)
            reader.start()
            self.readers.append(reader)

    def environment(self, job_dir, rank, port):
        env = {key: value for key, value in os.environ.items()
               if key not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "RESUME_FROM")
               and not key.startswith("TRAINYARD_")}
        env.update({
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "CHECKPOINT_DIR": str(checkpoints.attempt_dir(job_dir, self.number)),
            "RESULT_DIR": str(Path(job_dir) / "results"),
            "NUM_LEARNERS": str(self.world), "LEARNER_ID": str(rank), "TRAINYARD_ATTEMPT": str(self.number),
            "TRAINYARD_GLOBAL_BATCH_SIZE": str(self.global_batch),
            "TRAINYARD_LOCAL_BATCH_SIZE": str(self.global_batch // self.world),
            "TRAINYARD_LR_SCALE": repr(self.global_batch / BASE_BATCH),  # lr_scaling: linear
        })
        if self.world > 1:  # as the platform does: a one-learner job gets none of these
            env.update(RANK=str(rank), WORLD_SIZE=str(self.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if self.resume_from:
            env["RESUME_FROM"] = self.resume_from
        return env

    def read(self, rank, process):
        for line in process.stdout:
            line = line.rstrip("\n")
            self.lines[rank].append(line)
            if total := TOTAL.search(line):
                self.total = int(total.group(1))
            step = STEP_LINE.match(line)
            if (step and self.stop_at is not None and int(step.group(2)) >= self.stop_at * self.total
                    and not self.signalled.is_set()):
                self.signalled.set()
                for learner in self.processes:
                    learner.send_signal(signal.SIGTERM)

    def wait(self):
        deadline = time.monotonic() + ATTEMPT_TIMEOUT
        try:
            codes = [process.wait(timeout=max(1, deadline - time.monotonic())) for process in self.processes]
        finally:
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
        for reader in self.readers:
            reader.join(timeout=10)
        assert codes == [0] * self.world, self.tail()
        return self

    def tail(self):
        return "\n".join(f"[attempt {self.number} rank {rank}] {line}"
                         for rank, lines in self.lines.items() for line in lines[-15:])

    def matches(self, pattern, rank=None):
        ranks = self.lines if rank is None else [rank]
        return [m for r in ranks for line in self.lines[r] if (m := pattern.search(line))]


def step_losses(attempt):
    return [(int(m.group(1)), float(m.group(3))) for m in attempt.matches(STEP_LINE, rank=0)]


def assert_stopped_together(attempt):
    """Every learner stopped after the same step; learner 0's checkpoint is what the platform resumes from."""
    assert attempt.signalled.is_set()
    stops = {(int(m.group(2)), int(m.group(3))) for m in attempt.matches(STOP_LINE)}
    assert len(attempt.matches(STOP_LINE)) == attempt.world and len(stops) == 1, attempt.tail()
    (samples, _), = stops
    assert 0 < samples < attempt.total  # stopped mid-training, not after it
    assert checkpoints.last_good(attempt.job_dir, attempt.number + 1).name == f"samples-{samples}.pt"
    return samples


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The elastic job's three attempts (1 -> 4 -> 2 learners) and the same job at a fixed size."""
    reference = Attempt(tmp_path_factory.mktemp("fixed"), 1, 1, BASE_BATCH)  # on the other core meanwhile
    job = tmp_path_factory.mktemp("elastic")
    first = Attempt(job, 1, 1, BASE_BATCH, stop_at=0.25).wait()
    second = Attempt(job, 2, 4, 2 * BASE_BATCH, stop_at=0.55).wait()
    third = Attempt(job, 3, 2, 96).wait()
    return {"attempts": [first, second, third], "reference": reference.wait(),
            "epochs": int(COMMAND[COMMAND.index("--epochs") + 1])}


def test_it_stops_every_learner_at_the_same_step_and_resumes_from_there(runs):
    first, second, third = runs["attempts"]
    for stopped, resumed in ((first, second), (second, third)):
        samples = assert_stopped_together(stopped)
        resuming = resumed.matches(re.compile(r"resuming from (\S+) at samples=(\d+)"))
        assert len(resuming) == resumed.world
        assert {(m.group(1), int(m.group(2))) for m in resuming} == {(resumed.resume_from, samples)}


def test_it_trains_on_every_sample_exactly_once_per_epoch_across_attempts(runs):
    size = int(runs["attempts"][0].matches(TRAINING_SET)[0].group(1))
    seen = collections.defaultdict(collections.Counter)
    for attempt in runs["attempts"]:
        for m in attempt.matches(SAMPLES_LINE):
            seen[int(m.group(1))].update(expand(m.group(4)))
    assert sorted(seen) == list(range(runs["epochs"]))
    for epoch, counts in seen.items():
        repeated = sorted(index for index, count in counts.items() if count != 1)
        missing = sorted(set(range(size)) - set(counts))
        assert not repeated and not missing and len(counts) == size, (
            f"epoch {epoch}: {len(repeated)} samples seen more than once (first {repeated[:10]}), "
            f"{len(missing)} never (first {missing[:10]})")


def test_its_loss_continues_after_each_resume(runs):
    first, second, third = runs["attempts"]
    initial = step_losses(first)[0][1]
    for stopped, resumed in ((first, second), (second, third)):
        before = [loss for _, loss in step_losses(stopped)[-5:]]
        after = [loss for _, loss in step_losses(resumed)[:5]]
        assert step_losses(resumed)[0][0] == step_losses(stopped)[-1][0] + 1  # the step count continues too
        # A resume that lost the model would start again near the initial loss (about 2.3 = ln 10).
        assert max(after) < initial / 3, (initial, before, after)
        assert sum(after) / 5 < 2 * sum(before) / 5 + 0.05, (before, after)


def test_it_reports_cumulative_samples_from_learner_0(runs):
    reported = [float(m.group(1)) for attempt in runs["attempts"]
                for m in attempt.matches(re.compile(r'^TRAINYARD_METRIC \{"name": "samples", "value": ([\d.]+)'),
                                         rank=0)]
    assert reported == sorted(reported) and reported[-1] == runs["attempts"][-1].total
    for attempt in runs["attempts"]:
        assert not any("TRAINYARD_METRIC" in line for rank in range(1, attempt.world) for line in attempt.lines[rank])


def test_its_final_accuracy_is_close_to_the_same_job_at_a_fixed_size(runs):
    elastic = float(runs["attempts"][-1].matches(FINAL_LINE)[0].group(1))
    fixed = float(runs["reference"].matches(FINAL_LINE)[0].group(1))
    assert fixed > 0.9
    assert abs(elastic - fixed) <= ACCURACY_TOLERANCE, (elastic, fixed)
