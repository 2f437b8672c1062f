"""The dashboard in a real Chromium against the real platform: a researcher submits the PyTorch
example through the form and watches, halts and resumes it live; another tenant sees none of it."""
import re

import pytest

from tests.support.harness import EXAMPLES
from tests.support.pages import log_in, number, shoot, wait_more, wait_status

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

LOSS_CHART = "[data-testid=chart][data-metric='train.loss']"


def submit_the_pytorch_example(page, url):
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Submit").click()
    page.get_by_label("Start from an example").select_option("pytorch-digits")
    status = page.locator("[data-testid=manifest-status]")
    page.wait_for_function("() => document.querySelector('[data-testid=manifest-status]').dataset.state === 'valid'")
    manifest = page.locator("[data-testid=manifest]").input_value()
    # A typo is caught as it is typed, with the API's own message...
    page.locator("[data-testid=manifest]").fill(manifest.replace("memory: 2GiB", "memory: 2XB"))
    page.wait_for_function("() => document.querySelector('[data-testid=manifest-status]').dataset.state === 'invalid'")
    assert "memory — memory: '2XB' is not a memory size" in status.inner_text()
    # ...and a longer run leaves time to halt it mid-training.
    page.locator("[data-testid=manifest]").fill(manifest.replace("--epochs 8", "--epochs 40"))
    page.wait_for_function("() => document.querySelector('[data-testid=manifest-status]').dataset.state === 'valid'")
    assert page.locator("[data-fact=framework]").inner_text().startswith("pytorch")
    assert page.locator("[data-left=gpus]").inner_text() != "…"  # the tenant's quota is shown beside it
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url(re.compile(re.escape(url) + r"/jobs/training-[a-z0-9]+/$"))
    return page.url.rstrip("/").rsplit("/", 1)[1]


def test_a_researcher_submits_watches_halts_and_resumes_the_pytorch_example(browser, live_platform):
    url = live_platform.url
    # A quota to show beside the form and on the usage page (the limits leave room for everything here).
    live_platform.manage("tenant", "create", live_platform.tenant, "--cpus", "6", "--memory", "16GiB", "--jobs", "5",
                         "--cpu-hours", "50")
    others = [live_platform.submit(example)["id"] for example in ("custom-shell", "failing")]  # company on the list
    page = log_in(browser, url, live_platform.username, live_platform.password)
    page.on("dialog", lambda dialog: dialog.accept())  # halt and terminate ask first
    job_id = submit_the_pytorch_example(page, url)

    wait_status(page, "PROCESSING")  # pushed over the websocket: the page never reloads
    lines = wait_more(page, "[data-testid=log]", "data-line-count", 0)
    points = wait_more(page, LOSS_CHART, "data-point-count", 0)
    assert wait_more(page, LOSS_CHART, "data-point-count", points) > points  # the loss chart grows live
    assert number(page, "[data-testid=log]", "data-line-count") > lines  # and so does the log
    assert "epoch 1/40 loss" in page.locator("[data-testid=log]").inner_text()

    page.get_by_role("button", name="Halt").click()
    wait_status(page, "HALTED")
    assert page.get_by_role("button", name="Halt").is_hidden()
    assert page.get_by_role("button", name="Resume").is_visible()
    page.wait_for_function("() => document.querySelector('[data-testid=artifacts]').innerText.includes('partial')")
    halted_points = number(page, LOSS_CHART, "data-point-count")

    page.get_by_role("button", name="Resume").click()
    page.wait_for_function("() => document.querySelector('[data-field=attempt]').textContent.trim() === '2'")
    assert wait_more(page, LOSS_CHART, "data-point-count", halted_points) > halted_points  # the chart continues
    assert number(page, LOSS_CHART, "data-series-count") == 2  # attempt 2 drawn beside attempt 1
    page.wait_for_function("() => document.querySelector('[data-testid=timeline]').innerText.includes('HALTED')")
    page.locator("[data-testid=log-search]").fill("resuming from")
    page.wait_for_function(
        "() => document.querySelector('[data-testid=log-search-count]').textContent.startsWith('1/')")
    page.locator("[data-testid=log-search]").fill("")
    page.get_by_label("Follow").check()  # searching paused following; the reader turns it back on
    wait_more(page, LOSS_CHART, "data-point-count", halted_points + 3)
    shoot(page, "job-page.png")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Jobs").click()
    row = page.locator(f"tr[data-job-id='{job_id}']")
    assert "pytorch" in row.inner_text()
    page.get_by_label("Status", exact=True).select_option("HALTED")  # htmx swaps the results in place
    page.wait_for_function("id => !document.querySelector(`tr[data-job-id='${id}']`)", arg=job_id)
    page.get_by_label("Status", exact=True).select_option("")
    page.wait_for_selector(f"tr[data-job-id='{job_id}']")
    for other in others:
        live_platform.wait_for(other)
    page.wait_for_function("ids => ids.every(id => document.querySelector(`tr[data-job-id='${id}'] [data-status]`)"
                           ".dataset.status.match(/COMPLETED|FAILED/))", arg=others)
    shoot(page, "job-list.png")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Usage").click()
    page.wait_for_selector("[data-testid=quota-bars] [data-quota=cpus] [aria-valuenow='1']")  # its one CPU, of 6
    shoot(page, "tenant-page.png")

    page.goto(f"{url}/jobs/{job_id}/")
    page.get_by_role("button", name="Terminate").click()  # confirms, then stops it for good
    wait_status(page, "TERMINATED")
    assert page.get_by_role("button", name="Resume").is_hidden()
    live_platform.wait_for(job_id, timeout=60)


