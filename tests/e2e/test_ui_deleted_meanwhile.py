"""A job deleted while its pages are open, in a real Chromium against the real platform: the jobs list
drops its row, and its own page says it was deleted and stops following it, without a reload."""
import pytest

from tests.support.pages import CONNECTED, log_in, shoot

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

QUICK = """name: deleted-meanwhile
cpus: 0.5
memory: 256MiB
framework: {name: custom, command: env STEPS=1 bash run.sh}
"""
LIST_LIVE = "[data-testid=connection][data-state=live]"


def job_count(page):
    return int(page.get_by_test_id("job-count").inner_text().split()[0])


def test_the_list_drops_the_row_and_the_job_page_says_it_was_deleted(browser, live_platform):
    doomed, kept = (live_platform.submit("custom-shell", manifest_text=QUICK)["id"] for _ in range(2))
    for job_id in (doomed, kept):
        assert live_platform.wait_for(job_id)["status"] == "COMPLETED"
    listing = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    listing.wait_for_selector(f"tr[data-job-id='{doomed}']")
    listing.wait_for_selector(LIST_LIVE)
    jobs_before = job_count(listing)

    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    sockets = []
    page.on("websocket", lambda socket: sockets.append(socket.url) if f"/ws/jobs/{doomed}/" in socket.url else None)
    page.goto(f"{live_platform.url}/jobs/{doomed}/")
    page.wait_for_selector(CONNECTED)

    response = live_platform.api("DELETE", f"/api/v1/jobs/{doomed}/")  # elsewhere: a script, another tab
    assert response.status_code == 202, response.text

    listing.wait_for_function("id => !document.querySelector(`tr[data-job-id='${id}']`)", arg=doomed)
    assert listing.locator(f"tr[data-job-id='{kept}']").is_visible()
    assert job_count(listing) == jobs_before - 1
    shoot(listing, "jobs-after-a-deletion.png")

    notice = page.get_by_test_id("job-deleted")
    notice.wait_for()
    assert "This job was deleted at " in notice.inner_text() and "no longer follows it" in notice.inner_text()
    assert page.get_by_test_id("connection").get_attribute("data-state") == "deleted"
    assert page.get_by_test_id("delete").is_hidden() and page.get_by_test_id("clone").is_hidden()
    assert page.title().startswith("deleted · ")
    page.wait_for_timeout(3000)  # past the page's first reconnect delay (LiveSocket's minDelay)
    assert len(sockets) == 1, sockets  # followed no more: its socket not opened again
    shoot(page, "job-deleted-meanwhile.png")
    for opened in (listing, page):
        opened.close()
