"""Waking the platform's processes (jobs.dispatch): Celery tasks by name, the scheduling loop through Redis."""
import time

import pytest
import redis

from jobs import dispatch


@pytest.fixture
def broker(monkeypatch):
    sent = []
    monkeypatch.setattr(dispatch.current_app, "send_task",
                        lambda name, args=(), countdown=None: sent.append((name, tuple(args))))
    return sent


@pytest.fixture
def wake_list(tmp_path, settings):
    """The scheduling loop's wake list on a Redis server of the test's own."""
    from tests.support.redis_server import RedisServer
    server = RedisServer(tmp_path).start()
    settings.REDIS_URL = server.url
    client = redis.Redis.from_url(server.url)
    yield client
    server.stop()


def test_it_sends_every_task_with_its_arguments(broker):
    dispatch.send("follow_up", 7)
    dispatch.send("follow_up", 7)
    assert broker == [("jobs.tasks.follow_up", (7,))] * 2


def test_a_wake_leaves_one_item_on_the_loops_list_however_many_are_sent(wake_list):
    for _ in range(5):
        dispatch.wake_scheduler()
    assert wake_list.llen(dispatch.SCHEDULER_WAKE_KEY) == 1  # a loop that is down finds one, not a pile
    assert wake_list.blpop([dispatch.SCHEDULER_WAKE_KEY], timeout=1) is not None
    assert wake_list.llen(dispatch.SCHEDULER_WAKE_KEY) == 0


def test_a_wake_that_cannot_reach_redis_is_logged_and_nothing_fails(settings, caplog):
    from portal.runner import free_port
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    dispatch.wake_scheduler()
    assert "could not wake the scheduling loop" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_wake_on_commit_leaves_once_the_change_is_committed(wake_list):
    from django.db import transaction
    with transaction.atomic():
        dispatch.wake_scheduler_on_commit()
        assert wake_list.llen(dispatch.SCHEDULER_WAKE_KEY) == 0  # a cycle now would not see the change
    assert wake_list.llen(dispatch.SCHEDULER_WAKE_KEY) == 1


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
        with Connection(server.url) as connection, connection.SimpleQueue("webhooks") as queue:
            queue.put({"task": "nothing"})
        assert (dispatch.backlog("webhooks"), dispatch.backlog()) == (1, 3)  # each queue its own
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

    from jobs.serving import ServingLoop
    released, sent = threading.Event(), []

    def slow_broker(name, args=(), countdown=None):
        released.wait(10)  # a broker that answers only once the request has gone on
        sent.append((name, tuple(args), threading.current_thread().name))
    monkeypatch.setattr(dispatch.current_app, "send_task", slow_broker)

    def slow_wake():
        released.wait(10)
        sent.append(("wake", (), threading.current_thread().name))
    monkeypatch.setattr(dispatch, "wake_scheduler", slow_wake)

    def request():  # synchronous code of a request, as the ASGI server runs it
        from django.db import connection
        try:
            dispatch.wake_scheduler_on_commit()
            dispatch.send_on_commit("follow_up", 7)
            return "answered"
        finally:
            connection.close()  # as Django closes it when a request ends

    async def application(scope, receive, send):
        return await sync_to_async(request)()

    served = ServingLoop(application)({"type": "http"}, None, None)
    assert asyncio.run(served) == "answered"  # before the broker took anything
    assert sent == []
    released.set()
    deadline = time.monotonic() + 10
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [("wake", (), "dispatch-sender"), ("jobs.tasks.follow_up", (7,), "dispatch-sender")]


@pytest.mark.django_db(transaction=True)
def test_outside_a_web_request_it_sends_before_going_on(broker):
    dispatch.send_on_commit("follow_up", 8)  # a worker's task, a management command
    assert broker == [("jobs.tasks.follow_up", (8,))]
