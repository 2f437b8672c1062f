"""A job websocket driven in-process (channels' communicator), shared by the websocket tests: connect,
read until it goes quiet, and status changes published as the state machine publishes them."""
import json

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from jobs import live
from portal.asgi import application


async def receive_all(communicator):
    """(JSON messages received, close code or None) until the server goes quiet or closes."""
    messages = []
    while not await communicator.receive_nothing(timeout=0.3):
        output = await communicator.receive_output()
        if output["type"] == "websocket.close":
            return messages, output.get("code")
        messages.append(json.loads(output["text"]))
    return messages, None


class Communicator(WebsocketCommunicator):
    """Channels' communicator, given as long to connect as a loaded machine needs: a process's first
    socket imports the consumers and opens a database connection, past the library's one second."""

    async def connect(self, timeout=10):
        return await super().connect(timeout)


def communicator_for(path, headers=()):
    return Communicator(application, path,
                        headers=[(b"host", b"testserver"), (b"origin", b"http://testserver"), *headers])


@async_to_sync
async def session(path, then=None, headers=()):
    """Connect, read everything, optionally do `then()` and read again; return (close code, messages)."""
    communicator = communicator_for(path, headers)
    connected, code = await communicator.connect()
    if not connected:
        return code, []
    messages, code = await receive_all(communicator)
    if then is not None and code is None:
        await then()
        more, code = await receive_all(communicator)
        messages += more
    await communicator.disconnect()
    return code, messages


def status_change(target):
    """A status change of `target` published as the state machine does (its tenant's list group)."""
    async def publish():
        from channels.layers import get_channel_layer

        from jobs.serializers import JobSerializer
        await get_channel_layer().group_send(live.tenant_group(target.tenant_id), {
            "type": "job.status", "status": {"job": target.id, "status": "PROCESSING"},
            "job": await database_sync_to_async(lambda: JobSerializer(target).data)()})
    return publish
