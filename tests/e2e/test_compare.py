"""Compare runs end to end: three real jobs of a small learning-rate sweep, selected on the jobs page
in a real Chromium, compared on one overlaid chart per metric; the CLI prints the same differences;
another tenant gets 404 for the shared address."""
import os
import re
from pathlib import Path

import pytest

from tests.support.browser import log_in

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

SWEEP = Path(__file__).parent / "jobs" / "sweep"
SCREENSHOTS = Path(os.environ.get("TRAINYARD_SCREENSHOTS", "/tmp/trainyard-screenshots"))
RATES = ("0.3", "0.1", "0.03")
WAIT_MS = 60_000


def manifest(lr, steps=8):
    return (f"name: sweep-lr-{lr}\ncpus: 0.5\nmemory: 128MiB\n"
            f"framework: {{name: custom, command: bash run.sh --lr {lr} --steps {steps}}}\n")


@pytest.fixture(scope="module")
def sweep(live_platform):
    """The three finished jobs' ids, in the order of RATES."""
    ids = [live_platform.submit(str(SWEEP), manifest_text=manifest(lr))["id"] for lr in RATES]
    for job_id in ids:
        assert live_platform.wait_for(job_id, timeout=120)["status"] == "COMPLETED"
    return ids


def test_three_jobs_selected_on_the_jobs_page_are_compared_on_overlaid_charts(browser, live_platform, sweep):
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password, timeout_ms=WAIT_MS)
    compare = page.get_by_test_id("compare")
    assert compare.is_disabled()
    for job_id in sweep[:2]:
        page.locator(f"tr[data-job-id='{job_id}'] [data-testid=select-job]").check()
    # Filtering swaps the results in (htmx); the jobs ticked before stay selected.
    page.get_by_test_id("filter-text").fill(sweep[2])
    page.wait_for_function("n => document.querySelectorAll('[data-testid=jobs-table] tbody tr').length === n", arg=1)
    page.locator(f"tr[data-job-id='{sweep[2]}'] [data-testid=select-job]").check()
    assert compare.inner_text() == "Compare (3)" and compare.is_enabled()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "compare-selected.png"))
    compare.click()
    page.wait_for_url(re.compile(re.escape(live_platform.url) + r"/jobs/compare/\?ids="))
    assert page.url.split("ids=")[1] == ",".join(sweep)  # shareable: the address names the jobs

    # One chart per metric, three lines each (uPlot draws a legend entry per line).
    page.wait_for_function("() => document.getElementById('compare-page').dataset.loaded === 'true'")
    charts = page.locator("[data-testid=chart]")
    assert sorted(charts.evaluate_all("cs => cs.map(c => c.dataset.metric)")) == ["loss", "val_acc"]
    for chart in charts.all():
        assert chart.get_attribute("data-series-count") == "3"
        assert chart.get_attribute("data-point-count") == str(3 * 8)
        legend = chart.locator(".u-legend .u-series .u-label").all_inner_texts()
        assert legend[1:] == [f"sweep-lr-{lr}" for lr in RATES], legend  # [0] is the step

    # The table: only what differs, then each metric's final value.
    rows = page.locator("[data-testid=diff-row]")
    keys = rows.evaluate_all("rs => rs.map(r => r.dataset.key)")
    assert "learning_rate" in keys and "framework" not in keys and "flag:steps" not in keys
    assert page.locator("[data-key=learning_rate] td").all_inner_texts() == list(RATES)
    finals = page.locator("[data-testid=final-row][data-metric=loss] td").all_inner_texts()
    assert [float(v) for v in finals] == sorted(float(v) for v in finals)  # a higher rate ends lower here
    assert "--steps 8" in page.get_by_test_id("compare-same").inner_text()

    page.screenshot(path=str(SCREENSHOTS / "compare.png"), full_page=True)


def test_the_page_follows_jobs_that_are_still_running(browser, live_platform):
    steps = 100  # 0.1 s each: the page is open long before they finish
    ids = [live_platform.submit(str(SWEEP), manifest_text=manifest(lr, steps))["id"] for lr in ("0.02", "0.01")]
    for job_id in ids:
        live_platform.wait_for(job_id, {"PROCESSING", "COMPLETED"}, timeout=120)
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password, timeout_ms=WAIT_MS)
    page.goto(f"{live_platform.url}/jobs/compare/?ids={','.join(ids)}")
    page.wait_for_function("() => document.getElementById('compare-page').dataset.loaded === 'true'")
    loss = "[data-testid=chart][data-metric=loss]"
    first = int(page.get_attribute(loss, "data-point-count") or 0)
    assert page.get_attribute("#compare-page", "data-running") != "0" and first < 2 * steps, first
    page.wait_for_function("([sel, n]) => document.querySelector(sel).dataset.pointCount === n",
                           arg=[loss, str(2 * steps)])
    page.wait_for_function("() => document.getElementById('compare-page').dataset.running === '0'")
    # The table's final values followed too: they are the runs' last points now.
    api = live_platform.api("GET", "/api/v1/jobs/compare/", params={"ids": ",".join(ids)}).json()
    last = next(m for m in api["metrics"] if m["name"] == "loss")["final"]
    shown = page.locator("[data-testid=final-row][data-metric=loss] td").all_inner_texts()
    assert [float(v) for v in shown] == pytest.approx(last, rel=1e-5), (shown, last)
    assert [job["status"] for job in api["jobs"]] == ["COMPLETED", "COMPLETED"]


def test_the_cli_prints_the_same_differences(live_platform, sweep):
    done = live_platform.cli("compare", *sweep)
    assert done.returncode == 0, done.stderr
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "compare-cli.txt").write_text(done.stdout)  # what docs/compare.md shows
    lines = done.stdout.splitlines()
    assert lines[0].split() == sweep
    assert re.match(r"learning rate\s+0\.3\s+0\.1\s+0\.03$", next(l for l in lines if l.startswith("learning rate")))
    assert any(l.startswith("final loss") for l in lines) and any(l.startswith("final val_acc") for l in lines)


def test_another_tenant_gets_404_for_the_shared_address(browser, live_platform, sweep):
    live_platform.add_member("team-compare-other", "olga", password="olga-password")
    page = log_in(browser, live_platform.url, "olga", "olga-password", timeout_ms=WAIT_MS)
    response = page.goto(f"{live_platform.url}/jobs/compare/?ids={','.join(sweep)}")
    assert response.status == 404
    assert "sweep-lr" not in page.content()
