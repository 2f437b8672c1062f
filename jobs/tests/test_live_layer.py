"""The channel layer the websockets' fan-out runs on (portal.fanout, settings.CHANNEL_LAYERS), against a
real Redis server of the test's own, which it stops and starts again.

What jobs.live relies on: one message per event per web process (Redis pub/sub), however many of that
process's sockets are in the group; sockets that keep receiving after Redis comes back; and platforms
on other database numbers of the same server that never hear each other.
"""
import asyncio
import multiprocessing
import os
import threading
import time

import pytest
import redis
from django.utils.module_loading import import_string

from jobs import live
from portal import fanout
from tests.support.redis_server import RedisServer


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def layer_on(url):
    """The layer as a platform whose REDIS_URL is `url` configures it."""
    configured = fanout.channel_layers(url)["default"]
    return import_string(configured["BACKEND"])(**configured["CONFIG"])


def test_one_publish_per_event_reaches_every_socket_of_the_process_in_the_group(server):
    async def scenario():
        layer = layer_on(server.url)
        channels = [await layer.new_channel() for _ in range(50)]
        for channel in channels:
            await layer.group_add("tenant.1.jobs", channel)
        # One subscription for the group however many sockets joined it: an event costs Redis one
        # message to this process, not one per socket (the list-based layer queued a copy per socket
        # and the process fetched them one round trip each).
        subscribers = redis.Redis.from_url(server.url).pubsub_numsub("trainyard.db0.__group__tenant.1.jobs")
        assert subscribers == [(b"trainyard.db0.__group__tenant.1.jobs", 1)]
        await layer.group_send("tenant.1.jobs", {"type": "job.status", "n": 1})
        received = await asyncio.wait_for(asyncio.gather(*(layer.receive(c) for c in channels)), 5)
        assert [m["n"] for m in received] == [1] * 50
        await layer.flush()
    asyncio.run(scenario())


def test_sockets_receive_again_once_redis_is_back(server):
    async def scenario():
        layer = layer_on(server.url)
        channel = await layer.new_channel()
        await layer.group_add("job.j-1", channel)
        await layer.group_send("job.j-1", {"type": "job.status", "n": 0})
        assert (await asyncio.wait_for(layer.receive(channel), 5))["n"] == 0

        server.stop()
        await asyncio.sleep(0.5)
        server.start()
        # What was published while Redis was down is gone (the REST API and the job page's backlog
        # are the record); once the layer has subscribed again, new events arrive.
        receiving = asyncio.ensure_future(layer.receive(channel))
        deadline = time.monotonic() + 15
        n = 0
        while not receiving.done():
            assert time.monotonic() < deadline, "no message reached the socket after Redis came back"
            n += 1
            try:
                await layer.group_send("job.j-1", {"type": "job.status", "n": n})
            except (redis.ConnectionError, OSError):
                pass  # the publishing side's own reconnect
            await asyncio.sleep(0.2)
        assert receiving.result()["n"] >= 1
        await layer.flush()
    asyncio.run(scenario())


def test_platforms_on_other_database_numbers_of_one_server_never_hear_each_other(server):
    """Pub/sub channels are server-wide; every other key of a platform lives in its database number."""
    async def scenario():
        ours, theirs = layer_on(server.url), layer_on(server.url.rsplit("/", 1)[0] + "/7")
        ours_socket, their_socket = await ours.new_channel(), await theirs.new_channel()
        await ours.group_add("tenant.1.jobs", ours_socket)
        await theirs.group_add("tenant.1.jobs", their_socket)
        await theirs.group_send("tenant.1.jobs", {"type": "job.status", "job": "their-job"})
        assert (await asyncio.wait_for(theirs.receive(their_socket), 5))["job"] == "their-job"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ours.receive(ours_socket), 1)
        await ours.flush()
        await theirs.flush()
    asyncio.run(scenario())


def received_from(server, publish, count):
    """The messages a socket in group job.j-1 receives while `publish()` runs in this thread (the
    socket's loop runs in a thread of its own: a process forked from here must not copy a running one)."""
    subscribed, received = threading.Event(), []

    async def listen():
        layer = layer_on(server.url)
        channel = await layer.new_channel()
        await layer.group_add("job.j-1", channel)
        subscribed.set()
        for _ in range(count):
            received.append(await asyncio.wait_for(layer.receive(channel), 5))
        await layer.flush()
    listener = threading.Thread(target=asyncio.run, args=(listen(),))
    listener.start()
    assert subscribed.wait(5)
    publish()
    listener.join(15)
    return received


def test_code_outside_the_web_server_publishes_in_order_through_one_loop_of_its_process(server, monkeypatch):
    """A Celery worker's status changes: jobs.live publishes them from its own loop, kept for the
    process, and each publication has left when the call returns."""
    layer = layer_on(server.url)
    monkeypatch.setattr(live, "get_channel_layer", lambda: layer)

    def publish():
        for n in range(20):
            live._send(["job.j-1"], {"type": "job.status", "n": n})
    assert [m["n"] for m in received_from(server, publish, 20)] == list(range(20))
    assert live._publisher[0] == os.getpid() and live._publisher[1].is_running()


def test_a_forked_process_publishes_from_a_loop_of_its_own(server, monkeypatch):
    """Celery's pool forks its worker processes: the parent's loop thread does not exist in a child,
    which must neither wait on it forever nor lose its messages."""
    layer = layer_on(server.url)
    monkeypatch.setattr(live, "get_channel_layer", lambda: layer)
    live._send(["job.j-0"], {"type": "job.status"})  # the parent's loop exists before the fork

    def publish_from_a_child():
        child = multiprocessing.get_context("fork").Process(
            target=live._send, args=(["job.j-1"], {"type": "job.status", "from": "child"}))
        child.start()
        child.join(20)
        assert child.exitcode == 0
    assert received_from(server, publish_from_a_child, 1)[0]["from"] == "child"


def test_the_receive_loop_keeps_reading_once_every_socket_has_left(server):
    """channels_redis' loop sleeps between looks while its connection holds no subscription, and a
    socket opened then waited out the sleep before its first message (portal.fanout.PubSubLayer)."""
    listening = lambda: redis.Redis.from_url(server.url).pubsub_channels("trainyard.db0.listening.*")

    async def scenario():
        layer = layer_on(server.url)
        for n in range(3):
            channel = await layer.new_channel()
            await layer.group_add("job.j-1", channel)
            await layer.group_send("job.j-1", {"type": "job.status", "n": n})
            assert (await asyncio.wait_for(layer.receive(channel), 5))["n"] == n
            await layer.group_discard("job.j-1", channel)
            receiving = asyncio.ensure_future(layer.receive(channel))
            await asyncio.sleep(0)
            receiving.cancel()  # as a consumer that closes: its own channel is unsubscribed
            with pytest.raises(asyncio.CancelledError):
                await receiving
            await asyncio.sleep(0.2)
            # Every socket gone, and the connection still holds one subscription (one per loop).
            assert len(listening()) == 1, "no subscription left: the receive loop sleeps between looks"
        await layer.flush()
        assert listening() == []
    asyncio.run(scenario())
