"""The job websocket in-process (channels' communicator, in-memory channel layer): backlog from a
seq, live fan-out, token auth, and refusal of outsiders."""
import asyncio
import contextlib
import json
import threading
import time
from datetime import datetime

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.db import database_sync_to_async
from django.db import transaction
from django.utils import timezone

from jobs import live
from jobs.models import Job, LogLine, MetricPoint
from jobs.serializers import JobDetailSerializer
from tests.support.builders import MANIFEST, client_for, job, member, tar_gz, token_for, upload
from tests.support.websockets import communicator_for, receive_all, session, status_change

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def lines(target, count):
    now = timezone.now()
    LogLine.objects.bulk_create(LogLine(job=target, seq=i, stream="stdout", time=now, line=f"l{i}")
                                for i in range(1, count + 1))


@contextlib.asynccontextmanager
async def sync_thread_held():
    """The one thread channels gives synchronous code, busy (as with a slow request) while inside."""
    release = threading.Event()
    busy = asyncio.ensure_future(sync_to_async(release.wait, thread_sensitive=True)(10))
    try:
        yield
    finally:
        release.set()
        await busy


def test_it_sends_the_job_then_the_backlog_after_since():
    alice = member()
    target = job(alice)
    lines(target, 5)
    MetricPoint.objects.create(job=target, name="loss", value=0.5, step=1, time=timezone.now())
    code, messages = session(f"/ws/jobs/{target.id}/?since=3&token={token_for(alice)}")
    assert code is None
    assert messages[0]["type"] == "job" and messages[0]["job"]["id"] == target.id
    assert [x["seq"] for x in messages[1]["lines"]] == [4, 5]
    assert messages[2] == {"type": "metrics", "points": [
        {"name": "loss", "step": 1, "value": 0.5, "time": messages[2]["points"][0]["time"], "learner": 0,
         "attempt": 1}]}


def test_it_forwards_live_records_published_after_connect():
    alice = member()
    target = job(alice)

    async def publish():
        from channels.layers import get_channel_layer
        await get_channel_layer().group_send(live.job_group(target.id), {
            "type": "job.logs", "lines": [{"seq": 1, "learner": 0, "stream": "stdout", "time": "t", "line": "hi"}]})

    _, messages = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}", then=publish)
    assert messages[-1] == {"type": "logs", "lines": [{"seq": 1, "learner": 0, "stream": "stdout", "time": "t",
                                                       "line": "hi"}]}


def test_a_status_only_socket_gets_the_job_and_its_changes_but_no_logs_or_metrics():
    alice = member()
    target = job(alice)
    lines(target, 3)
    MetricPoint.objects.create(job=target, name="loss", value=0.5, step=1, time=timezone.now())

    async def publish():
        from channels.layers import get_channel_layer
        layer = get_channel_layer()
        await layer.group_send(live.job_group(target.id), {
            "type": "job.logs", "lines": [{"seq": 4, "learner": 0, "stream": "stdout", "time": "t", "line": "hi"}]})
        await layer.group_send(live.job_group(target.id), {"type": "job.metrics", "points": [{"name": "loss"}]})
        await layer.group_send(live.job_group(target.id), {
            "type": "job.status", "status": {"job": target.id, "status": "COMPLETED"}, "job": {"id": target.id}})

    code, messages = session(f"/ws/jobs/{target.id}/?only=status&token={token_for(alice)}", then=publish)
    assert code is None
    assert [m["type"] for m in messages] == ["job", "status"]
    assert messages[0]["job"]["id"] == target.id and messages[1]["status"] == "COMPLETED"
    # Each change comes with the job as the REST API shows it, read after the change: a waiting
    # script returns that instead of asking again.
    detail = json.loads(json.dumps(JobDetailSerializer(Job.objects.get(pk=target.id)).data, default=str))
    assert messages[1]["detail"] == detail and "latest_metrics" in detail


