"""End-to-end fixtures: one real platform (portal.harness) shared by the session's tests."""
import os
import shutil

import pytest

from portal.harness import start_session


@pytest.fixture(scope="session")
def live_platform(tmp_path_factory):
    session = start_session(tmp_path_factory.mktemp("platform"), TRAINYARD_RECONCILE_INTERVAL="2",
                            TRAINYARD_LOCAL_CPUS="8")
    try:
        yield session
    finally:
        session.stop()
        if keep := os.environ.get("TRAINYARD_KEEP_E2E_LOGS"):
            shutil.copytree(session.platform.log_dir, keep, dirs_exist_ok=True)
