"""The experiments pages: the tenant's experiments, the form for a new one (its errors naming the field),
one experiment's page with its trials, the best one marked, and Pause/Resume/Kill as forms only for those
who may control it; another tenant's experiment is a 404 on every page."""
import html
import json
import re

import pytest
from django.utils import timezone

from jobs import experiments
from jobs.models import Experiment, MetricPoint, Trial
from tests.support.builders import logged_in, member, record_sends, tar_gz, upload

pytestmark = pytest.mark.django_db

MANIFEST = """name: sweep
cpus: 1
memory: 1GiB
framework: {name: custom, command: "python train.py --lr {{hparams.lr}} --width {{hparams.width}}"}
checkpoint: {signal: SIGTERM, grace_seconds: 5}
hyperparameters:
  lr: {type: log, minval: 0.001, maxval: 0.1, count: 3}
  width: {type: categorical, vals: [8, 16, 32]}
  epochs: 9
searcher: %s
"""
GRID = {"name": "grid", "metric": "val_acc", "max_trials": 9, "max_concurrent_trials": 3}
ASHA = {"name": "asha", "metric": "loss", "smaller_is_better": True, "max_trials": 9, "max_concurrent_trials": 3,
        "max_length": 9, "divisor": 3}


@pytest.fixture
def alice(monkeypatch):
    record_sends(monkeypatch)
    return member("team-a", "alice")


def create(membership, searcher=GRID, **kwargs):
    return experiments.create(membership, manifest_bytes=(MANIFEST % json.dumps(searcher)).encode(),
                              code_file=upload(tar_gz({"train.py": b"print(1)\n"})), **kwargs)


def started(membership, searcher=GRID, **kwargs):
    """An experiment whose first trials the loop's pass has started."""
    experiment = create(membership, searcher, **kwargs)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    return experiment


def report(trial, step, value, name="val_acc"):
    MetricPoint.objects.create(job=trial.job, attempt=1, name=name, step=step, value=value, time=timezone.now())


def text_of(response):
    return html.unescape(response.content.decode())


def row_of(page, number):
    match = re.search(rf'<tr data-number="{number}".*?</tr>', page, re.S)
    assert match, f"no row for trial {number}"
    return match.group(0)


# --- the list ---------------------------------------------------------------------------------------
def test_it_lists_the_tenants_experiments_with_their_progress(alice):
    mine = started(alice)
    Experiment.objects.filter(pk=mine.pk).update(best_trial=2, best_value=0.875)
    bob = member("team-a", "bob")
    hidden = create(bob, private=True)
    other = create(member("team-b", "carol"))
    page = text_of(logged_in(alice).get("/experiments/"))
    row = re.search(rf'<tr data-experiment-id="{mine.id}".*?</tr>', page, re.S).group(0)
    assert f'<a href="/experiments/{mine.id}/">sweep</a>' in row
    for shown in (">ACTIVE<", "<td>grid</td>", '<span class="mono">val_acc</span>', "3 / 9", "0.875", "#2", "alice"):
        assert shown in row, shown
    assert hidden.id not in page and other.id not in page  # bob's private one, another tenant's
    assert "1 experiment" in page


def test_it_filters_the_list_by_state(alice):
    active, paused = create(alice), create(alice)
    experiments.pause(paused, actor="alice")
    page = text_of(logged_in(alice).get("/experiments/", {"state": "paused"}))
    assert paused.id in page and active.id not in page


def test_the_navigation_links_the_experiments_page_beside_jobs(alice):
    page = text_of(logged_in(alice).get("/experiments/"))
    nav = re.search(r'<nav class="topnav".*?</nav>', page, re.S).group(0)
    assert re.search(r'>Jobs</a>\s*<a href="/experiments/" aria-current="page">Experiments</a>', nav)


def test_with_none_it_says_how_to_start_one(alice):
    page = text_of(logged_in(alice).get("/experiments/"))
    assert 'data-testid="experiments-empty"' in page and 'href="/experiments/new/"' in page


# --- tenancy ----------------------------------------------------------------------------------------
def test_another_tenants_experiment_is_a_404_on_every_page(alice):
    theirs = started(member("team-b", "carol"))
    client = logged_in(alice)
    assert client.get(f"/experiments/{theirs.id}/").status_code == 404
    for action in ("pause", "resume", "kill"):
        assert client.post(f"/experiments/{theirs.id}/{action}/").status_code == 404
    theirs.refresh_from_db()
    assert theirs.state == Experiment.State.ACTIVE