def test_a_status_only_socket_reads_the_job_only_for_the_statuses_it_waits_until():
    alice = member()
    target = job(alice)

    async def publish():
        from channels.layers import get_channel_layer
        for status in ("STORING", "COMPLETED"):
            await get_channel_layer().group_send(live.job_group(target.id), {
                "type": "job.status", "status": {"job": target.id, "status": status}, "job": {"id": target.id}})

    _, messages = session(f"/ws/jobs/{target.id}/?only=status&until=COMPLETED,FAILED&token={token_for(alice)}",
                          then=publish)
    storing, completed = [m for m in messages if m["type"] == "status"]
    assert storing["status"] == "STORING" and "detail" not in storing
    assert completed["status"] == "COMPLETED" and completed["detail"]["id"] == target.id


@pytest.mark.parametrize("status", ["COMPLETED", "HALTED"])
def test_an_end_brings_the_jobs_detail_along_so_the_web_process_reads_nothing(monkeypatch, status):
    """A change to a status scripts wait for carries the job's REST detail to the job's own sockets,
    built by the process that made the change; the tenant's list gets the change without it."""
    alice = member("team-a", "alice")
    target = job(alice)
    MetricPoint.objects.create(job=target, name="loss", value=0.5, step=1, time=timezone.now())
    reads = []
    monkeypatch.setattr("jobs.consumers.JobConsumer._detail", lambda self: reads.append(self) or {})

    @database_sync_to_async
    def end():
        with transaction.atomic():
            target.status, target.updated_at = status, timezone.now()
            target.save(update_fields=["status", "updated_at"])
            live.publish_status_on_commit(target)

    token = token_for(alice)

    @async_to_sync
    async def scenario():
        waiting = communicator_for(f"/ws/jobs/{target.id}/?only=status&until={status}&token={token}")
        listing = communicator_for(f"/ws/jobs/?token={token}")
        assert (await waiting.connect())[0] and (await listing.connect())[0]
        await receive_all(waiting)  # the job, as it opened
        await end()
        changes = (await receive_all(waiting))[0], (await receive_all(listing))[0]
        await waiting.disconnect()
        await listing.disconnect()
        return changes

    [change], [burst] = scenario()
    detail = json.loads(json.dumps(JobDetailSerializer(Job.objects.get(pk=target.id)).data, default=str))
    assert change["status"] == status and change["detail"] == detail and detail["latest_metrics"]
    assert reads == []
    assert '"detail":' not in json.dumps(burst) and "manifest" not in json.dumps(burst)


def test_an_end_whose_detail_cannot_be_built_is_still_published_and_the_socket_reads_it(monkeypatch):
    alice = member("team-a", "alice")
    target = job(alice)

    def broken(job_id):
        raise RuntimeError("database gone")
    monkeypatch.setattr(live, "detail_of", broken)
    token = token_for(alice)

    @database_sync_to_async
    def end():
        with transaction.atomic():  # the change commits whatever happens to its publication
            target.status, target.updated_at = "COMPLETED", timezone.now()
            target.save(update_fields=["status", "updated_at"])
            live.publish_status_on_commit(target)

    reads = []

    async def read(self):
        reads.append(self)
        return {"id": target.id}
    monkeypatch.setattr("jobs.consumers.JobConsumer._detail", read)

    _, messages = session(f"/ws/jobs/{target.id}/?only=status&until=COMPLETED&token={token}", then=end)
    [change] = [m for m in messages if m["type"] == "status"]
    assert change["status"] == "COMPLETED" and change["detail"] == {"id": target.id} and len(reads) == 1
    assert Job.objects.get(pk=target.id).status == "COMPLETED"


def test_a_full_socket_gets_changes_without_the_jobs_rest_detail():
    """Reading the job for every change is for waiting scripts only, not for every open job page."""
    alice = member()
    target = job(alice)

    async def publish():
        from channels.layers import get_channel_layer
        await get_channel_layer().group_send(live.job_group(target.id), {
            "type": "job.status", "status": {"job": target.id, "status": "COMPLETED"}, "job": {"id": target.id}})

    _, messages = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}", then=publish)
    statuses = [m for m in messages if m["type"] == "status"]
    assert len(statuses) == 1 and "detail" not in statuses[0] and statuses[0]["job_detail"] == {"id": target.id}


