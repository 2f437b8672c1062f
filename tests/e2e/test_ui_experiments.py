"""An experiment's page in a real Chromium, served by the test's own server (pytest-django's live_server)
over an experiment built in the database: trials started by the searcher's pass, their jobs moved as a
backend would move them, their metric points written as ingest writes them. The page shows the trials,
sorts and filters them, marks the best, charts the metric per trial, draws the parallel coordinates,
follows the experiment while it runs, opens Compare with the ticked trials' jobs, and pauses it."""
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import experiments
from jobs.models import MetricPoint, Status, Trial
from jobs.states import transition
from tests.support.builders import member, record_sends, tar_gz, upload
from tests.support.browser import log_in
from tests.support.pages import SCREENSHOTS, WAIT_MS, shoot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "experiment-pages-1"
MANIFEST = b"""name: digits-sweep
cpus: 1
memory: 1GiB
framework: {name: custom, command: "python train.py --lr {{hparams.lr}} --width {{hparams.width}}"}
hyperparameters:
  lr: {type: log, minval: 0.001, maxval: 0.1, count: 3}
  width: {type: categorical, vals: [16, 64]}
  epochs: 8
searcher: {name: grid, metric: val_acc, max_trials: 6, max_concurrent_trials: 6}
"""
STEPS = 8


def accuracy(params, step):
    """A made-up learning curve: wider does better, a middling learning rate best, a high one fastest."""
    ceiling = 0.55 + 0.2 * (params["width"] == 64) + {0.001: 0.0, 0.01: 0.15, 0.1: 0.07}[params["lr"]]
    rate = {0.001: 0.3, 0.01: 0.45, 0.1: 0.65}[params["lr"]]
    return round(ceiling * (1 - (1 - rate) ** step), 4)


@pytest.fixture(autouse=True)
def _no_redis(settings):
    """The jobs' status changes publish to the live layer: an in-memory one here (no Redis runs)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def run_to(job, *statuses):
    for status in statuses:
        transition(job.id, status, actor="test", attempt=job.attempt)


def report(trial, steps):
    """The trial's points, a minute of training apart (the trials ran side by side an hour ago)."""
    start = timezone.now() - timedelta(hours=1) + timedelta(seconds=10 * trial.number)
    MetricPoint.objects.bulk_create([
        MetricPoint(job=trial.job, attempt=1, name="val_acc", step=step, value=accuracy(trial.params, step),
                    time=start + timedelta(minutes=step)) for step in steps])


@pytest.fixture
def experiment(monkeypatch):
    """Six trials: four completed, one still running at step 3 (trial 5), one failed at step 2 (trial 4)."""
    record_sends(monkeypatch)
    alice = member("team-a", "alice")
    alice.user.set_password(PASSWORD)
    alice.user.save()
    created = experiments.create(alice, manifest_bytes=MANIFEST, code_file=upload(tar_gz({"train.py": b"print(1)\n"})))
    for _ in range(2):  # a pass starts a few new trials (experiments.NEW_TRIALS_PER_PASS)
        experiments.advance(created.id)
    trials = list(Trial.objects.filter(experiment=created).select_related("job").order_by("number"))
    assert len(trials) == 6
    for trial in trials[:4]:
        run_to(trial.job, Status.PENDING, Status.PROCESSING, Status.STORING)
        report(trial, range(1, STEPS + 1))
        run_to(trial.job, Status.COMPLETED)
    run_to(trials[4].job, Status.PENDING, Status.PROCESSING)
    report(trials[4], range(1, 3))
    run_to(trials[4].job, Status.FAILED)
    run_to(trials[5].job, Status.PENDING, Status.PROCESSING)
    report(trials[5], range(1, 4))
    experiments.advance(created.id)
    created.refresh_from_db()
    return created


def expected_best(experiment):
    finals = {t.number: t.value for t in Trial.objects.filter(experiment=experiment)}
    return max((n for n in finals if finals[n] is not None), key=finals.get)


def wait_state(page, state):
    page.wait_for_function("s => document.querySelector('[data-testid=experiment-state]').dataset.state === s",
                           arg=state)


