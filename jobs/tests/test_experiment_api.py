"""The experiments' REST endpoints: create, list, detail with trials, the searcher's metric, actions,
and tenant scoping (another tenant's experiment is a 404)."""
import pytest
from django.utils import timezone

from jobs import experiment_api, experiments
from jobs.models import Experiment, Job, MetricPoint, Trial
from tests.support.builders import client_for, logged_in, member, record_sends, tar_gz, upload

pytestmark = pytest.mark.django_db

MANIFEST = b"""
name: sweep
cpus: 1
memory: 1GiB
framework: {name: custom, command: "python train.py --lr {{hparams.lr}}"}
hyperparameters:
  lr: {type: log, minval: 0.001, maxval: 0.1, count: 3}
searcher: {name: grid, metric: val_acc, max_trials: 3, max_concurrent_trials: 2}
"""


@pytest.fixture
def alice(monkeypatch):
    record_sends(monkeypatch)
    return member("team-a", "alice")


def post(client, manifest=MANIFEST):
    return client.post("/api/v1/experiments/", {"manifest": upload(manifest, "experiment.yml"),
                                                "code": upload(tar_gz({"train.py": b"print(1)\n"}))},
                       format="multipart")


def test_create_list_show_and_the_metric_of_every_trial(alice):
    client = client_for(alice)
    created = post(client)
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["state"] == "ACTIVE" and body["searcher"] == "grid" and body["max_trials"] == 3
    assert body["trials"] == [] and body["hyperparameters"][0]["name"] == "lr"
    experiments.advance(body["id"])
    detail = client.get(f"/api/v1/experiments/{body['id']}/").json()
    assert [t["number"] for t in detail["trials"]] == [0, 1]
    assert detail["trials"][0]["job_status"] == "QUEUED" and detail["rungs"] == []
    trial_job = detail["trials"][1]["job_id"]
    MetricPoint.objects.create(job_id=trial_job, name="val_acc", step=1, value=0.5, time=timezone.now())
    MetricPoint.objects.create(job_id=trial_job, name="loss", step=1, value=2.0, time=timezone.now())
    points = client.get(f"/api/v1/experiments/{body['id']}/metrics/").json()
    assert [(p["trial"], p["step"], p["value"]) for p in points["results"]] == [(1, 1, 0.5)]
    assert client.get(f"/api/v1/experiments/{body['id']}/metrics/?after={points['next_after']}").json()["results"] == []
    listed = client.get("/api/v1/experiments/").json()["results"]
    assert [e["id"] for e in listed] == [body["id"]]
    assert client.get("/api/v1/experiments/?state=completed").json()["results"] == []
    assert client.get("/api/v1/experiments/?state=nope").status_code == 400


def test_a_refresh_asks_only_for_the_trials_that_changed_since_the_answer_before(alice):
    client = client_for(alice)
    created = post(client).json()
    experiments.advance(created["id"])
    long_ago = timezone.now() - 10 * experiment_api.CHANGES_OVERLAP  # the trials were started a while ago
    Trial.objects.filter(experiment_id=created["id"]).update(updated_at=long_ago)
    Job.objects.filter(trial__experiment_id=created["id"]).update(updated_at=long_ago)
    url = f"/api/v1/experiments/{created['id']}/"
    first = client.get(url).json()
    assert [t["number"] for t in first["trials"]] == [0, 1]
    unchanged = client.get(url, {"changed_after": first["next_changed_after"]}).json()
    assert unchanged["trials"] == [] and unchanged["state"] == "ACTIVE"
    Trial.objects.filter(experiment_id=created["id"], number=0).update(value=0.5, updated_at=timezone.now())
    Job.objects.filter(trial__experiment_id=created["id"], trial__number=1).update(
        status="PENDING", updated_at=timezone.now())  # its job was admitted
    changed = client.get(url, {"changed_after": unchanged["next_changed_after"]}).json()
    assert [(t["number"], t["value"], t["job_status"]) for t in changed["trials"]] == [
        (0, 0.5, "QUEUED"), (1, None, "PENDING")]


@pytest.mark.parametrize("value", ["yesterday", "2026-11-30T12:00:00", "2026-11-30T12:00:00+99:00", "1" * 41])
def test_a_changed_after_that_is_no_time_with_its_offset_is_a_400_naming_it(alice, value):
    client = client_for(alice)
    created = post(client).json()
    refused = client.get(f"/api/v1/experiments/{created['id']}/", {"changed_after": value})
    assert refused.status_code == 400 and refused.json()["field"] == "changed_after"


def test_the_searchers_metric_comes_in_pages(alice, monkeypatch):
    monkeypatch.setattr(experiment_api, "MAX_POINTS", 2)
    client = client_for(alice)
    created = post(client).json()
    experiments.advance(created["id"])
    trial_job = Trial.objects.get(experiment_id=created["id"], number=0).job_id
    for step in range(5):
        MetricPoint.objects.create(job_id=trial_job, name="val_acc", step=step, value=step / 10, time=timezone.now())
    url, after, pages = f"/api/v1/experiments/{created['id']}/metrics/", 0, []
    while (page := client.get(url, {"after": after}).json())["results"]:
        pages.append([p["step"] for p in page["results"]])
        after = page["next_after"]
    assert pages == [[0, 1], [2, 3], [4]]