@pytest.mark.parametrize("path_of", [lambda j: f"/ws/jobs/{j.id}/", lambda j: "/ws/jobs/"])
def test_it_refuses_a_connection_without_credentials(path_of):
    target = job(member())
    assert session(path_of(target)) == (4401, [])


@pytest.mark.parametrize("mode", ["", "only=status&"], ids=["full", "status-only"])
def test_an_outsider_is_refused_with_not_found_and_gets_no_data(mode):
    target = job(member("team-a", "alice"))
    lines(target, 3)
    outsider = member("team-b", "bob")
    assert session(f"/ws/jobs/{target.id}/?{mode}token={token_for(outsider)}") == (4404, [])


def test_a_status_change_does_not_wait_for_the_thread_of_synchronous_code():
    """That one thread of a web process serves its requests (an ingest batch, a submit): 100 sockets
    each waiting a turn there for every change put the fan-out seconds behind (bench controlplane)."""
    alice = member()
    target = job(alice)
    change = {"type": "job.status", "status": {"job": target.id, "status": "PROCESSING"},
              "job": live.status_payload(target)}
    path = f"/ws/jobs/?token={token_for(alice)}"

    @async_to_sync
    async def received_while_busy():
        from channels.layers import get_channel_layer
        communicator = communicator_for(path)
        assert (await communicator.connect())[0]
        try:
            async with sync_thread_held():
                await get_channel_layer().group_send(live.tenant_group(target.tenant_id), change)
                return await communicator.receive_json_from(timeout=2)
        finally:
            await communicator.disconnect()

    assert received_while_busy()["job"] == target.id


def test_a_socket_opens_while_the_thread_of_synchronous_code_is_busy():
    """Its credential check runs on a thread of its own, not queued behind that thread's work."""
    path = f"/ws/jobs/?token={token_for(member())}"

    @async_to_sync
    async def opened_while_busy():
        communicator = communicator_for(path)
        try:
            async with sync_thread_held():
                connected, _ = await communicator.connect(timeout=3)
                return connected
        finally:
            await communicator.disconnect()

    assert opened_while_busy()


def test_the_job_list_stream_carries_only_the_callers_tenant():
    target = job(member("team-a", "alice"))
    outsider = member("team-b", "bob")
    code, messages = session(f"/ws/jobs/?token={token_for(outsider)}", then=status_change(target))
    assert code is None and messages == []


def test_a_private_job_reaches_only_who_may_see_it_on_the_list_stream():
    alice, bob, ada = member("team-a", "alice"), member("team-a", "bob"), member("team-a", "ada", role="admin")
    secret = job(alice, private=True)
    assert session(f"/ws/jobs/?token={token_for(bob)}", then=status_change(secret)) == (None, [])
    for allowed in (alice, ada):
        _, messages = session(f"/ws/jobs/?token={token_for(allowed)}", then=status_change(secret))
        assert [m["job"] for m in messages] == [secret.id]


def test_a_new_job_reaches_the_list_stream_as_soon_as_it_is_queued():
    """Not only status changes: a submitted job shows up on open jobs pages without a reload."""
    alice, bob = member("team-a", "alice"), member("team-b", "bob")

    def submitter(who):
        @database_sync_to_async
        def submit():
            response = client_for(who).post("/api/v1/jobs/", {
                "manifest": upload(MANIFEST, "manifest.yml"), "code": upload(tar_gz({"run.sh": b"echo hi\n"}))},
                format="multipart")
            assert response.status_code == 201, response.json()
            return response.json()["id"]
        return submit

    _, messages = session(f"/ws/jobs/?token={token_for(alice)}", then=submitter(alice))
    assert [(m["job"], m["status"]) for m in messages] == [(m["job"], "QUEUED") for m in messages]
    assert len(messages) == 1
    # Another tenant's new job does not.
    assert session(f"/ws/jobs/?token={token_for(alice)}", then=submitter(bob)) == (None, [])


