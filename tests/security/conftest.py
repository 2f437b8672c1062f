"""The hostile-researcher suite: one real platform (web, Celery worker, beat, Redis, learner agents in
bubblewrap) with two tenants, attacked the way a researcher of one tenant could attack it.

`platform` is tenant "team-a" (user alice, a researcher); `intruder` is tenant "team-b" (user mallory,
a researcher, with her own token) on the same platform. Tests submit hostile jobs as either.
"""
import shutil
import tempfile

import pytest

from learner_agent import sandbox
from tests.support.harness import start_session
from tests.support.optional import skip_or_fail


@pytest.fixture(scope="session")
def platform():
    if sandbox.bwrap_problem() is not None:
        skip_or_fail(f"the hostile-learner suite needs bubblewrap: {sandbox.bwrap_problem()}")
    # Outside /tmp: every learner gets a private /tmp, which would hide a data directory under it for free;
    # here the sandbox must hide the platform's data the way it does for an install's var/.
    data_dir = tempfile.mkdtemp(prefix="trainyard-security-", dir="/var/tmp")
    # Webhooks may reach 127.0.0.1, where test_webhooks' receivers listen (jobs.egress refuses it by
    # default), and each delivery has 5 s in all.
    session = start_session(data_dir, TRAINYARD_SANDBOX="bwrap",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_MAX_RECORDED_FILES="1000",  # test_shared_capacity: a result past it
                            TRAINYARD_WEBHOOK_ALLOW_PRIVATE="1", TRAINYARD_WEBHOOK_TIMEOUT_S="5")
    try:
        yield session
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def intruder(platform):
    """Tenant team-b's researcher mallory: (username, password, token)."""
    token = platform.add_member("team-b", "mallory", password="mallory-password")
    return "mallory", "mallory-password", token