def test_someone_elses_private_experiment_is_a_404(alice):
    private = create(member("team-a", "bob"), private=True)
    assert logged_in(alice).get(f"/experiments/{private.id}/").status_code == 404
    assert logged_in(member("team-a", "root", role="admin")).get(f"/experiments/{private.id}/").status_code == 200


# --- one experiment ---------------------------------------------------------------------------------
def test_it_shows_the_trials_with_their_hyperparameters_and_metric_and_marks_the_best(alice):
    experiment = started(alice)
    trials = list(Trial.objects.filter(experiment=experiment).select_related("job"))
    for trial, value in zip(trials, (0.5, 0.9, 0.7)):
        report(trial, 4, value)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert experiment.best_trial == 1
    page = text_of(logged_in(alice).get(f"/experiments/{experiment.id}/"))

    assert f'<h1>{experiment.name}</h1>' in page and "↑ higher is better" in page
    heads = re.findall(r'data-testid="hp-column"[^>]*>([^<]+)</th>', page)
    assert heads == ["lr", "width"]  # the varied ones; the constant is in the search space
    best = trials[1]
    assert f'<a href="/jobs/{best.job_id}/" data-testid="best-trial-link">trial 1</a>' in page
    row = row_of(page, 1)
    assert 'class="is-best"' in row and 'data-testid="best-badge"' in row
    assert f'<a class="mono" href="/jobs/{best.job_id}/">{best.job_id}</a>' in row
    assert f'data-value="{best.params["lr"]!r}">' in row and f'>{best.params["width"]}</td>' in row
    assert 'data-key="value" data-value="0.9">0.9</td>' in row and 'data-key="step" data-value="4">4</td>' in row
    assert 'class="is-best"' not in row_of(page, 0)
    assert f'name="ids" value="{trials[0].job_id}"' in page and 'action="/jobs/compare/"' in page
    assert '<option value="running">running (3)</option>' in page
    assert "epochs" in page and "constant" in page  # the search space
    assert 'Rung' not in page  # not ASHA


def test_an_asha_experiment_shows_the_rungs_its_trials_reached(alice):
    experiment = started(alice, ASHA)
    trial = Trial.objects.filter(experiment=experiment).first()
    Trial.objects.filter(pk=trial.pk).update(rungs={"0": 0.4, "1": 0.3}, value=0.3, step=3)
    page = text_of(logged_in(alice).get(f"/experiments/{experiment.id}/"))
    assert "↓ lower is better" in page and "rungs at steps 1, 3, 9" in page
    assert 'title="step 1: 0.4 · step 3: 0.3">2 / 3</td>' in row_of(page, trial.number)


def test_the_experiments_own_metric_names_the_charts(alice):
    experiment = started(alice)
    page = text_of(logged_in(alice).get(f"/experiments/{experiment.id}/"))
    for testid in ("trial-charts", "best-chart", "parallel", "trials-table"):
        assert f'data-testid="{testid}"' in page
    assert 'data-metric="val_acc"' in page and "js/experiment.js" in page and "js/parallel.js" in page


# --- pause, resume, kill ----------------------------------------------------------------------------
def test_the_owner_pauses_resumes_and_kills_it_with_the_pages_forms(alice):
    experiment = started(alice)
    client = logged_in(alice)
    page = text_of(client.get(f"/experiments/{experiment.id}/"))
    assert re.search(rf'<form method="post" action="/experiments/{experiment.id}/pause/" data-action="pause"\s*>', page)
    assert re.search(r'data-action="resume"\s*hidden>', page)
    assert "csrfmiddlewaretoken" in page

    for action, state in (("pause", "PAUSED"), ("resume", "ACTIVE"), ("kill", "TERMINATED")):
        response = client.post(f"/experiments/{experiment.id}/{action}/")
        assert response.status_code == 302 and response["Location"] == f"/experiments/{experiment.id}/"
        experiment.refresh_from_db()
        assert experiment.state == state, action
    assert experiment.state_reason == "killed by alice"
    assert all(t.state == Trial.State.STOPPED for t in experiment.trials.all())
    page = text_of(client.get(f"/experiments/{experiment.id}/"))
    assert re.search(r'data-action="kill"\s*data-confirm="[^"]*"\s*hidden>', page)


