"""Experiments end to end: the PyTorch example's learning rate, width and batch size searched from the
CLI by each searcher, every trial a real learner training on the live platform; ASHA pauses trials at
a rung by halting them through their checkpoints and promotes one by resuming it from its checkpoint."""
import json

import pytest
import yaml

from tests.support.harness import EXAMPLES

pytestmark = pytest.mark.e2e
FOLDER = EXAMPLES / "pytorch-digits"


def experiment_file(tmp_path, **searcher):
    spec = yaml.safe_load((FOLDER / "experiment.yml").read_text())
    spec["searcher"].update(searcher)
    epochs = searcher.get("max_length", 2)
    spec["framework"]["command"] = spec["framework"]["command"].replace("--epochs 9", f"--epochs {epochs}")
    path = tmp_path / f"{searcher['name']}.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def create_and_wait(live_platform, path, timeout=420):
    created = live_platform.cli("experiment", "create", str(path), str(FOLDER), "--wait", timeout=timeout)
    assert created.returncode == 0, created.stderr
    experiment_id = created.stdout.split()[0]
    return json.loads(live_platform.cli("experiment", "show", experiment_id, "--json").stdout)


def test_asha_pauses_and_promotes_real_trials_through_their_checkpoints(live_platform, tmp_path):
    path = experiment_file(tmp_path, name="asha", max_trials=6, max_concurrent_trials=3, max_length=3, divisor=3)
    experiment = create_and_wait(live_platform, path)
    assert experiment["state"] == "COMPLETED", experiment["state_reason"]
    trials = experiment["trials"]
    assert [t["number"] for t in trials] == list(range(6))  # each configuration once, none lost
    assert len({json.dumps(t["params"], sort_keys=True) for t in trials}) == 6
    assert all(len(t["rungs"]) >= 1 for t in trials)  # every trial reached the first rung (epoch 1)
    completed = [t for t in trials if t["state"] == "completed"]
    stopped = [t for t in trials if t["state"] == "stopped"]
    assert completed and stopped and len(completed) + len(stopped) == 6
    assert all(t["job_status"] == "COMPLETED" for t in completed)
    assert all(t["job_status"] == "TERMINATED" for t in stopped)  # paused at rung 1, never promoted
    best = next(t for t in trials if t["number"] == experiment["best_trial"])
    assert best["state"] == "completed" and best["value"] == experiment["best_value"] > 0.5

    # A trial that was paused and promoted ran its next attempt from its checkpoint.
    resumed = [t for t in completed
               if any(e["to_status"] == "HALTED" for e in
                      live_platform.api("GET", f"/api/v1/jobs/{t['job_id']}/events/").json()["results"])]
    for trial in resumed:
        job = live_platform.api("GET", f"/api/v1/jobs/{trial['job_id']}/").json()
        assert job["attempt"] >= 2
        log = "\n".join(line["line"] for line in live_platform.all_logs(trial["job_id"]))
        assert "resuming from" in log
    paused = [t for t in stopped if any(e["reason"].startswith("paused at rung 1") for e in
                                        live_platform.api("GET", f"/api/v1/jobs/{t['job_id']}/events/").json()["results"])]
    assert paused, "a trial stopped at the rung says why"

    job = live_platform.api("GET", f"/api/v1/jobs/{best['job_id']}/").json()
    assert f"--lr {best['params']['lr']!r}" in job["manifest"]["framework"]["command"]
    hparams = live_platform.api("GET", f"/api/v1/jobs/{best['job_id']}/artifacts/results/hparams.json")
    assert hparams.status_code == 200 and json.loads(hparams.content) == best["params"]


@pytest.mark.parametrize("searcher", ["grid", "random", "tpe"])
def test_every_searcher_runs_its_trials_to_completion(live_platform, tmp_path, searcher):
    path = experiment_file(tmp_path, name=searcher, max_trials=2, max_concurrent_trials=2, max_length=1)
    experiment = create_and_wait(live_platform, path)
    assert experiment["state"] == "COMPLETED", experiment["state_reason"]
    assert [t["state"] for t in experiment["trials"]] == ["completed", "completed"]
    assert all(t["value"] is not None and t["step"] == 1 for t in experiment["trials"])
    listed = live_platform.cli("experiment", "list")
    assert experiment["id"] in listed.stdout and "COMPLETED" in listed.stdout


def test_an_experiment_of_another_tenant_is_not_found(live_platform, tmp_path):
    path = experiment_file(tmp_path, name="random", max_trials=1, max_concurrent_trials=1, max_length=1)
    created = live_platform.cli("experiment", "create", str(path), str(FOLDER))
    assert created.returncode == 0, created.stderr
    experiment_id = created.stdout.split()[0]
    killed = live_platform.cli("experiment", "kill", experiment_id)
    assert killed.returncode == 0 and "TERMINATED" in killed.stdout
    other = live_platform.add_member("team-experiments-b", "bob-experiments")
    assert live_platform.api("GET", f"/api/v1/experiments/{experiment_id}/", token=other).status_code == 404
    assert live_platform.api("POST", f"/api/v1/experiments/{experiment_id}/kill/", token=other).status_code == 404
    listed = live_platform.api("GET", "/api/v1/experiments/", token=other).json()["results"]
    assert experiment_id not in [e["id"] for e in listed]
    shown = json.loads(live_platform.cli("experiment", "show", experiment_id, "--json").stdout)
    assert shown["state"] == "TERMINATED" and all(t["state"] == "stopped" for t in shown["trials"])
