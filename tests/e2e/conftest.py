"""End-to-end fixtures: one real platform (tests.support.harness) shared by the session's tests."""
import os
import shutil

import pytest

from tests.support import browser as chromium
from tests.support.harness import start_session
from tests.support.optional import skip_or_fail


@pytest.fixture(scope="session")
def live_platform(tmp_path_factory):
    # The S3 tests' server listens on the loopback, which data stores may not reach unless allowed.
    session = start_session(tmp_path_factory.mktemp("platform"), TRAINYARD_RECONCILE_INTERVAL="2",
                            TRAINYARD_LOCAL_CPUS="8", TRAINYARD_DATASTORE_ALLOWED_HOSTS="127.0.0.1")
    try:
        yield session
    finally:
        session.stop()
        if keep := os.environ.get("TRAINYARD_KEEP_E2E_LOGS"):
            shutil.copytree(session.platform.log_dir, keep, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium for the browser tests (skipped without one, a failure in CI)."""
    if not chromium.chromium_found():
        skip_or_fail(f"Chromium not found at {chromium.CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("playwright is not installed")
    with sync_playwright() as playwright:
        instance = chromium.launch(playwright)
        yield instance
        instance.close()


@pytest.fixture
def server_browser(live_server, monkeypatch):
    """A headless Chromium for tests served by pytest-django's live_server over the test's own database,
    started after the server: Playwright's event loop then runs in this thread, and the ORM calls the test
    makes between Playwright's are allowed."""
    if not chromium.chromium_found():
        skip_or_fail(f"Chromium not found at {chromium.CHROMIUM}")
    from playwright.sync_api import sync_playwright
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        instance = chromium.launch(playwright)
        yield instance
        instance.close()
