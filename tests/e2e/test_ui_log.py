"""The job page's log and charts at the sizes long runs reach, in a real Chromium: 150,000 log
lines and 200,000 metric points fed through the page's own intake, as the websocket would."""
import pytest

from tests.support.pages import CONNECTED, log_in

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

LINES = 150_000
FEED = """async ({lines}) => {
  const { logIntake } = window.Trainyard.page;
  const started = performance.now();
  for (let first = 1; first <= lines; first += 500) {
    const batch = [];
    for (let seq = first; seq < first + 500 && seq <= lines; seq += 1) {
      const error = seq === 123456;
      batch.push({ seq, learner: seq % 2, stream: error ? 'stderr' : 'stdout', time: '',
                   line: error ? 'Traceback (most recent call last):' : `step ${seq} loss ${1 / seq}${seq % 1000 ? '' : ' needle'}` });
    }
    logIntake.receive(batch);
  }
  await logIntake.queue;
  await new Promise(requestAnimationFrame);
  return performance.now() - started;
}"""
# Time from setting scrollTop to the rows of that place being in the DOM, at ten places.
SCROLL = """async () => {
  const log = document.querySelector('[data-testid=log]');
  const worst = [];
  for (let i = 0; i < 10; i += 1) {
    const started = performance.now();
    log.scrollTop = (log.scrollHeight * i) / 10;
    await new Promise(requestAnimationFrame);
    await new Promise(requestAnimationFrame);
    worst.push(performance.now() - started);
  }
  return { worst: Math.max(...worst), rows: log.querySelectorAll('.log-row').length };
}"""

CLEAR_SEARCH_THEN_FIRST_ERROR = """() => {
  const box = document.querySelector('[data-testid=log-search]');
  box.value = '';
  box.dispatchEvent(new Event('input', { bubbles: true }));
  document.querySelector('[data-testid=log-first-error]').click();
}"""
CURRENT_ROW_WHEN_DRAWN = """async () => {
  await new Promise(requestAnimationFrame);
  await new Promise(requestAnimationFrame);
  return document.querySelector('.log-row.current')?.innerText ?? '';
}"""


@pytest.fixture
def job_page(browser, live_platform):
    job = live_platform.submit("failing")
    live_platform.wait_for(job["id"])
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    page.wait_for_selector(CONNECTED)
    page.wait_for_function("() => document.querySelector('[data-testid=log]').dataset.lineCount > 0")
    page.evaluate("() => { const p = window.Trainyard.page; p.logView.lines = []; p.logView.view = []; "
                  "p.logIntake.lastSeq = 0; p.logView.firstSeq = null; p.logView.refilter(); }")
    yield page
    page.close()


def test_a_finished_jobs_page_shows_no_live_dot(job_page):
    connection = job_page.locator("[data-testid=connection]")
    assert connection.get_attribute("data-state") == "ended"
    assert connection.inner_text() == "ended"
    assert connection.evaluate("el => getComputedStyle(el, '::before').backgroundColor") != "rgb(34, 160, 90)"


def test_the_log_stays_smooth_at_150000_lines(job_page):
    page = job_page
    fed_ms = page.evaluate(FEED, {"lines": LINES})
    assert page.get_attribute("[data-testid=log]", "data-line-count") == str(LINES)
    assert fed_ms < 20_000, f"taking in {LINES} lines took {fed_ms:.0f} ms"
    scroll = page.evaluate(SCROLL)
    assert scroll["rows"] < 200  # only what is on screen is in the DOM
    assert scroll["worst"] < 250, f"a jump through the log took {scroll['worst']:.0f} ms to draw"

    page.locator("[data-testid=log-search]").fill("needle")
    page.wait_for_function("() => document.querySelector('[data-testid=log-search-count]').textContent === '1/150'")
    page.locator("[data-testid=log-search]").press("Enter")
    page.wait_for_function("() => document.querySelector('.log-row.current')?.innerText.startsWith('2000')")
    assert page.locator("[data-testid=log-search-count]").inner_text() == "2/150"
    # Clearing the search and clicking "First error" before the search box's debounce has run: the
    # cleared search must not take away the error's highlight when it lands.
    page.evaluate(CLEAR_SEARCH_THEN_FIRST_ERROR)
    page.wait_for_function("() => document.querySelector('[data-testid=log-search-count]').textContent === ''",
                           timeout=10_000)
    assert "Traceback" in page.evaluate(CURRENT_ROW_WHEN_DRAWN)
    assert not page.get_by_label("Follow").is_checked()  # looking back pauses following

    page.get_by_label("Learner").select_option("1")
    page.wait_for_function(f"() => document.querySelector('[data-testid=log]').dataset.viewCount === '{LINES // 2}'")
    page.get_by_label("Stream").select_option("stderr")
    page.get_by_label("Learner").select_option("")
    page.wait_for_function("() => document.querySelector('[data-testid=log]').dataset.viewCount === '1'")


def test_a_long_run_chart_is_downsampled_but_keeps_every_point(job_page):
    page = job_page
    page.evaluate("""() => {
      const points = [];
      for (let step = 1; step <= 100000; step += 1) {
        for (const attempt of [1, 2]) points.push({ name: 'loss', step, value: 1 / step + attempt, learner: 0, attempt, time: String(step) });
      }
      window.Trainyard.page.charts.add(points);
    }""")
    chart = "[data-testid=chart][data-metric=loss]"
    page.wait_for_function(f"() => document.querySelector('{chart}')?.dataset.pointCount === '200000'")
    assert page.get_attribute(chart, "data-series-count") == "2"
    assert "averaged to 1500 steps" in page.locator(chart).inner_text()