def visible_numbers(page):
    rows = page.locator("[data-testid=trial-row]:visible")
    return rows.evaluate_all("rows => rows.map(r => Number(r.dataset.number))")


def test_the_experiment_page_shows_sorts_charts_and_follows_the_trials(experiment, server_browser, live_server):
    best = expected_best(experiment)
    assert experiment.best_trial == best
    page = log_in(server_browser, live_server.url, "alice", PASSWORD, timeout_ms=WAIT_MS)
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # The jobs page, where logging in lands, opens a websocket, which this server (WSGI) does not serve.
    page.on("console", lambda message: message.type == "error" and "WebSocket" not in message.text
            and errors.append(message.text))

    page.get_by_role("link", name="Experiments").click()
    page.wait_for_url(f"{live_server.url}/experiments/")
    assert page.locator(f"tr[data-experiment-id='{experiment.id}'] [data-testid=trials]").inner_text() == "6 / 6"
    shoot(page, "experiment-list.png")
    page.get_by_role("link", name="digits-sweep").click()
    page.wait_for_url(f"{live_server.url}/experiments/{experiment.id}/")
    page.wait_for_function("() => document.getElementById('experiment-page').dataset.loaded === 'true'")

    # The table: every trial, the best marked and linked from the header.
    assert visible_numbers(page) == [0, 1, 2, 3, 4, 5]
    assert page.locator("tr.is-best").get_attribute("data-number") == str(best)
    assert page.locator("tr.is-best [data-testid=best-badge]").text_content() == "best"
    best_job = Trial.objects.get(experiment=experiment, number=best).job_id
    assert page.get_by_test_id("best-trial-link").get_attribute("href") == f"/jobs/{best_job}/"
    assert page.locator("[data-testid=hp-column]").all_text_contents() == ["lr", "width"]
    assert page.locator("tr[data-number='4'] [data-testid=trial-state]").inner_text() == "failed"

    # Sorting: the metric's header puts the best first (higher is better here), again reverses it with the
    # trials without a value last either way; the lr header sorts by value, not by text.
    page.get_by_test_id("sort-value").click()
    by_metric = visible_numbers(page)
    values = {t.number: t.value for t in Trial.objects.filter(experiment=experiment)}
    assert by_metric == sorted(values, key=lambda n: -values[n])
    assert page.locator("th[aria-sort=descending]").count() == 1
    page.get_by_test_id("sort-value").click()
    assert visible_numbers(page) == sorted(values, key=lambda n: values[n])
    page.get_by_test_id("sort-hp-lr").click()
    lrs = page.locator("[data-testid=trial-row] td[data-key=hp]:nth-child(5)").all_inner_texts()
    assert [float(v) for v in lrs] == sorted(float(v) for v in lrs)

    # Filtering by state.
    page.get_by_test_id("trial-filter").select_option("completed")
    assert sorted(visible_numbers(page)) == [0, 1, 2, 3]
    page.get_by_test_id("trial-filter").select_option("")
    assert len(visible_numbers(page)) == 6

    # The charts: one line per trial on the metric's chart, the best so far, the parallel coordinates.
    chart = page.locator("[data-testid=trial-charts] [data-testid=chart][data-metric=val_acc]")
    assert chart.get_attribute("data-series-count") == "6"
    assert chart.get_attribute("data-point-count") == str(4 * STEPS + 2 + 3)
    assert f"trial {best} (best)" in chart.locator(".u-legend").inner_text()
    assert page.get_by_test_id("best-chart").is_visible()
    assert page.get_by_test_id("best-so-far").inner_text() == str(max(v for v in values.values() if v is not None))
    assert page.get_by_test_id("parallel").get_attribute("data-line-count") == "6"
    assert page.locator(".parallel-line.is-best").count() == 1
    page.locator("tr[data-number='4']").hover()
    assert page.locator(".parallel-line.is-highlighted").get_attribute("data-number") == "4"
    page.mouse.move(0, 0)
    page.get_by_test_id("sort-number").click()
    shoot(page, "experiment-page-top.png")
    page.screenshot(path=str(SCREENSHOTS / "experiment-page.png"), full_page=True)

    # Live: the running trial reports more and finishes best; the page follows without a reload.
    running = Trial.objects.select_related("job").get(experiment=experiment, number=5)
    MetricPoint.objects.create(job=running.job, attempt=1, name="val_acc", step=4, value=0.99, time=timezone.now())
    run_to(running.job, Status.STORING, Status.COMPLETED)
    experiments.advance(experiment.id)
    page.wait_for_selector("[data-testid=connection][data-state=ended]")  # its last refresh drawn: it completed
    assert page.get_by_test_id("experiment-state").inner_text() == "COMPLETED"
    assert page.locator("tr.is-best").get_attribute("data-number") == "5"
    assert page.locator("tr[data-number='5'] [data-testid=trial-state]").inner_text() == "completed"
    assert page.get_by_test_id("best-so-far").inner_text() == "0.99"
    assert chart.get_attribute("data-point-count") == str(4 * STEPS + 2 + 4)
    assert page.get_by_test_id("kill").is_hidden()  # a completed experiment is not killed

    # Compare: two ticked trials open the compare page with their jobs.
    compare = page.get_by_test_id("compare")
    assert compare.is_disabled()
    jobs = [Trial.objects.get(experiment=experiment, number=n).job_id for n in (best, 5)]
    for job_id in jobs:
        page.locator(f"tr[data-job-id='{job_id}'] [data-testid=select-trial]").check()
    assert compare.inner_text() == "Compare (2)"
    compare.click()
    page.wait_for_url(re.compile(re.escape(f"{live_server.url}/jobs/compare/?")))
    assert sorted(page.locator("[data-testid=compare-table] th[data-job-id]").evaluate_all(
        "ths => ths.map(th => th.dataset.jobId)")) == sorted(jobs)
    assert errors == []
    page.close()


