"""The fixtures the unit tests of several packages share, registered for every test by the root
conftest.py (`pytest_plugins`). Django is imported inside the fixtures that need it, so the agent's
Django-free tests load this plugin too."""
import os
import shutil
import tempfile

import pytest


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


@pytest.fixture
def ingest():
    """A fake ingest endpoint (tests.support.agent_runs.IngestServer) on a local port."""
    from tests.support.agent_runs import IngestServer

    server = IngestServer()
    yield server
    server.close()


@pytest.fixture
def outside_tmp():
    """A scratch dir outside /tmp: inside bubblewrap /tmp is a fresh tmpfs, which would hide everything."""
    from tests.support.agent_runs import PACKAGE_PARENT

    base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else PACKAGE_PARENT
    path = tempfile.mkdtemp(prefix="learner-agent-test-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def running_job():
    """A PENDING job with ingest credentials for its learners (`.tokens`), for tests.support.builders.post."""
    from jobs import credentials
    from tests.support.builders import job, member

    target = job(member(), status="PENDING")
    target.tokens = credentials.issue_for_attempt(target)
    return target


@pytest.fixture
def redis_url(settings, tmp_path):
    """An embedded Redis of the test's own, as the platform's REDIS_URL."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    settings.REDIS_URL = server.url
    try:
        yield server.url
    finally:
        server.stop()