def test_a_status_message_says_when_the_change_was_made_and_when_it_was_published():
    """`time` is the change, `published` the commit that let it out: a transaction that went on after
    the change (an admission cycle) shows as the gap between them, not as a slow fan-out."""
    alice = member("team-a", "alice")
    target = job(alice)

    @database_sync_to_async
    def change_in_a_long_transaction():
        with transaction.atomic():
            target.status, target.updated_at = "PROCESSING", timezone.now()
            target.save(update_fields=["status", "updated_at"])
            live.publish_status_on_commit(target)
            time.sleep(0.3)

    _, messages = session(f"/ws/jobs/?token={token_for(alice)}", then=change_in_a_long_transaction)
    [message] = messages
    changed, published = (datetime.fromisoformat(message[key]).timestamp() for key in ("time", "published"))
    assert message["status"] == "PROCESSING"
    assert 0.3 <= published - changed < 5


def test_a_request_thread_hands_its_publishes_to_the_event_loop_and_they_leave_in_order(monkeypatch):
    """A web request does not wait while the loop publishes (it may be busy with many sockets); what
    it sends still leaves in the order sent (a job's log lines, by seq)."""
    published = []

    @async_to_sync
    async def scenario():
        from channels.layers import get_channel_layer

        from jobs.serving import ServingLoop
        gate = asyncio.Event()

        async def slow_group_send(group, message):
            await gate.wait()
            published.append(message["n"])
        monkeypatch.setattr(get_channel_layer(), "group_send", slow_group_send)

        def request():  # a view's thread, publishing after its commit
            for n in range(5):
                live._send(["job.1"], {"type": "job.logs", "n": n})
            return list(published)
        async def view(scope, receive, send):  # as the platform's ASGI application runs a view
            return await sync_to_async(request, thread_sensitive=False)()
        try:
            published_before_returning = await asyncio.wait_for(ServingLoop(view)({"type": "http"}, None, None), 2)
        finally:
            gate.set()
        for _ in range(100):
            if len(published) == 5:
                break
            await asyncio.sleep(0.01)
        return published_before_returning

    assert scenario() == []
    assert published == [0, 1, 2, 3, 4]


def test_the_list_stream_sends_changes_within_a_moment_of_each_other_together(monkeypatch):
    """The first change of a burst at once, the rest of it as one message; after a quiet moment the
    next change goes out alone, at once again."""
    from jobs import listhub
    monkeypatch.setattr(listhub, "COALESCE_S", 0.5)  # wide enough that a busy machine keeps the burst in one window
    alice = member()
    targets = [job(alice) for _ in range(4)]
    changes = [{"type": "job.status", "status": {"job": t.id, "status": "COMPLETED"}, "job": live.status_payload(t)}
               for t in targets]
    path, group = f"/ws/jobs/?token={token_for(alice)}", live.tenant_group(alice.tenant_id)

    @async_to_sync
    async def received():
        from channels.layers import get_channel_layer
        layer = get_channel_layer()
        communicator = communicator_for(path)
        assert (await communicator.connect())[0]
        for change in changes[:3]:
            await layer.group_send(group, change)
        messages = [await communicator.receive_json_from(timeout=2), await communicator.receive_json_from(timeout=2)]
        await asyncio.sleep(listhub.COALESCE_S * 2)  # quiet
        sent = time.monotonic()
        await layer.group_send(group, changes[3])
        messages.append(await communicator.receive_json_from(timeout=2))
        alone_after = time.monotonic() - sent
        await communicator.disconnect()
        return messages, alone_after

    (first, burst, alone), alone_after = received()
    assert first["type"] == "status" and first["job"] == targets[0].id
    assert burst["type"] == "statuses"
    assert [c["job"] for c in burst["changes"]] == [targets[1].id, targets[2].id]
    assert all(c["type"] == "status" and c["job_detail"]["id"] == c["job"] for c in burst["changes"])
    assert alone["type"] == "status" and alone["job"] == targets[3].id
    assert alone_after < listhub.COALESCE_S  # not held for a window


