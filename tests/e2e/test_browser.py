"""The job page in a real Chromium: log lines and the loss chart update live over the websocket."""
import os
import shutil
from pathlib import Path

import pytest

from conftest import skip_or_fail

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

CHROMIUM = os.environ.get("TRAINYARD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(os.environ.get("TRAINYARD_SCREENSHOTS", "/tmp/trainyard-screenshots"))

SLOW_TRAINER = """
name: slow-trainer
cpus: 1
memory: 512MiB
framework:
  name: custom
  command: |
    python3 -c "import time, json
    for step in range(1, 41):
        print(f'step {step} loss {1 / step:.4f}', flush=True)
        print('TRAINYARD_METRIC ' + json.dumps({'name': 'loss', 'value': 1 / step, 'step': step}), flush=True)
        time.sleep(0.15)"
"""


@pytest.fixture(scope="module")
def browser():
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        skip_or_fail(f"Chromium not found at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("playwright is not installed")
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


def logged_in_page(browser, live_platform):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(live_platform.url + "/login/")
    page.fill("input[name=username]", live_platform.username)
    page.fill("input[name=password]", live_platform.password)
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_url(live_platform.url + "/")
    return page


def count(page, testid, attribute):
    return int(page.get_attribute(f"[data-testid={testid}]", attribute) or 0)


def test_the_job_page_follows_logs_and_the_loss_curve_live(browser, live_platform):
    job = live_platform.submit("custom-shell", manifest_text=SLOW_TRAINER)
    page = logged_in_page(browser, live_platform)  # after submitting: the list page reloads for new jobs
    page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    page.wait_for_function("document.querySelector('[data-testid=log]').dataset.lineCount > 0", timeout=30000)
    early_lines, early_points = count(page, "log", "data-line-count"), count(page, "loss-chart", "data-point-count")
    assert live_platform.job(job["id"])["status"] != "COMPLETED"  # we are watching it train, not a replay

    page.wait_for_function("document.querySelector('[data-testid=job-status]').textContent.includes('COMPLETED')",
                           timeout=60000)
    page.wait_for_function("document.querySelector('[data-testid=log]').dataset.lineCount >= 80", timeout=10000)
    assert count(page, "log", "data-line-count") == 80 > early_lines
    assert count(page, "loss-chart", "data-point-count") == 40 > early_points
    assert "step 40 loss 0.0250" in page.inner_text("[data-testid=log]")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "job-page.png"))


def test_the_job_list_shows_the_tenants_jobs(browser, live_platform):
    job = live_platform.submit("failing")
    live_platform.wait_for(job["id"])
    page = logged_in_page(browser, live_platform)
    row = page.locator(f"tr[data-job-id='{job['id']}']")
    assert "FAILED" in row.inner_text()
    page.screenshot(path=str(SCREENSHOTS / "job-list.png"))


def test_an_outsider_cannot_open_the_page_or_the_websocket(browser, live_platform):
    job = live_platform.submit("failing")
    live_platform.manage("tenant", "create", "team-b")
    live_platform.manage("tenant", "adduser", "team-b", "mallory", "--password", "mallory-password")
    page = browser.new_page()
    page.goto(live_platform.url + "/login/")
    page.fill("input[name=username]", "mallory")
    page.fill("input[name=password]", "mallory-password")
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_url(live_platform.url + "/")
    response = page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    assert response.status == 404
    closed = page.evaluate("""url => new Promise(resolve => {
        const ws = new WebSocket(url);
        ws.onmessage = () => resolve('got data');
        ws.onclose = event => resolve(event.code);
    })""", f"ws://127.0.0.1:{live_platform.platform.port}/ws/jobs/{job['id']}/")
    assert closed == 4404


CHECKPOINTER = """
name: checkpointer
cpus: 1
memory: 512MiB
checkpoint: {signal: SIGTERM, grace_seconds: 10}
framework:
  name: custom
  command: |
    python3 -c "import os, signal, sys, time
    if os.environ.get('RESUME_FROM'):
        print('resumed from ' + os.path.basename(os.environ['RESUME_FROM'])); sys.exit(0)
    def save(*_):
        open(os.path.join(os.environ['CHECKPOINT_DIR'], 'step.ckpt'), 'w').write('42')
        print('checkpoint saved', flush=True); sys.exit(0)
    signal.signal(signal.SIGTERM, save)
    print('training', flush=True)
    time.sleep(600)"
"""


def test_halt_and_resume_from_the_job_page(browser, live_platform):
    job = live_platform.submit("custom-shell", manifest_text=CHECKPOINTER)
    live_platform.wait_for(job["id"], {"PROCESSING"}, timeout=60)
    page = logged_in_page(browser, live_platform)  # after submitting: the list page reloads for new jobs
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    assert page.is_hidden("[data-testid=resume]")
    page.click("[data-testid=halt]")
    page.wait_for_function("document.querySelector('[data-testid=job-status]').textContent.includes('HALTED')",
                           timeout=30000)
    assert "checkpoint step.ckpt" in page.inner_text("[data-testid=job-reason]")
    assert page.is_hidden("[data-testid=halt]")
    page.click("[data-testid=resume]")
    page.wait_for_function("document.querySelector('[data-testid=job-status]').textContent.includes('COMPLETED')",
                           timeout=60000)
    page.wait_for_function("document.querySelector('[data-testid=log]').innerText.includes('resumed from step.ckpt')",
                           timeout=10000)
    assert live_platform.job(job["id"])["attempt"] == 2
