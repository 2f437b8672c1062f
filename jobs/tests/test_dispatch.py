"""Waking workers (jobs.dispatch): coalesced scheduling requests."""
import time

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


@pytest.fixture
def cycles(monkeypatch):
    """Scheduling cycles that take 0.2 s each; returns the list of their start times."""
    from jobs import tasks
    started = []

    def cycle():
        started.append(time.monotonic())
        time.sleep(0.2)
    monkeypatch.setattr(tasks.admission, "run_cycle", cycle)
    monkeypatch.setattr(tasks.autoscaler, "may_resize", lambda: True)  # an elastic job runs
    return started


def test_a_cycle_rests_as_long_as_the_last_one_took_and_a_request_meanwhile_is_deferred_to_its_end(
        monkeypatch, cycles):
    from jobs import tasks
    sent = []
    monkeypatch.setattr(dispatch.current_app, "send_task",
                        lambda name, args=(), countdown=None: sent.append((name, countdown)))
    tasks.schedule()
    assert len(cycles) == 1 and sent == [("jobs.tasks.autoscale", None)]
    sent.clear()
    tasks.schedule()  # during the rest: no cycle, the task is sent again for the rest's end
    assert len(cycles) == 1
    [(name, countdown)] = sent
    assert name == "jobs.tasks.schedule" and 0.1 < countdown < 0.3
    dispatch.send("schedule")  # a request meanwhile is served by the deferred run
    assert len(sent) == 1
    time.sleep(countdown)
    tasks.schedule()
    assert len(cycles) == 2


def test_a_cycle_is_not_paced_when_the_cache_cannot_be_reached(monkeypatch, cycles):
    from jobs import tasks

    class Unreachable:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise ConnectionError("redis down")
            return fail
    monkeypatch.setattr(dispatch, "cache", Unreachable())
    monkeypatch.setattr(dispatch.current_app, "send_task", lambda *args, **kwargs: None)
    tasks.schedule()
    tasks.schedule()
    assert len(cycles) == 2


def test_a_waiting_run_is_overdue_only_once_it_waited_past_the_limit(broker, monkeypatch):
    asked = time.time()
    dispatch.send("schedule")
    assert not dispatch.overdue("schedule")
    monkeypatch.setattr(dispatch.time, "time", lambda: asked + dispatch.OVERDUE_S + 1)
    assert dispatch.overdue("schedule")
    dispatch.starting("schedule")  # it started: nothing waits
    assert not dispatch.overdue("schedule")


def test_backlog_counts_the_messages_waiting_in_the_workers_queue(tmp_path, monkeypatch):
    """Against a real Redis server of the test's own, as the broker."""
    from kombu import Connection

    from tests.support.redis_server import RedisServer
    server = RedisServer(tmp_path).start()
    try:
        monkeypatch.setattr(dispatch.current_app, "connection_for_read", lambda: Connection(server.url))
        assert dispatch.backlog() == 0  # no such queue yet
        with Connection(server.url) as connection, connection.SimpleQueue("celery") as queue:
            for _ in range(3):
                queue.put({"task": "nothing"})
        assert dispatch.backlog() == 3
    finally:
        server.stop()


def test_backlog_is_unknown_when_the_broker_cannot_be_reached(monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("connection refused")
    monkeypatch.setattr(dispatch.current_app, "connection_for_read", unreachable)
    assert dispatch.backlog() is None


@pytest.mark.django_db(transaction=True)  # on commit: at once, outside a transaction
def test_a_web_request_does_not_wait_for_the_broker(monkeypatch):
    import asyncio
    import threading

    from asgiref.sync import sync_to_async
    released, sent = threading.Event(), []

    def slow_broker(name, args=(), countdown=None):
        released.wait(10)  # a broker that answers only once the request has gone on
        sent.append((name, tuple(args), threading.current_thread().name))
    monkeypatch.setattr(dispatch.current_app, "send_task", slow_broker)

    def request():  # synchronous code of a request, as the ASGI server runs it
        dispatch.send_on_commit("follow_up", 7)
        return "answered"

    assert asyncio.run(sync_to_async(request)()) == "answered"  # before the broker took anything
    assert sent == []
    released.set()
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [("jobs.tasks.follow_up", (7,), "dispatch-sender")]


@pytest.mark.django_db(transaction=True)
def test_outside_a_web_request_it_sends_before_going_on(broker):
    dispatch.send_on_commit("follow_up", 8)  # a worker's task, a management command
    assert broker == [("jobs.tasks.follow_up", (8,))]


@pytest.mark.django_db(transaction=True)
def test_held_keeps_the_messages_of_its_task_that_commits_within_would_send(broker):
    from django.db import transaction
    with dispatch.held("follow_up") as written:
        with transaction.atomic():
            dispatch.send_on_commit("follow_up", 1)
            dispatch.send_on_commit("schedule")  # another task's messages leave as ever
        dispatch.send_on_commit("follow_up", 2)
    dispatch.send_on_commit("follow_up", 3)  # after the block: sent again
    assert written == [(1,), (2,)]
    assert broker == [("jobs.tasks.schedule", ()), ("jobs.tasks.follow_up", (3,))]


@pytest.mark.django_db(transaction=True)  # the cycle's own transaction commits, as in a worker
def test_a_cycle_does_its_first_follow_up_itself_and_sends_the_others(broker, monkeypatch):
    from types import SimpleNamespace

    from jobs import admission, tasks
    from jobs.backends.base import Capacity, Node
    from jobs.models import FollowUp
    from tests.support.builders import job, member
    capacity = Capacity(nodes=(Node("node-0", 4, 64.0, 256 * 2**30),))
    monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
    deployed = []
    monkeypatch.setitem(tasks.HANDLERS, FollowUp.Kind.DEPLOY, lambda job_id, attempt: deployed.append(job_id))
    alice = member()
    first, second = job(alice, gpus=1), job(alice, gpus=1)
    tasks.schedule()
    rows = {row.job_id: row for row in FollowUp.objects.filter(kind=FollowUp.Kind.DEPLOY)}
    assert set(rows) == {first.id, second.id}
    [here] = deployed  # done by this worker, its row marked done; the other's message woke another
    [elsewhere] = set(rows) - {here}
    assert rows[here].done_at is not None and rows[elsewhere].done_at is None
    assert broker == [("jobs.tasks.follow_up", (rows[elsewhere].pk,))]
