"""Deleting a job from its page in a real Chromium, served by the test's own server (pytest-django's
live_server) over jobs built in the database: the Delete button shows for an ended job to those who may
delete it, asks first, and lands on the jobs list without the job; a refusal is shown on the page."""
import pytest

from jobs.models import Job, Status
from jobs.states import transition
from tests.support.browser import log_in
from tests.support.builders import job, member, record_sends
from tests.support.pages import WAIT_MS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "delete-pages-1"
SCREENSHOT = "/tmp/delete_button.png"


@pytest.fixture(autouse=True)
def _no_redis(settings):
    """The jobs' status changes publish to the live layer: an in-memory one here."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def person(username, role="researcher"):
    membership = member("team-a", username, role=role)
    membership.user.set_password(PASSWORD)
    membership.user.save()
    return membership


def open_job(server_browser, live_server, username, job_id):
    page = log_in(server_browser, live_server.url, username, PASSWORD, timeout_ms=WAIT_MS)
    page.goto(f"{live_server.url}/jobs/{job_id}/")
    return page


def test_it_deletes_an_ended_job_from_its_page(server_browser, live_server):
    alice = person("alice")
    doomed = job(alice, name="to-delete", status=Status.COMPLETED)
    kept = job(alice, name="to-keep", status=Status.COMPLETED)
    page = open_job(server_browser, live_server, "alice", doomed.id)
    delete = page.get_by_test_id("delete")
    assert delete.is_visible()
    assert "usage records stay" in delete.get_attribute("title")
    page.evaluate("document.activeElement?.blur(); window.scrollTo(0, 0)")
    page.screenshot(path=SCREENSHOT)

    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    delete.click()
    page.wait_for_url(f"{live_server.url}/")
    assert "cannot be undone" in asked[0]
    assert page.locator(f"tr[data-job-id='{kept.id}']").is_visible()
    assert page.locator(f"tr[data-job-id='{doomed.id}']").count() == 0
    doomed.refresh_from_db()
    assert doomed.deleted_at is not None and doomed.deleted_by == "alice"
    assert page.goto(f"{live_server.url}/jobs/{doomed.id}/").status == 404
    page.close()


def test_it_shows_why_the_server_refused_to_delete(server_browser, live_server, monkeypatch):
    record_sends(monkeypatch)
    alice = person("alice")
    halted = job(alice, status=Status.HALTED)
    page = open_job(server_browser, live_server, "alice", halted.id)
    assert page.get_by_test_id("delete").is_visible()
    # Resumed behind the page's back (its websocket is not served here): the page still offers Delete.
    assert transition(halted.id, Status.QUEUED, actor="bob", attempt=halted.attempt)
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("delete").click()
    error = page.get_by_test_id("action-error")
    error.wait_for()
    assert "is QUEUED" in error.inner_text()
    assert page.url == f"{live_server.url}/jobs/{halted.id}/"
    assert Job.objects.get(pk=halted.id).deleted_at is None
    page.close()


def test_a_running_job_and_a_viewer_get_no_delete_button(server_browser, live_server):
    alice = person("alice")
    running = job(alice, status=Status.PROCESSING)
    page = open_job(server_browser, live_server, "alice", running.id)
    page.get_by_test_id("halt").wait_for()  # the page's script has shown the actions a running job has
    assert page.get_by_test_id("delete").count() == 1 and page.get_by_test_id("delete").is_hidden()
    page.close()

    person("victor", role="viewer")
    ended = job(alice, status=Status.COMPLETED)
    page = open_job(server_browser, live_server, "victor", ended.id)
    assert page.get_by_test_id("job-status").inner_text() == "COMPLETED"
    assert page.get_by_test_id("delete").count() == 0
    page.close()


def test_the_usage_page_keeps_a_deleted_jobs_row_marked_without_a_link(server_browser, live_server):
    from datetime import timedelta

    from django.utils import timezone

    from jobs import deletion
    from tenants.models import UsageRecord
    alice = person("alice")
    gone = job(alice, name="deleted-later", status=Status.COMPLETED)
    began = timezone.now() - timedelta(hours=2)
    UsageRecord.objects.create(tenant=gone.tenant, job=gone, user=gone.owner, attempt=1, gpus=2, cpus=1.0,
                               memory_bytes=2**30, started_at=began, ended_at=began + timedelta(hours=1))
    deletion.delete(gone, actor="alice")
    today = timezone.localtime().date()
    page = log_in(server_browser, live_server.url, "alice", PASSWORD, timeout_ms=WAIT_MS)
    page.goto(f"{live_server.url}/tenant/?start={today - timedelta(days=1)}&end={today}")
    page.locator("details:has([data-testid=usage-jobs]) > summary").click()
    row = page.locator(f"[data-testid=usage-jobs] tr[data-job='{gone.id}']")
    assert "(deleted)" in row.inner_text() and row.locator("a").count() == 0
    assert "2.00" in row.inner_text()  # the GPU-hours it held
    row.scroll_into_view_if_needed()
    page.screenshot(path="/tmp/usage_deleted_row.png", full_page=True)
    page.close()
