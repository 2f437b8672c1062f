"""The SDK against a real platform: web server, Celery worker, beat, Redis and learner agents."""
import pytest

from tests.support.harness import start_session


@pytest.fixture(scope="session")
def platform(tmp_path_factory):
    session = start_session(tmp_path_factory.mktemp("sdk"), TRAINYARD_RECONCILE_INTERVAL="2",
                            TRAINYARD_LOCAL_CPUS="4")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def client(platform, monkeypatch, tmp_path):
    """A Client configured the way a user configures one: by TRAINYARD_URL and TRAINYARD_TOKEN."""
    from trainyard import Client
    monkeypatch.setenv("HOME", str(tmp_path))  # no saved `trainyard login` of the developer's
    monkeypatch.setenv("TRAINYARD_URL", platform.url)
    monkeypatch.setenv("TRAINYARD_TOKEN", platform.token)
    return Client()
