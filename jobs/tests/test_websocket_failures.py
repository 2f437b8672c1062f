"""A socket whose handler fails (a statement PostgreSQL cancels, the database gone) still lets go of what
it held: its user's place among WEBSOCKETS_PER_USER, its access rechecks and its subscriptions."""
import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import OperationalError, connection

from jobs import live
from jobs.models import MetricPoint
from tests.support.builders import job, member, token_for
from tests.support.websockets import communicator_for, receive_all

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def rechecking():
    return [task for task in asyncio.all_tasks() if "_recheck_now_and_then" in repr(task.get_coro())]


def test_a_socket_whose_backlog_is_cancelled_gives_back_its_place_and_its_rechecks(settings):
    settings.WEBSOCKETS_PER_USER = 1
    settings.WEB_STATEMENT_TIMEOUT_S = 0.5  # what the web servers' connections get (portal.statement_timeout)
    alice = member()
    target, key = job(alice), token_for(alice)
    locker = connection.Database.connect(**connection.get_connection_params())  # another request holding the table

    @async_to_sync
    async def scenario():
        locker.cursor().execute(f"LOCK TABLE {MetricPoint._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        failed = communicator_for(f"/ws/jobs/{target.id}/?token={key}")
        assert (await failed.connect())[0]  # accepted; its backlog then waits on the lock past the timeout
        with pytest.raises(OperationalError):
            while True:
                await failed.receive_output(timeout=5)
        locker.rollback()
        left = rechecking(), dict(get_channel_layer().groups.get(live.job_group(target.id), {}))
        socket = communicator_for(f"/ws/jobs/{target.id}/?token={key}")  # the same process, as its one place
        assert (await socket.connect())[0]
        first = await socket.receive_json_from(timeout=10)  # its backlog, however slow the machine
        messages, code = await receive_all(socket)
        await socket.disconnect()
        return left, [first, *messages], code

    try:
        left, messages, code = scenario()
    finally:
        locker.close()
    assert left == ([], {})  # no recheck task and no subscription of the failed socket's
    assert code is None and messages[0]["type"] == "job"