def test_pause_resume_and_kill_from_the_page_in_a_browser(server_browser, live_server, monkeypatch):
    record_sends(monkeypatch)
    alice = member("team-a", "alice")
    alice.user.set_password(PASSWORD)
    alice.user.save()
    created = experiments.create(alice, manifest_bytes=MANIFEST, code_file=upload(tar_gz({"train.py": b"print(1)\n"})))
    page = log_in(server_browser, live_server.url, "alice", PASSWORD, timeout_ms=WAIT_MS)
    page.goto(f"{live_server.url}/experiments/new/")
    page.get_by_test_id("example").select_option("pytorch-digits")  # the page comes back with its manifest
    page.wait_for_url(f"{live_server.url}/experiments/new/?example=pytorch-digits")
    assert "name: pytorch-digits-sweep" in page.get_by_test_id("manifest").input_value()
    shoot(page, "experiment-new.png")
    page.goto(f"{live_server.url}/experiments/{created.id}/")
    assert page.get_by_test_id("trials-empty").is_visible()
    for _ in range(2):  # the loop's passes start the trials, a few a pass: the open page shows them
        experiments.advance(created.id)
    page.wait_for_function("() => document.querySelectorAll('[data-testid=trial-row]').length === 6")
    assert page.get_by_test_id("trials-empty").is_hidden()
    assert page.locator("tr[data-number='0'] [data-testid=trial-state]").inner_text() == "running"
    assert page.locator("tr[data-number='0'] [data-testid=job-status]").inner_text() == "QUEUED"
    assert page.get_by_test_id("parallel").get_attribute("data-line-count") == "6"  # no values yet: dashed
    page.get_by_test_id("pause").click()
    wait_state(page, "PAUSED")
    assert page.get_by_test_id("experiment-reason").inner_text() == "paused by alice"
    assert page.get_by_test_id("pause").is_hidden()
    page.get_by_test_id("resume").click()
    wait_state(page, "ACTIVE")
    page.once("dialog", lambda dialog: dialog.accept())  # Kill asks first
    page.get_by_test_id("kill").click()
    wait_state(page, "TERMINATED")
    assert page.locator("[data-testid=trial-state]").all_inner_texts() == ["stopped"] * 6
    page.close()