def test_the_sockets_of_a_tenant_share_one_subscription_and_each_gets_every_change(monkeypatch):
    """jobs.listhub: one channel in the tenant's group however many list sockets the process has; gone
    with the last of them."""
    from channels.layers import get_channel_layer
    from jobs import listhub
    monkeypatch.setattr(listhub, "COALESCE_S", 0.5)
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    targets = [job(alice) for _ in range(3)]
    group = live.tenant_group(alice.tenant_id)
    paths = [f"/ws/jobs/?token={token_for(who)}" for who in (alice, bob, alice)]

    @async_to_sync
    async def scenario():
        layer = get_channel_layer()
        sockets = [communicator_for(path) for path in paths]
        for socket in sockets:
            assert (await socket.connect())[0]
        members = len(layer.groups.get(group, {}))
        for target in targets:
            await layer.group_send(group, {"type": "job.status", "status": {"job": target.id, "status": "FAILED"},
                                           "job": live.status_payload(target)})
        received = []
        for socket in sockets:
            first, burst = await socket.receive_json_from(timeout=2), await socket.receive_json_from(timeout=2)
            received.append([first["job"]] + [c["job"] for c in burst["changes"]])
        for socket in sockets:
            await socket.disconnect()
        return members, received, len(layer.groups.get(group, {}))

    members, received, members_after = scenario()
    assert members == 1
    assert received == [[t.id for t in targets]] * 3
    assert members_after == 0


def test_a_burst_with_a_private_job_reaches_each_socket_with_what_it_may_see(monkeypatch):
    from channels.layers import get_channel_layer
    from jobs import listhub
    monkeypatch.setattr(listhub, "COALESCE_S", 0.5)
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    public, secret, later = job(alice), job(alice, private=True), job(alice)
    group = live.tenant_group(alice.tenant_id)
    paths = {who.user.username: f"/ws/jobs/?token={token_for(who)}" for who in (alice, bob)}

    @async_to_sync
    async def scenario():
        layer = get_channel_layer()
        sockets = {name: communicator_for(path) for name, path in paths.items()}
        for socket in sockets.values():
            assert (await socket.connect())[0]
        for target in (public, secret, later):
            await layer.group_send(group, {"type": "job.status", "status": {"job": target.id, "status": "FAILED"},
                                           "job": live.status_payload(target)})
        seen = {}
        for name, socket in sockets.items():
            first, burst = await socket.receive_json_from(timeout=2), await socket.receive_json_from(timeout=2)
            seen[name] = [first["job"]] + ([c["job"] for c in burst["changes"]] if burst["type"] == "statuses"
                                           else [burst["job"]])
            assert await socket.receive_nothing(timeout=0.6)
            await socket.disconnect()
        return seen

    assert scenario() == {"alice": [public.id, secret.id, later.id], "bob": [public.id, later.id]}


def test_a_burst_of_private_jobs_is_checked_once_per_user_not_per_socket_and_job(monkeypatch):
    """Each check is a trip to the database on the thread pool every tenant's sockets share: a private
    experiment's trials changing at once, times a user's many sockets, must not cost one check each."""
    from channels.layers import get_channel_layer
    from jobs import consumers, listhub
    monkeypatch.setattr(listhub, "COALESCE_S", 0.5)
    real, checks = consumers.JobListConsumer.__dict__["may_see"], []

    async def counted(self, *args):  # the real check, counted
        checks.append(args)
        return await real(self, *args)
    monkeypatch.setattr(consumers.JobListConsumer, "may_see", counted)
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    public, secrets, later = job(alice), [job(alice, private=True) for _ in range(12)], job(alice)
    group = live.tenant_group(alice.tenant_id)
    paths = [(name, f"/ws/jobs/?token={token_for(who)}") for name, who in
             (("alice", alice), ("alice", alice), ("alice", alice), ("bob", bob))]

    @async_to_sync
    async def scenario():
        layer = get_channel_layer()
        sockets = [(name, communicator_for(path)) for name, path in paths]
        for _, socket in sockets:
            assert (await socket.connect())[0]
        for target in (public, *secrets, later):
            await layer.group_send(group, {"type": "job.status", "status": {"job": target.id, "status": "FAILED"},
                                           "job": live.status_payload(target)})
        seen = []
        for name, socket in sockets:
            first, burst = await socket.receive_json_from(timeout=2), await socket.receive_json_from(timeout=2)
            seen.append((name, [first["job"]] + [c["job"] for c in burst.get("changes", [burst])]))
            assert await socket.receive_nothing(timeout=0.6)
            await socket.disconnect()
        return seen

    assert scenario() == [("alice", [public.id, *(s.id for s in secrets), later.id])] * 3 + [
        ("bob", [public.id, later.id])]
    assert len(checks) == 2  # the burst's private jobs: once for alice's three sockets, once for bob's