def test_a_bad_manifest_is_a_400_naming_the_field(alice):
    refused = post(client_for(alice), MANIFEST.replace(b"max_trials: 3", b"max_trials: 0"))
    assert refused.status_code == 400
    assert refused.json()["field"] == "searcher.max_trials" and "1..10000" in refused.json()["detail"]
    assert not Experiment.objects.exists()


def test_a_nul_in_a_hyperparameter_value_is_a_400_naming_the_field(alice):
    refused = post(client_for(alice), MANIFEST.replace(b"lr: {type: log, minval: 0.001, maxval: 0.1, count: 3}",
                                                       b'lr: {type: categorical, vals: ["a\\0b", 1]}'))
    assert refused.status_code == 400 and refused.json()["field"] == "hyperparameters.lr.vals[0]"
    assert not Experiment.objects.exists()


def test_past_the_tenants_experiments_not_finished_a_create_is_a_429(alice, settings):
    settings.MAX_EXPERIMENTS = 1
    client = client_for(alice)
    assert post(client).status_code == 201
    refused = post(client)
    assert refused.status_code == 429 and "TRAINYARD_MAX_EXPERIMENTS=1" in refused.json()["detail"]


def test_actions_answer_202_or_409_and_a_viewer_is_refused(alice):
    client = client_for(alice)
    experiment_id = post(client).json()["id"]
    paused = client.post(f"/api/v1/experiments/{experiment_id}/pause/")
    assert paused.status_code == 202 and paused.json()["state"] == "PAUSED"
    again = client.post(f"/api/v1/experiments/{experiment_id}/pause/")
    assert again.status_code == 409 and "PAUSED" in again.json()["detail"]
    viewer = member("team-a", "victor", role="viewer")
    assert client_for(viewer).post(f"/api/v1/experiments/{experiment_id}/resume/").status_code == 403
    assert client.post(f"/api/v1/experiments/{experiment_id}/resume/").json()["state"] == "ACTIVE"
    assert client.post(f"/api/v1/experiments/{experiment_id}/kill/").json()["state"] == "TERMINATED"


def test_another_tenants_experiment_is_not_found(alice):
    experiment_id = post(client_for(alice)).json()["id"]
    bob = client_for(member("team-b", "bob"))
    assert bob.get(f"/api/v1/experiments/{experiment_id}/").status_code == 404
    assert bob.get(f"/api/v1/experiments/{experiment_id}/metrics/").status_code == 404
    assert bob.post(f"/api/v1/experiments/{experiment_id}/kill/").status_code == 404
    assert bob.get("/api/v1/experiments/").json()["results"] == []
    assert Experiment.objects.get(pk=experiment_id).state == "ACTIVE"


def test_every_trial_of_a_large_experiment_is_read_a_few_at_once_per_tenant(alice):
    """Reading every trial of an experiment of thousands takes a web thread and its CPU for most of a
    second: a tenant reading them in a loop took the web process from the others. Those reads hold one
    of the tenant's slots; the page's refreshes (changed_after) and small experiments hold none."""
    from tenants import throttling
    client = client_for(alice)
    large = post(client).json()
    small = post(client, MANIFEST.replace(b"name: sweep", b"name: small")).json()
    Experiment.objects.filter(pk=large["id"]).update(trials_started=experiments.FREE_READ_TRIALS + 1)
    mallory = member("team-b", "mallory")
    theirs = post(client_for(mallory)).json()
    Experiment.objects.filter(pk=theirs["id"]).update(trials_started=experiments.FREE_READ_TRIALS + 1)
    holds = [throttling.slot(throttling.EXPERIMENT_READS, alice.tenant_id)
             for _ in range(throttling.EXPERIMENT_READS.limit)]
    assert all(hold.__enter__() for hold in holds)
    try:
        busy = client.get(f"/api/v1/experiments/{large['id']}/")
        assert busy.status_code == 429 and busy["Retry-After"] == "3"
        assert "large experiments are being answered" in busy.json()["detail"]
        page = logged_in(alice).get(f"/experiments/{large['id']}/")
        assert page.status_code == 429 and b"large experiments are being answered" in page.content
        assert logged_in(alice).get(f"/experiments/{small['id']}/").status_code == 200
        changes = client.get(f"/api/v1/experiments/{large['id']}/", {"changed_after": large["next_changed_after"]})
        assert changes.status_code == 200
        assert client.get(f"/api/v1/experiments/{small['id']}/").status_code == 200
        assert client_for(mallory).get(f"/api/v1/experiments/{theirs['id']}/").status_code == 200
    finally:
        for hold in holds:
            hold.__exit__(None, None, None)
    assert client.get(f"/api/v1/experiments/{large['id']}/").status_code == 200
    assert logged_in(alice).get(f"/experiments/{large['id']}/").status_code == 200
