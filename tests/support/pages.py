"""What the browser tests do on the portal's pages: log in with the patience these machines need, wait
for a job's status or for a number on the page to grow, and keep a screenshot."""
import os
from pathlib import Path

from tests.support.browser import log_in as browser_log_in


SCREENSHOTS = Path(os.environ.get("TRAINYARD_SCREENSHOTS", "/tmp/trainyard-screenshots"))
# The job page's websocket is open: "live", or "ended" once the job is final (no green dot then).
CONNECTED = "[data-testid=connection]:is([data-state=live], [data-state=ended])"
WAIT_MS = 90_000  # two shared cores: PyTorch's import alone can take many seconds


def log_in(browser, url, username, password):
    return browser_log_in(browser, url, username, password, timeout_ms=WAIT_MS)


def number(page, selector, attribute):
    return int(page.get_attribute(selector, attribute) or 0)


def wait_status(page, *statuses):
    page.wait_for_function("s => s.includes(document.querySelector('[data-testid=job-status]').dataset.status)",
                           arg=list(statuses))


def wait_more(page, selector, attribute, than):
    page.wait_for_function("([sel, attr, n]) => Number(document.querySelector(sel)?.getAttribute(attr) || 0) > n",
                           arg=[selector, attribute, than])
    return number(page, selector, attribute)


def shoot(page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("document.activeElement?.blur(); window.scrollTo(0, 0)")
    page.screenshot(path=str(SCREENSHOTS / name))
