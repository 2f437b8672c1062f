"""The channel layer the websockets' fan-out runs on (settings.CHANNEL_LAYERS), against a real Redis
server of the test's own, which it stops and starts again.

What jobs.live relies on: one message per event per web process (Redis pub/sub), however many of that
process's sockets are in the group, and sockets that keep receiving after Redis comes back.
"""
import asyncio
import subprocess
import time

import pytest
import redis
from django.conf import settings
from django.utils.module_loading import import_string

from portal import runner


class RedisServer:
    def __init__(self, directory):
        self.port, self.directory, self.process = runner.free_port(), directory, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        self.process = subprocess.Popen([str(runner.embedded_redis_binary()), "--port", str(self.port), "--bind",
                                         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
                                        stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self):
        self.process.kill()
        self.process.wait()


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def layer_on(url):
    """The layer as settings configure it, pointed at this test's server."""
    configured = settings.CHANNEL_LAYERS["default"]
    return import_string(configured["BACKEND"])(**dict(configured.get("CONFIG", {}), hosts=[url]))


def test_one_publish_per_event_reaches_every_socket_of_the_process_in_the_group(server):
    async def scenario():
        layer = layer_on(server.url)
        channels = [await layer.new_channel() for _ in range(50)]
        for channel in channels:
            await layer.group_add("tenant.1.jobs", channel)
        # One subscription for the group however many sockets joined it: an event costs Redis one
        # message to this process, not one per socket (the list-based layer queued a copy per socket
        # and the process fetched them one round trip each).
        assert redis.Redis.from_url(server.url).pubsub_numsub(f"asgi__group__tenant.1.jobs") == \
            [(b"asgi__group__tenant.1.jobs", 1)]
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
