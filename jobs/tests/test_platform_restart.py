"""A restart of the platform on another address, seen from the local backend and its agents.

The platform is a fake ingest endpoint here (tests.support.agent_runs.IngestServer): "stopping"
it closes it, "starting it again elsewhere" opens another with what the first had stored (the same
database) and announces the new address in the data directory, as a starting worker does
(jobs.tasks.start_spare_agents). The agents, the learner, the spool and the backend's status() are real.
"""
import json
import time
from pathlib import Path

import pytest

from jobs.backends import local
from jobs.backends.base import LearnerState
from learner_agent import address
from portal.runner import stop_learner_agents
from tests.support.agent_runs import IngestServer, wait_for, write_agent_config

CHATTY = "i=0; while true; do i=$((i+1)); echo line $i; sleep 0.05; done"


@pytest.fixture
def platform(outside_tmp):
    """(the old platform's ingest server, the address file both share)."""
    first = IngestServer()
    yield first, address.path_in(outside_tmp)
    first.close()


def restart_elsewhere(first, platform_file):
    """The platform again, on another port, with the first one's stored records; announced."""
    first.status_override = 503  # its open keep-alive connections would outlive close() otherwise
    first.close()
    second = IngestServer()
    second.records.update({key: list(records) for key, records in first.records.items()})
    address.announce(platform_file, second.url.replace("training-test0001", address.JOB_ID))
    return second


def logged(server):
    return [r["line"] for r in server.stored() if r["kind"] == "log" and r["stream"] == "stdout"]


def exited(server):
    return next((r for r in server.stored() if r["kind"] == "status" and r["state"] == "exited"), None)


def test_a_learner_stopped_with_the_platform_is_concluded_after_it_restarts_elsewhere(outside_tmp, platform):
    """The demo's Ctrl-C: the learner is stopped, its agent killed before it could deliver the rest.
    The next reconcile's status() starts an agent for it that finds the platform at its new address,
    delivers every line and the exit (naming the stop), and the learner counts as exited."""
    first, platform_file = platform
    address.announce(platform_file, first.url.replace("training-test0001", address.JOB_ID))
    folder = Path(write_agent_config(outside_tmp, first, command=CHATTY, platform_file=platform_file,
                                     flush_timeout_s=600)).parent
    backend = local.LocalBackend()
    backend._start_agent(folder)
    wait_for(lambda: len(logged(first)) >= 5, timeout=20)
    first.status_override = 503  # the web server is gone: lines pile up in the spool
    time.sleep(0.5)

    # What the demo's Ctrl-C does once the platform's processes are gone; the learner has
    # TERMINATE_GRACE_S to end, its agent then a moment to deliver before it is killed.
    stop_learner_agents(outside_tmp, wait_s=8)
    record = json.loads((folder / "exit.json").read_text())
    assert record["reason"] == "terminated: the platform was stopped while the learner ran"
    wait_for(lambda: not local._agent_alive(folder), timeout=10)  # killed, its spool left behind

    second = restart_elsewhere(first, platform_file)
    try:
        assert backend._learner_status(folder, 0).state == LearnerState.RUNNING  # an agent delivers the rest
        wait_for(lambda: exited(second), timeout=30)
        lines = logged(second)
        assert lines == [f"line {i}" for i in range(1, len(lines) + 1)]  # nothing lost, nothing twice
        assert len(lines) > len(logged(first))  # some were only in the spool
        assert exited(second)["reason"] == record["reason"]
        assert exited(second)["exit_code"] == record["exit_code"]
        wait_for(lambda: not local._agent_alive(folder), timeout=20)
        status = backend._learner_status(folder, 0)
        assert (status.state, status.reason) == (LearnerState.EXITED, record["reason"])
    finally:
        stop_learner_agents(outside_tmp, wait_s=3)
        second.close()


def test_a_running_learner_keeps_training_across_a_restart_elsewhere(outside_tmp, platform):
    """The platform's processes killed (not its learners): the agent, posting in vain, reads the
    address a restarted worker announces and goes on there; its learner never stopped."""
    first, platform_file = platform
    address.announce(platform_file, first.url.replace("training-test0001", address.JOB_ID))
    folder = Path(write_agent_config(outside_tmp, first, command=CHATTY, platform_file=platform_file)).parent
    local.LocalBackend()._start_agent(folder)
    try:
        wait_for(lambda: len(logged(first)) >= 5, timeout=20)
        second = restart_elsewhere(first, platform_file)
        try:
            wait_for(lambda: len(logged(second)) >= len(logged(first)) + 20, timeout=30)
            lines = logged(second)
            assert lines == [f"line {i}" for i in range(1, len(lines) + 1)]
            assert local._agent_alive(folder) and not (folder / "exit.json").exists()
        finally:
            second.close()
    finally:
        stop_learner_agents(outside_tmp, wait_s=3)