def test_an_action_the_state_does_not_allow_is_shown_with_the_reason(alice):
    experiment = started(alice)
    response = logged_in(alice).post(f"/experiments/{experiment.id}/resume/")
    assert response.status_code == 409
    assert re.search(r'data-testid="action-error"[^>]*>experiment exp-\S+ is ACTIVE; only an experiment that is PAUSED',
                     text_of(response))


def test_a_viewer_sees_no_buttons_and_is_refused(alice):
    experiment = started(alice)
    viewer = logged_in(member("team-a", "vic", role="viewer"))
    page = text_of(viewer.get(f"/experiments/{experiment.id}/"))
    assert "data-action=" not in page
    response = viewer.post(f"/experiments/{experiment.id}/pause/")
    assert response.status_code == 403 and "owner and tenant admins" in text_of(response)
    experiment.refresh_from_db()
    assert experiment.state == Experiment.State.ACTIVE


def test_another_researcher_is_refused_and_a_tenant_admin_may(alice):
    experiment = started(alice)
    assert logged_in(member("team-a", "bob")).post(f"/experiments/{experiment.id}/pause/").status_code == 403
    admin = logged_in(member("team-a", "root", role="admin"))
    assert admin.post(f"/experiments/{experiment.id}/pause/").status_code == 302
    experiment.refresh_from_db()
    assert experiment.state_reason == "paused by root"


def test_an_action_needs_a_post(alice):
    experiment = started(alice)
    assert logged_in(alice).get(f"/experiments/{experiment.id}/kill/").status_code == 405


# --- a new one --------------------------------------------------------------------------------------
def test_the_form_starts_an_experiment_and_opens_its_page(alice):
    response = logged_in(alice).post("/experiments/new/", {
        "manifest": MANIFEST % json.dumps(GRID), "code": upload(tar_gz({"train.py": b"print(1)\n"})), "private": "1"})
    experiment = Experiment.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/experiments/{experiment.id}/"
    assert experiment.owner == alice.user and experiment.private and experiment.searcher == "grid"


def test_a_manifest_file_replaces_the_text(alice):
    response = logged_in(alice).post("/experiments/new/", {
        "manifest": "not: used", "manifest_file": upload((MANIFEST % json.dumps(GRID)).encode(), "experiment.yml"),
        "code": upload(tar_gz({"train.py": b"print(1)\n"}))})
    assert response.status_code == 302 and Experiment.objects.get().name == "sweep"


def test_the_form_shows_a_manifest_error_naming_the_field_and_keeps_the_text(alice):
    text = MANIFEST % json.dumps({"name": "grid", "max_trials": 4})
    response = logged_in(alice).post("/experiments/new/", {"manifest": text,
                                                           "code": upload(tar_gz({"train.py": b"1"}))})
    page = text_of(response)
    assert response.status_code == 400
    assert re.search(r'<strong data-testid="error-field">searcher.metric</strong> — \S', page)
    assert 'aria-invalid="true"' in page and '"max_trials": 4' in page
    assert not Experiment.objects.exists()


def test_the_form_shows_a_missing_code_archive_at_its_field(alice):
    response = logged_in(alice).post("/experiments/new/", {"manifest": MANIFEST % json.dumps(GRID)})
    assert response.status_code == 400
    assert 'data-testid="code-error">a code archive (zip or tar.gz) is required</p>' in text_of(response)


def test_an_example_fills_the_form_and_brings_its_code(alice):
    client = logged_in(alice)
    page = text_of(client.get("/experiments/new/", {"example": "pytorch-digits"}))
    assert "name: pytorch-digits-sweep" in page and '<option value="pytorch-digits" selected>' in page
    text = re.search(r'data-testid="manifest"[^>]*>(.*?)</textarea>', page, re.S).group(1)
    response = client.post("/experiments/new/", {"manifest": text, "example": "pytorch-digits"})
    assert response.status_code == 302 and Experiment.objects.get().name == "pytorch-digits-sweep"


def test_a_viewer_cannot_start_one(alice):
    viewer = logged_in(member("team-a", "vic", role="viewer"))
    page = text_of(viewer.get("/experiments/new/"))
    assert "cannot start experiments" in page and re.search(r'data-testid="submit"\s*disabled', page)
    response = viewer.post("/experiments/new/", {"manifest": MANIFEST % json.dumps(GRID),
                                                 "code": upload(tar_gz({"train.py": b"1"}))})
    assert response.status_code == 403 and 'data-testid="submit-error"' in text_of(response)
    assert not Experiment.objects.exists()
