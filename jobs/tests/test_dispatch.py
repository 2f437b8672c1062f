"""Waking workers (jobs.dispatch): coalesced scheduling requests."""
import pytest

from jobs import dispatch


@pytest.fixture
def broker(monkeypatch):
    sent = []
    monkeypatch.setattr(dispatch.current_app, "send_task",
                        lambda name, args=(), countdown=None: sent.append((name, tuple(args))))
    return sent


def test_it_sends_one_cycle_for_many_requests_while_one_waits_to_start(broker):
    for _ in range(5):
        dispatch.send("schedule")
    assert broker == [("jobs.tasks.schedule", ())]


def test_a_request_after_the_cycle_started_sends_another(broker):
    dispatch.send("schedule")
    dispatch.starting("schedule")  # the cycle began: it may have read the queue before this request
    dispatch.send("schedule")
    dispatch.send("schedule")
    assert broker == [("jobs.tasks.schedule", ())] * 2


def test_it_sends_every_task_with_arguments(broker):
    dispatch.send("follow_up", 7)
    dispatch.send("follow_up", 7)
    assert broker == [("jobs.tasks.follow_up", (7,))] * 2


def test_it_sends_anyway_when_the_cache_cannot_be_reached(broker, monkeypatch):
    class Unreachable:
        def add(self, *args, **kwargs):
            raise ConnectionError("redis down")

    monkeypatch.setattr(dispatch, "cache", Unreachable())
    dispatch.send("schedule")
    dispatch.send("schedule")
    assert broker == [("jobs.tasks.schedule", ())] * 2
