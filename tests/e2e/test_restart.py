"""A restart of the whole platform while jobs train, the way a user does it: `manage.py demo` (what
`make demo` runs) stopped with Ctrl-C, and started again on another port with the same data directory.

The stop ends the learners (the demo leaves nothing running) and their agents while the web server
is already gone, so each learner's last lines and its exit exist only on disk (the agent's spool and
exit record). After the restart the interrupted job with a retry left must be training again as its
next attempt from its checkpoint within a minute, the one without fails naming the stop, a new job
completes, and the log keeps every line the learners printed before the stop.
"""
import os
import time

import pytest
import requests

from portal.runner import free_port
from tests.support.demo import Demo
from tests.support.harness import backing_services, wait_for_status
from trainyard.packing import code_upload

pytestmark = pytest.mark.e2e

# Prints a numbered line per step (and appends it to a file in its results folder: the truth the
# platform's log is checked against) and checkpoints after each; resumes after the step its
# checkpoint names.
TRAIN_SH = """\
set -u
start=1
if [ -n "${RESUME_FROM:-}" ]; then start=$(( $(cat "$RESUME_FROM") + 1 )); fi
for step in $(seq "$start" "$1"); do
    sleep 0.3
    line="attempt $TRAINYARD_ATTEMPT step $step"
    echo "$line"
    echo "$line" >> "$RESULT_DIR/printed.txt"
    echo "$step" > "$CHECKPOINT_DIR/step.tmp"
    mv "$CHECKPOINT_DIR/step.tmp" "$CHECKPOINT_DIR/step-$(printf %05d "$step")"
done
"""


def manifest(name, *, steps, retries):
    return (f"name: {name}\ncpus: 0.5\nmemory: 256MiB\nrestart_policy: {{max_retries: {retries}}}\n"
            f"checkpoint: {{signal: SIGTERM, grace_seconds: 2}}\n"
            f"framework: {{name: custom, command: 'bash train.sh {steps}'}}\n")


class Api:
    def __init__(self, url, token):
        self.url, self.headers = url, {"Authorization": f"Token {token}"}

    def get(self, path, **params):
        response = requests.get(self.url + path, headers=self.headers, params=params, timeout=30)
        response.raise_for_status()
        return response.json()

    def submit(self, manifest_text, code_dir):
        code = code_upload(str(code_dir))
        with code.fileobj:
            response = requests.post(self.url + "/api/v1/jobs/", headers=self.headers, timeout=60, files={
                "manifest": ("manifest.yml", manifest_text), "code": (code.filename, code.fileobj.read())})
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id):
        return self.get(f"/api/v1/jobs/{job_id}/")

    def lines(self, job_id, attempt):
        lines, since = [], 0
        while (page := self.get(f"/api/v1/jobs/{job_id}/logs/", since=since, limit=10000))["results"]:
            lines += [x["line"] for x in page["results"]
                      if x["stream"] == "stdout" and x["line"].startswith(f"attempt {attempt} ")]
            since = page["next_since"]
        return lines


def job_folder(data_dir, job_id):
    return next(data_dir.glob(f"storage/*/{job_id}"))


def printed(data_dir, job_id, attempt):
    path = job_folder(data_dir, job_id) / "results" / "printed.txt"
    return [line for line in path.read_text().splitlines() if line.startswith(f"attempt {attempt} ")]


def checkpoints(data_dir, job_id, attempt):
    return sorted((job_folder(data_dir, job_id) / "checkpoints" / f"attempt-{attempt}").glob("step-*"))


def assert_log_keeps(api, data_dir, job_id):
    """The platform's log of attempt 1 is everything the learner printed (the file it appended each
    line to after printing it), in order, nothing missing; at most the one line printed just before
    the stop cut the append short is only in the log."""
    stored, truth = api.lines(job_id, 1), printed(data_dir, job_id, 1)
    assert truth, f"{job_id}: the learner printed nothing before the stop"
    assert stored[:len(truth)] == truth and len(stored) - len(truth) <= 1, (
        f"{job_id}: log has {len(stored)} lines of attempt 1 (last {stored[-1:]}), the learner printed "
        f"{len(truth)} (last {truth[-1:]})")


def test_a_job_interrupted_by_a_demo_restart_goes_on_from_its_checkpoint(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.sh").write_text(TRAIN_SH)
    cleanups = []
    env = dict(os.environ, TRAINYARD_DATA_DIR=str(data_dir), TRAINYARD_DEMO_EXAMPLES="none",
               TRAINYARD_LOCAL_CPUS="4", **backing_services(data_dir, cleanups))
    demo = Demo(data_dir, env)
    try:
        api = Api(*demo.start(free_port()))
        retried = api.submit(manifest("restart-retried", steps=400, retries=1), code)
        failed = api.submit(manifest("restart-failed", steps=400, retries=0), code)
        for job_id in (retried, failed):
            wait_for_status(api.job, job_id, {"PROCESSING"}, timeout=60)
        deadline = time.monotonic() + 60
        while len(checkpoints(data_dir, retried, 1)) < 3 or len(checkpoints(data_dir, failed, 1)) < 3:
            assert time.monotonic() < deadline, "the jobs wrote no checkpoints"
            time.sleep(0.2)

        demo.interrupt()
        last_checkpoint = int(checkpoints(data_dir, retried, 1)[-1].read_text())
        api = Api(*demo.start(free_port()))
        restarted = time.monotonic()

        deadline = restarted + 60
        while (job := api.job(retried))["attempt"] < 2 or job["status"] != "PROCESSING" or not api.lines(retried, 2):
            assert time.monotonic() < deadline, (
                f"{retried} is {job['status']} as attempt {job['attempt']} 60 s after the restart: {job['status_reason']}")
            time.sleep(0.5)
        assert api.lines(retried, 2)[0] == f"attempt 2 step {last_checkpoint + 1}", "attempt 2 did not resume"
        done = wait_for_status(api.job, failed, {"FAILED", "COMPLETED", "TERMINATED"},
                               timeout=max(1.0, restarted + 60 - time.monotonic()))
        assert done["status"] == "FAILED", done
        assert "the platform was stopped while the learner ran" in done["status_reason"], done["status_reason"]

        fresh = api.submit(manifest("after-restart", steps=3, retries=0), code)
        assert wait_for_status(api.job, fresh, {"FAILED", "COMPLETED", "TERMINATED"}, timeout=90)["status"] == "COMPLETED"
        for job_id in (retried, failed):
            assert_log_keeps(api, data_dir, job_id)
    finally:
        demo.interrupt()
        for cleanup in reversed(cleanups):
            cleanup()
