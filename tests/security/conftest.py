"""The hostile-researcher suite: one real platform (web, Celery worker, beat, Redis, learner agents in
bubblewrap) with two tenants, attacked the way a researcher of one tenant could attack it.

`platform` is tenant "team-a" (user alice, a researcher); `intruder` is tenant "team-b" (user mallory,
a researcher, with her own token) on the same platform. Tests submit hostile jobs as either.
"""
import pytest

from conftest import skip_or_fail
from learner_agent import sandbox
from tests.support.harness import start_session


@pytest.fixture(scope="session")
def platform(tmp_path_factory):
    if sandbox.bwrap_problem() is not None:
        skip_or_fail(f"the hostile-learner suite needs bubblewrap: {sandbox.bwrap_problem()}")
    session = start_session(tmp_path_factory.mktemp("security"), TRAINYARD_SANDBOX="bwrap",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_LOCAL_CPUS="8")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def intruder(platform):
    """Tenant team-b's researcher mallory: (username, password, token)."""
    token = platform.add_member("team-b", "mallory", password="mallory-password")
    return "mallory", "mallory-password", token
