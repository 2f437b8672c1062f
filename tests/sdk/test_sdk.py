"""`from trainyard import Client` against a real running platform."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

import trainyard
import trainyard.client
from portal.runner import PROJECT_ROOT
from trainyard import BadRequest, Client, Conflict, ConfigError, NotFound, WaitTimeout

pytestmark = pytest.mark.e2e

EXAMPLE = PROJECT_ROOT / "examples" / "custom-shell"


def slow_manifest(steps):
    """custom-shell for `steps` half-second steps: long enough to halt while it runs."""
    return {"name": "slow-shell", "cpus": 0.5, "memory": "256MiB",
            "framework": {"name": "custom", "command": f"env STEPS={steps} bash run.sh"},
            "checkpoint": {"signal": "SIGTERM", "grace_seconds": 10}}


def test_it_submits_waits_streams_logs_reads_metrics_and_downloads(client, tmp_path):
    job = client.submit(EXAMPLE / "manifest.yml", EXAMPLE)
    assert job["id"].startswith("training-") and job["status"] == "QUEUED"

    lines = [line["line"] for line in client.logs(job["id"], follow=True)]
    assert lines[0].startswith(f"custom job {job['id']} attempt 1: 10 steps")
    assert lines[-1].startswith("done: final loss")

    done = client.wait(job["id"], timeout=60)
    assert done["status"] == "COMPLETED" and done["exit_code"] == 0
    points = client.metrics(job["id"], name="loss")
    assert [p["step"] for p in points] == list(range(1, 11))
    assert done["latest_metrics"]["loss"]["value"] == pytest.approx(points[-1]["value"])
    assert [job["id"]] == [j["id"] for j in client.jobs(status="COMPLETED") if j["id"] == job["id"]]

    files = client.download(job["id"], tmp_path / "out")
    assert [f.name for f in files] == ["results/result.json"]
    assert json.loads((tmp_path / "out" / "results" / "result.json").read_text())["steps"] == 10


def test_it_halts_and_resumes_a_running_job(client):
    job = client.submit(slow_manifest(60), EXAMPLE)
    client.wait(job["id"], statuses=("PROCESSING",), timeout=60)
    assert client.halt(job["id"])["status"] == "HALTING"
    halted = client.wait(job["id"], timeout=60)
    assert halted["status"] == "HALTED", halted["status_reason"]
    with pytest.raises(Conflict) as refused:
        client.halt(job["id"])
    assert refused.value.status == 409 and "HALTED" in str(refused.value)

    assert client.resume(job["id"])["status"] in ("QUEUED", "PENDING")
    client.wait(job["id"], statuses=("PROCESSING",), timeout=60)
    assert client.job(job["id"])["attempt"] == 2
    assert client.terminate(job["id"])["id"] == job["id"]
    assert client.wait(job["id"], timeout=60)["status"] == "TERMINATED"


def test_an_ended_job_is_deleted_with_its_files_and_its_storage_freed(client, platform):
    """Through the CLI, as a user frees storage: the job leaves the lists at once and the lifecycle
    purge pass removes its folder."""
    job = client.submit(EXAMPLE / "manifest.yml", EXAMPLE)
    assert client.wait(job["id"], timeout=60)["status"] == "COMPLETED"
    folder = platform.data_dir / "storage" / platform.tenant / job["id"]
    assert (folder / "results" / "result.json").exists()
    stored = client.tenant()["usage"]["storage_bytes"]

    asked = platform.cli("delete", job["id"])  # not at a terminal: it will not delete unasked
    assert asked.returncode == 2 and "pass --yes" in asked.stderr
    assert client.job(job["id"])["status"] == "COMPLETED"
    deleted = platform.cli("delete", "--yes", job["id"])
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.strip() == f"{job['id']}: deleted"

    with pytest.raises(NotFound):
        client.job(job["id"])
    assert job["id"] not in [j["id"] for j in client.jobs(limit=200)]
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.exists()
    assert client.tenant()["usage"]["storage_bytes"] < stored


def test_a_running_job_is_not_deleted(client):
    job = client.submit(slow_manifest(60), EXAMPLE)
    client.wait(job["id"], statuses=("PROCESSING",), timeout=60)
    with pytest.raises(Conflict) as refused:
        client.delete(job["id"])
    assert refused.value.status == 409 and "terminate it first" in str(refused.value)
    client.terminate(job["id"])
    assert client.wait(job["id"], timeout=60)["status"] == "TERMINATED"
    assert client.delete(job["id"])["id"] == job["id"]


def test_wait_ends_with_not_found_as_the_job_it_waits_on_is_deleted(client, platform, monkeypatch):
    """A script waits for a halted job to complete, and someone deletes it: the job's socket says so and
    the wait ends at once, not at its next read of the job."""
    job = client.submit(slow_manifest(60), EXAMPLE)
    client.wait(job["id"], statuses=("PROCESSING",), timeout=60)
    client.halt(job["id"])
    assert client.wait(job["id"], timeout=60)["status"] == "HALTED"
    listening, ended = threading.Event(), {}
    until = trainyard.client.StatusWatch.until
    monkeypatch.setattr(trainyard.client.StatusWatch, "until",
                        lambda self, *args: listening.set() or until(self, *args))

    def wait():
        try:
            platform.sdk().wait(job["id"], statuses=("COMPLETED",), timeout=60, poll=120)
        except NotFound as error:
            ended.update(error=error, at=time.monotonic())
    waiter = threading.Thread(target=wait)
    waiter.start()
    assert listening.wait(30)
    deleted_at = time.monotonic()
    client.delete(job["id"])
    waiter.join(60)
    assert str(ended["error"]) == f"{job['id']} was deleted"
    assert ended["at"] - deleted_at < trainyard.client.RECHECK_SECONDS / 2  # told, not found on a later read


def test_an_unknown_job_is_not_found(client):
    with pytest.raises(NotFound) as missing:
        client.job("training-nosuchjob")
    assert missing.value.status == 404
    with pytest.raises(NotFound):
        list(client.logs("training-nosuchjob"))


def test_a_bad_manifest_is_a_bad_request_naming_the_field(client):
    manifest = {**slow_manifest(1), "name": "refused", "memory": "4XB"}
    with pytest.raises(BadRequest) as refused:
        client.submit(manifest, EXAMPLE)
    assert refused.value.status == 400 and refused.value.field == "memory"
    assert str(refused.value).startswith("memory: ")
    assert not [j for j in client.jobs(limit=200) if j["name"] == "refused"]  # nothing was stored


def test_wait_gives_up_after_its_timeout(client):
    job = client.submit(slow_manifest(60), EXAMPLE)
    try:
        with pytest.raises(WaitTimeout) as late:
            client.wait(job["id"], statuses=("COMPLETED",), timeout=1, poll=0.2)
        assert late.value.job["id"] == job["id"]
    finally:
        client.terminate(job["id"])


def test_wait_hears_the_end_over_the_jobs_websocket_without_polling(client, monkeypatch):
    opened = []
    original = trainyard.client.StatusWatch.open
    monkeypatch.setattr(trainyard.client.StatusWatch, "open",
                        classmethod(lambda cls, *a: opened.append(original(*a)) or opened[-1]))
    job = client.submit(slow_manifest(2), EXAMPLE)
    started = time.monotonic()
    assert client.wait(job["id"], timeout=60, poll=120)["status"] == "COMPLETED"  # a poll would take 120 s
    assert time.monotonic() - started < 60
    assert opened and opened[0] is not None


def test_wait_returns_the_job_the_end_came_with_without_reading_it(client, monkeypatch):
    job = client.submit(slow_manifest(2), EXAMPLE)
    reads = []
    original = client.job
    monkeypatch.setattr(client, "job", lambda job_id: reads.append(job_id) or original(job_id))
    done = client.wait(job["id"], timeout=60, poll=120)
    assert done["status"] == "COMPLETED" and done["exit_code"] == 0
    assert reads == []  # the job came over the socket as it opened, and again with its end
    again = client.job(job["id"])  # as the REST API shows it
    assert done.keys() == again.keys() and all(done[k] == again[k] for k in ("id", "status", "finished_at", "manifest"))


def test_wait_on_a_finished_job_answers_from_the_sockets_first_message(client, monkeypatch):
    job = client.submit(slow_manifest(0), EXAMPLE)
    client.wait(job["id"], timeout=60)
    reads = []
    original = client.job
    monkeypatch.setattr(client, "job", lambda job_id: reads.append(job_id) or original(job_id))
    done = client.wait(job["id"], timeout=60, poll=120)
    assert done["status"] == "COMPLETED" and reads == []
    again = client.job(job["id"])  # the REST detail, as a read gives it
    assert done.keys() == again.keys() and all(done[k] == again[k] for k in ("id", "status", "finished_at", "manifest"))


def test_wait_reads_the_job_when_the_socket_says_nothing_first(client, monkeypatch):
    monkeypatch.setattr(trainyard.client.StatusWatch, "first_job", lambda self, seconds: None)
    reads = []
    original = client.job
    monkeypatch.setattr(client, "job", lambda job_id: reads.append(job_id) or original(job_id))
    job = client.submit(slow_manifest(1), EXAMPLE)
    assert client.wait(job["id"], timeout=60, poll=120)["status"] == "COMPLETED"
    assert reads == [job["id"]]


def test_wait_polls_where_no_websocket_can_be_opened(client, monkeypatch):
    monkeypatch.setattr(trainyard.client.StatusWatch, "open", classmethod(lambda cls, *a: None))
    job = client.submit(slow_manifest(2), EXAMPLE)
    assert client.wait(job["id"], timeout=60, poll=0.2)["status"] == "COMPLETED"


def test_explicit_arguments_win_and_missing_ones_are_a_config_error(platform, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("TRAINYARD_URL", "TRAINYARD_TOKEN", "TRAINYARD_TENANT", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="TRAINYARD_URL"):
        Client()
    assert Client(platform.url, platform.token).tenant()["tenant"]["slug"] == platform.tenant


def test_the_sdk_does_not_import_django():
    done = subprocess.run([sys.executable, "-c", "import sys, trainyard; trainyard.Client; print(sorted(m for m "
                           "in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'celery', 'jobs')))"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
    assert trainyard.__all__ and "Client" in trainyard.__all__


def test_the_example_script_submits_follows_and_prints_the_metrics(platform, tmp_path):
    env = dict(os.environ, TRAINYARD_URL=platform.url, TRAINYARD_TOKEN=platform.token, HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "examples/sdk/submit_and_follow.py", "examples/custom-shell"],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "  | step 10/10 loss" in done.stdout
    assert " COMPLETED" in done.stdout and "  loss = " in done.stdout


def test_it_runs_an_experiment_and_reads_its_trials_metric(client, tmp_path):
    manifest = tmp_path / "experiment.yml"
    manifest.write_text(
        "name: shell-sweep\ncpus: 0.5\nmemory: 256MiB\n"
        "framework: {name: custom, command: 'env STEPS={{hparams.steps}} bash run.sh'}\n"
        "hyperparameters:\n  steps: {type: categorical, vals: [2, 3]}\n"
        "searcher: {name: grid, metric: loss, smaller_is_better: true, max_trials: 2}\n")
    experiment = client.create_experiment(manifest, EXAMPLE)
    done = client.wait_experiment(experiment["id"], timeout=120, poll=0.5)
    assert done["state"] == "COMPLETED", done
    trials = {trial["job_id"]: trial for trial in done["trials"]}
    assert len(trials) == 2

    answer = client.experiment_metrics(experiment["id"])
    reported = answer["results"]
    steps_per_job = {}
    for point in reported:
        steps_per_job.setdefault(point["job_id"], []).append(point["step"])
    assert set(steps_per_job) == set(trials)
    assert sorted(map(len, steps_per_job.values())) == [2, 3]
    later = client.experiment_metrics(experiment["id"], after=answer["next_after"])
    assert later == {"results": [], "next_after": answer["next_after"]}


def test_a_finished_experiment_is_deleted_with_its_trials_folders(client, platform, tmp_path):
    manifest = tmp_path / "experiment.yml"
    manifest.write_text(
        "name: shell-pair\ncpus: 0.5\nmemory: 256MiB\n"
        "framework: {name: custom, command: 'env STEPS={{hparams.steps}} bash run.sh'}\n"
        "hyperparameters:\n  steps: {type: categorical, vals: [1, 2]}\n"
        "searcher: {name: grid, metric: loss, smaller_is_better: true, max_trials: 2}\n")
    experiment = client.create_experiment(manifest, EXAMPLE)
    with pytest.raises(Conflict) as refused:  # still searching
        client.delete_experiment(experiment["id"])
    assert refused.value.status == 409 and "kill it first" in str(refused.value)
    done = client.wait_experiment(experiment["id"], timeout=120, poll=0.5)
    assert done["state"] == "COMPLETED", done
    storage = platform.data_dir / "storage" / platform.tenant
    folders = [storage / experiment["id"]] + [storage / trial["job_id"] for trial in done["trials"]]
    assert all(folder.exists() for folder in folders)

    deleted = platform.cli("experiment", "delete", "--yes", experiment["id"])
    assert deleted.returncode == 0, deleted.stderr
    with pytest.raises(NotFound):
        client.experiment(experiment["id"])
    for trial in done["trials"]:
        with pytest.raises(NotFound):
            client.job(trial["job_id"])
    deadline = time.monotonic() + 30
    while any(folder.exists() for folder in folders) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [folder.name for folder in folders if folder.exists()] == []