def test_the_job_page_lists_a_jobs_files_a_page_at_a_time(browser, live_platform):
    manifest = (EXAMPLES / "custom-shell" / "manifest.yml").read_text().replace(
        "command: bash run.sh", "command: 'for i in $(seq 1 250); do : > $RESULT_DIR/part-$i; done'")
    job = live_platform.submit("custom-shell", manifest_text=manifest)
    assert live_platform.wait_for(job["id"])["status"] == "COMPLETED"
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    rows = "n => document.querySelector('[data-testid=artifacts]').tBodies[0].rows.length === n"
    # The first page of results (200 of 250) and of checkpoints and logs (the log): 251 files in all.
    page.wait_for_function(rows, arg=201)
    more = page.get_by_role("button", name="Show more files")
    assert page.locator("[data-testid=artifacts-count]").inner_text() == "201 of 251 files"
    first, last = page.evaluate("() => { const r = document.querySelector('[data-testid=artifacts]').tBodies[0].rows;"
                                " return [r[0].cells[1].textContent, r[r.length - 1].cells[1].textContent]; }")
    assert (first, last) == ("result", "log")  # results first, though logs/ sorts before results/ by name
    more.click()
    page.wait_for_function(rows, arg=251)
    assert more.is_hidden() and page.locator("[data-testid=artifacts-count]").inner_text() == ""


def test_another_tenant_sees_none_of_it(browser, live_platform):
    job = live_platform.submit("failing")
    live_platform.manage("tenant", "create", "team-b")
    live_platform.manage("tenant", "adduser", "team-b", "mallory", "--password", "mallory-password")
    page = log_in(browser, live_platform.url, "mallory", "mallory-password")
    assert page.locator("[data-testid=jobs-empty]").is_visible()
    assert job["id"] not in page.content()
    assert page.goto(f"{live_platform.url}/jobs/{job['id']}/").status == 404
    assert page.goto(f"{live_platform.url}/jobs/{job['id']}/log.txt").status == 404
    closed = page.evaluate("""url => new Promise(resolve => {
        const ws = new WebSocket(url);
        ws.onmessage = () => resolve('got data');
        ws.onclose = event => resolve(event.code);
    })""", f"ws://127.0.0.1:{live_platform.platform.port}/ws/jobs/{job['id']}/")
    assert closed == 4404
    api = page.evaluate("fetch('/api/v1/jobs/').then(r => r.json())")
    assert api["count"] == 0