# --- what one socket can cost the others ----------------------------------------------------------------
def test_a_socket_that_takes_nothing_is_let_go_and_the_tenants_other_sockets_go_on(monkeypatch):
    from channels.generic.websocket import AsyncWebsocketConsumer
    from channels.layers import get_channel_layer
    from jobs import consumers, listhub
    monkeypatch.setattr(consumers, "SEND_TIMEOUT_S", 0.3)
    monkeypatch.setattr(listhub, "COALESCE_S", 0.05)
    alice, mallory = member("team-a", "alice"), member("team-a", "mallory", role="viewer")
    stalled = token_for(mallory)
    real_send = AsyncWebsocketConsumer.send

    async def send(self, text_data=None, bytes_data=None, close=False):
        if stalled.encode() in self.scope["query_string"]:
            await asyncio.sleep(3600)  # its client reads nothing: its connection's buffer stays full
        return await real_send(self, text_data=text_data, bytes_data=bytes_data, close=close)

    monkeypatch.setattr(AsyncWebsocketConsumer, "send", send)
    targets = [job(alice) for _ in range(3)]
    reading = token_for(alice)

    @async_to_sync
    async def scenario():
        layer = get_channel_layer()
        stuck = communicator_for(f"/ws/jobs/?token={stalled}")
        reader = communicator_for(f"/ws/jobs/?token={reading}")
        assert (await stuck.connect())[0] and (await reader.connect())[0]  # the stuck one first in line
        got = []
        for target in targets:
            await status_change(target)()
            message = await reader.receive_json_from(timeout=2)
            got += [message["job"]] if message["type"] == "status" else [c["job"] for c in message["changes"]]
        await stuck.wait(timeout=2)  # its consumer ended
        groups = {name for name, channels in layer.groups.items() if channels}
        await reader.disconnect()
        return got, groups

    got, groups = scenario()
    assert got == [t.id for t in targets]
    assert live.user_group(mallory.user_id) not in groups  # nothing more is queued for it


def test_one_user_holds_at_most_their_share_of_a_web_process_sockets_and_others_still_connect(settings):
    """Each socket costs the web process memory, a subscription and a recheck a minute: one member opening
    thousands would take it from everyone else. Past WEBSOCKETS_PER_USER (both streams together) a
    socket is refused with 4429; one closed makes room again."""
    settings.WEBSOCKETS_PER_USER = 2
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    target, alices, bobs = job(alice), token_for(alice), token_for(bob)

    @async_to_sync
    async def scenario():
        first = communicator_for(f"/ws/jobs/?token={alices}")
        second = communicator_for(f"/ws/jobs/{target.id}/?only=status&token={alices}")
        assert (await first.connect())[0] and (await second.connect())[0]
        await receive_all(second)
        third = communicator_for(f"/ws/jobs/?token={alices}")
        assert (await third.connect())[0]
        refused = await third.receive_output(timeout=2)
        neighbour = communicator_for(f"/ws/jobs/?token={bobs}")
        neighbour_connected = (await neighbour.connect())[0] and await neighbour.receive_nothing(timeout=0.3)
        await first.disconnect()
        again = communicator_for(f"/ws/jobs/?token={alices}")
        reopened = (await again.connect())[0] and await again.receive_nothing(timeout=0.3)
        for socket in (second, third, neighbour, again):
            await socket.disconnect()
        return refused, neighbour_connected, reopened

    refused, neighbour_connected, reopened = scenario()
    assert refused == {"type": "websocket.close", "code": 4429}
    assert neighbour_connected and reopened


