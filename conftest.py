"""Project-wide test set-up."""
import os

import pytest


def skip_or_fail(reason):
    """Skip on a machine that lacks something optional; in CI (TRAINYARD_REQUIRE_ALL=1) fail instead,
    so CI always runs every test."""
    if os.environ.get("TRAINYARD_REQUIRE_ALL"):
        pytest.fail(f"required in CI but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _isolated_storage(request, tmp_path_factory):
    """Django tests write job files under a temporary data directory, never under var/."""
    try:
        settings = request.getfixturevalue("settings")
    except pytest.FixtureLookupError:  # running without pytest-django (e.g. the agent's own tests)
        return
    data = tmp_path_factory.mktemp("data")
    settings.DATA_DIR = data
    settings.STORAGE_URL = f"file://{data / 'storage'}"
    # Nothing stops the agents of a unit test's deploys, so none waits as a spare after it either
    # (the platforms the end-to-end tests start keep one and stop it with their agents).
    settings.SPARE_AGENTS = 0
    # A cache of each test's own (throttling counters), not the platform's Redis, which unit tests do not start.
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"test-{data.name}"}}
