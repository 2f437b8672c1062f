"""Deleting an experiment from its page in a real Chromium, served by the test's own server (pytest-django's
live_server) over experiments built in the database: the Delete button shows once the experiment has
finished, to those who may control it, asks first, and lands on the experiments list without it, its
trials' jobs deleted with it; a refusal is shown on the page."""
import pytest

from jobs import deletion, experiments
from jobs.models import Experiment, Job, Status, Trial
from jobs.states import transition
from tenants.models import Membership
from tests.support.browser import log_in
from tests.support.builders import member, record_sends, tar_gz, upload
from tests.support.pages import WAIT_MS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "experiment-delete-1"
SCREENSHOT = "/tmp/experiment_delete.png"
MANIFEST = b"""name: %s
cpus: 1
memory: 1GiB
framework: {name: custom, command: "python train.py --lr {{hparams.lr}}"}
hyperparameters:
  lr: {type: categorical, vals: [0.01, 0.1]}
searcher: {name: grid, metric: val_acc, max_trials: 2, max_concurrent_trials: 2}
"""


@pytest.fixture(autouse=True)
def _no_redis(settings, monkeypatch):
    """The jobs' status changes publish to the live layer: an in-memory one here; tasks are recorded."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    record_sends(monkeypatch)


def person(username, role="researcher"):
    membership = member("team-a", username, role=role)
    membership.user.set_password(PASSWORD)
    membership.user.save()
    return membership


def sweep(owner, name):
    """An ACTIVE experiment with its two trials started (their jobs QUEUED)."""
    created = experiments.create(owner, manifest_bytes=MANIFEST % name.encode(),
                                 code_file=upload(tar_gz({"train.py": b"print(1)\n"})))
    experiments.advance(created.id)
    assert Trial.objects.filter(experiment=created).count() == 2
    return created


def complete(experiment):
    """Every trial's job run to COMPLETED, then the pass that finishes the experiment."""
    for job in Job.objects.filter(trial__experiment=experiment):
        for status in (Status.PENDING, Status.PROCESSING, Status.STORING, Status.COMPLETED):
            transition(job.id, status, actor="test", attempt=job.attempt)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert experiment.state == Experiment.State.COMPLETED and experiment.finished_at is not None
    return experiment


def open_experiment(server_browser, live_server, username, experiment_id):
    page = log_in(server_browser, live_server.url, username, PASSWORD, timeout_ms=WAIT_MS)
    page.goto(f"{live_server.url}/experiments/{experiment_id}/")
    page.wait_for_function("() => document.getElementById('experiment-page').dataset.loaded === 'true'")
    return page


def test_it_deletes_a_finished_experiment_with_its_trials_jobs(server_browser, live_server):
    alice = person("alice")
    doomed = complete(sweep(alice, "to-delete"))
    kept = sweep(alice, "to-keep")
    page = open_experiment(server_browser, live_server, "alice", doomed.id)
    delete = page.get_by_test_id("delete")
    assert delete.is_visible()
    assert "usage records stay" in delete.get_attribute("title")
    page.evaluate("document.activeElement?.blur(); window.scrollTo(0, 0)")
    page.screenshot(path=SCREENSHOT)

    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    delete.click()
    page.wait_for_url(f"{live_server.url}/experiments/")
    assert asked[0].startswith(f"Delete experiment {doomed.id} and its 2 trials?")
    assert "cannot be undone" in asked[0]
    assert page.locator(f"tr[data-experiment-id='{kept.id}']").is_visible()
    assert page.locator(f"tr[data-experiment-id='{doomed.id}']").count() == 0
    doomed.refresh_from_db()
    assert doomed.deleted_at is not None and doomed.deleted_by == "alice"
    jobs = Job.objects.filter(trial__experiment=doomed)
    assert jobs.count() == 2 and not jobs.filter(deleted_at=None).exists()
    assert not Job.objects.filter(trial__experiment=kept).exclude(deleted_at=None).exists()
    assert page.goto(f"{live_server.url}/experiments/{doomed.id}/").status == 404
    page.close()


def test_delete_shows_once_the_open_page_sees_the_experiment_finish(server_browser, live_server):
    alice = person("alice")
    running = sweep(alice, "running")
    page = open_experiment(server_browser, live_server, "alice", running.id)
    assert page.get_by_test_id("pause").is_visible()
    assert page.get_by_test_id("delete").count() == 1 and page.get_by_test_id("delete").is_hidden()

    complete(running)
    page.get_by_test_id("delete").wait_for()  # a refresh brought the finished experiment
    assert page.get_by_test_id("experiment-state").inner_text() == "COMPLETED"
    assert page.get_by_test_id("kill").is_hidden()

    # No longer allowed meanwhile (made a viewer): the server's answer is shown, and the page stays.
    Membership.objects.filter(user__username="alice").update(role="viewer")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("delete").click()
    error = page.get_by_test_id("action-error")
    error.wait_for()
    assert "owner and tenant admins can delete it" in error.inner_text(), error.inner_text()
    assert page.url == f"{live_server.url}/experiments/{running.id}/"
    running.refresh_from_db()
    assert running.deleted_at is None
    page.close()


def test_an_open_page_says_its_experiment_was_deleted_elsewhere_and_stops_asking(server_browser, live_server):
    alice = person("alice")
    doomed = complete(sweep(alice, "deleted-elsewhere"))
    page = open_experiment(server_browser, live_server, "alice", doomed.id)
    asked = []
    page.on("request", lambda request: asked.append(request.url) if f"/experiments/{doomed.id}/" in request.url else None)
    deletion.delete_experiment(doomed, actor="bob")  # elsewhere: a script, another tab
    page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
    notice = page.get_by_test_id("experiment-deleted")
    notice.wait_for(timeout=WAIT_MS)
    assert "This experiment was deleted." in notice.inner_text() and "no longer follows it" in notice.inner_text()
    assert page.get_by_test_id("connection").get_attribute("data-state") == "deleted"
    assert page.get_by_test_id("delete").is_hidden()
    assert page.title().startswith("deleted · ")
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path="/tmp/experiment_deleted_meanwhile.png")
    seen = len(asked)
    page.wait_for_timeout(7000)  # past two of the page's refreshes
    assert len(asked) == seen, asked[seen:]  # it asks no more
    page.close()


def test_a_viewer_gets_no_delete_button(server_browser, live_server):
    alice = person("alice")
    finished = complete(sweep(alice, "finished"))
    person("victor", role="viewer")
    page = open_experiment(server_browser, live_server, "victor", finished.id)
    assert page.get_by_test_id("experiment-state").inner_text() == "COMPLETED"
    assert page.get_by_test_id("delete").count() == 0
    assert page.get_by_test_id("kill").count() == 0
    page.close()