def test_a_tenants_sockets_read_their_backlogs_a_few_at_a_time_and_others_are_not_held(monkeypatch):
    """A backlog spreads a job's metric points in the database on the thread pool every socket shares:
    one tenant opening many sockets on a large job reads BACKLOGS_PER_TENANT at once, and another
    tenant's socket gets its backlog meanwhile."""
    from jobs import consumers
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    theirs, mine = job(alice), job(bob)
    alices, bobs = token_for(alice), token_for(bob)
    release, reading, most = threading.Event(), [], [0]
    spread = consumers._spread_points

    def slow_spread(target):
        if target.id == theirs.id:
            reading.append(target.id)
            most[0] = max(most[0], len(reading))
            release.wait(10)
            reading.pop()
        return spread(target)
    monkeypatch.setattr(consumers, "_spread_points", slow_spread)

    @async_to_sync
    async def scenario():
        many = [communicator_for(f"/ws/jobs/{theirs.id}/?token={alices}") for _ in range(6)]
        for socket in many:
            assert (await socket.connect())[0]
        await asyncio.sleep(0.5)
        at_once = most[0]
        neighbour = communicator_for(f"/ws/jobs/{mine.id}/?token={bobs}")
        assert (await neighbour.connect())[0]
        first = await neighbour.receive_json_from(timeout=3)  # while alice's backlogs still wait
        release.set()
        for socket in many:
            assert (await socket.receive_json_from(timeout=5))["type"] == "job"
        for socket in (*many, neighbour):
            await socket.disconnect()
        return at_once, first

    at_once, first = scenario()
    assert at_once == consumers.BACKLOGS_PER_TENANT
    assert first["type"] == "job" and first["job"]["id"] == mine.id


def test_a_message_from_a_client_is_not_read_and_closes_its_socket():
    token = token_for(member())

    @async_to_sync
    async def scenario():
        socket = communicator_for(f"/ws/jobs/?token={token}")
        assert (await socket.connect())[0]
        await socket.send_to(text_data="[" * 1000 + "]" * 1000)
        return await socket.receive_output(timeout=2)

    assert scenario() == {"type": "websocket.close", "code": 1003}


def test_the_backlog_spreads_each_lines_points_over_its_length_and_keeps_the_newest_log_within_bytes(monkeypatch):
    from jobs import consumers
    monkeypatch.setattr(consumers, "BACKLOG_POINTS_PER_LINE", 50)
    monkeypatch.setattr(consumers, "BACKLOG_LOG_BYTES", 10 * len("l1000"))
    alice = member()
    target = job(alice)
    lines(target, 1000)
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=target, name="loss", value=i, step=i, time=now) for i in range(1000)]
                                    + [MetricPoint(job=target, name="acc", value=1.0, step=1, time=now)])
    code, messages = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}")
    logged = [line["seq"] for m in messages if m["type"] == "logs" for line in m["lines"]]
    assert logged == list(range(989, 1001))  # the newest that fit in 50 characters ("l989" … "l1000")
    [metrics] = [m for m in messages if m["type"] == "metrics"]
    loss = [p["step"] for p in metrics["points"] if p["name"] == "loss"]
    assert 40 <= len(loss) <= 50 and loss[0] == 0 and loss[-1] == 999 and loss == sorted(loss)
    assert [p["step"] for p in metrics["points"] if p["name"] == "acc"] == [1]


def test_the_backlog_is_bounded_over_all_lines_of_the_charts(monkeypatch):
    from jobs import consumers
    monkeypatch.setattr(consumers, "BACKLOG_POINTS", 100)
    monkeypatch.setattr(consumers, "BACKLOG_CHART_LINES", 5)
    alice = member()
    target = job(alice)
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=target, name=f"m{n}", value=i, step=i, time=now)
                                     for n in range(10) for i in range(100)])
    code, messages = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}")
    [metrics] = [m for m in messages if m["type"] == "metrics"]
    names = sorted({p["name"] for p in metrics["points"]})
    assert names == ["m0", "m1", "m2", "m3", "m4"]  # the first lines by name
    assert len(metrics["points"]) <= 100
    for name in names:  # each line still drawn over its whole length
        steps = [p["step"] for p in metrics["points"] if p["name"] == name]
        assert steps[0] == 0 and steps[-1] == 99
