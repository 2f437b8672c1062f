"""What open sockets hear of a deletion (jobs.deletion, jobs.live, jobs.listhub, jobs.consumers): the job's
own sockets are told and closed, the tenant's list drops it, a private job's deletion reaches only those
who could see it, and an experiment's trials go in a few messages. Deletions are made through the API, in
a thread like any request, and reach the sockets through the platform's channel layer (Redis pub/sub) on
a Redis of the test's own."""
import asyncio
import contextlib

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.utils import timezone
from guardian.shortcuts import assign_perm

from jobs import consumers, listhub, live, tenancy
from jobs.models import Experiment, Job, Status, Trial
from portal import fanout
from tests.support.builders import client_for, job, member, record_sends, token_for
from tests.support.websockets import communicator_for, receive_all, session

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def pubsub_layer(settings, redis_url, monkeypatch):
    settings.CHANNEL_LAYERS = fanout.channel_layers(redis_url)
    record_sends(monkeypatch)


def deleting(who, path):
    """The DELETE of `path` by `who`, as a request makes it (its own thread, committing on its own)."""
    @database_sync_to_async
    def delete():
        response = client_for(who).delete(path)
        assert response.status_code == 202, response.json()
    return delete


@contextlib.asynccontextmanager
async def sockets(*paths):
    opened = [communicator_for(path) for path in paths]
    try:
        for socket in opened:
            assert (await socket.connect())[0]
        yield opened
    finally:
        for socket in opened:
            await socket.disconnect()


def deleted_ids(messages):
    """The job ids the list messages say were deleted, in order."""
    changes = [c for m in messages for c in (m["changes"] if m["type"] == "statuses" else [m])]
    return [job_id for c in changes if c["type"] == "deleted" for job_id in c["jobs"]]


def finished_experiment(owner, trials, *, private=False):
    experiment = Experiment.objects.create(
        tenant=owner.tenant, owner=owner.user, name="sweep", manifest_yaml="", searcher="random", private=private,
        spec={"searcher": {"name": "random", "metric": "acc", "max_trials": trials, "max_concurrent_trials": 1},
              "hyperparameters": []},
        metric="acc", code_sha256="0" * 64, state="COMPLETED", finished_at=timezone.now())
    for number in range(trials):
        Trial.objects.create(experiment=experiment, number=number, params={"lr": 0.1},
                             job=job(owner, status=Status.COMPLETED, private=private))
    return experiment


def test_it_tells_the_jobs_sockets_and_closes_them_and_its_tenants_list_drops_it():
    alice = member("team-a", "alice")
    target, kept = job(alice, status=Status.COMPLETED), job(alice, status=Status.COMPLETED)
    token = token_for(alice)

    @async_to_sync
    async def scenario():
        paths = (f"/ws/jobs/{target.id}/?token={token}", f"/ws/jobs/{target.id}/?only=status&token={token}",
                 f"/ws/jobs/{kept.id}/?token={token}", f"/ws/jobs/?token={token}")
        async with sockets(*paths) as opened:
            for socket in opened:
                await receive_all(socket)  # each job socket's job and backlog
            await deleting(alice, f"/api/v1/jobs/{target.id}/")()
            return [await receive_all(socket) for socket in opened]

    page, waiting, other, listing = scenario()
    for messages, code in (page, waiting):
        [told] = messages
        assert told["type"] == "deleted" and told["job"] == target.id and told["time"]
        assert code == consumers.CLOSE_NOT_FOUND
    assert other == ([], None)  # another job's socket hears nothing and stays open
    messages, code = listing
    assert code is None and deleted_ids(messages) == [target.id]
    assert Job.objects.get(pk=target.id).deleted_at.isoformat() == messages[0]["time"]
    # A socket opened for it from now on is refused as one for an unknown job is.
    assert session(f"/ws/jobs/{target.id}/?token={token}") == (consumers.CLOSE_NOT_FOUND, [])
    assert session(f"/ws/jobs/{target.id}/?only=status&token={token}") == (consumers.CLOSE_NOT_FOUND, [])


def test_a_socket_opening_as_its_job_is_deleted_is_closed_without_the_job(monkeypatch):
    """The deletion commits after the socket found the job and before it joined the job's group, so its
    message never reaches the socket: the backlog's read finds the job deleted instead."""
    alice = member("team-a", "alice")
    target = job(alice, status=Status.COMPLETED)
    found = tenancy.job_or_404

    def found_then_deleted(membership, job_id):
        row = found(membership, job_id)
        Job.objects.filter(pk=job_id).update(deleted_at=timezone.now(), deleted_by="bob")
        return row
    monkeypatch.setattr(tenancy, "job_or_404", found_then_deleted)
    assert session(f"/ws/jobs/{target.id}/?token={token_for(alice)}") == (consumers.CLOSE_NOT_FOUND, [])


def test_a_private_jobs_deletion_reaches_only_those_who_could_see_it():
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    ada, carol = member("team-a", "ada", role="admin"), member("team-a", "carol", role="viewer")
    secret = job(alice, status=Status.COMPLETED, private=True)
    assign_perm("jobs.view_job", carol.user, secret)
    paths = [f"/ws/jobs/?token={token_for(who)}" for who in (alice, bob, ada, carol)]

    @async_to_sync
    async def scenario():
        async with sockets(*paths) as opened:
            await deleting(alice, f"/api/v1/jobs/{secret.id}/")()
            return [await receive_all(socket) for socket in opened]

    seen_by_alice, seen_by_bob, seen_by_ada, seen_by_carol = scenario()
    assert seen_by_bob == ([], None)
    for messages, code in (seen_by_alice, seen_by_ada, seen_by_carol):
        assert deleted_ids(messages) == [secret.id]


def test_a_burst_of_deletions_reaches_each_list_socket_with_what_it_could_see(monkeypatch):
    monkeypatch.setattr(listhub, "COALESCE_S", 0.5)
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    public, secret, later = (job(alice, status=Status.COMPLETED, private=private) for private in (False, True, False))
    Job.objects.filter(pk__in=[public.id, secret.id, later.id]).update(deleted_at=timezone.now(), deleted_by="alice")
    group = live.tenant_group(alice.tenant_id)
    paths = [f"/ws/jobs/?token={token_for(who)}" for who in (alice, bob)]

    @async_to_sync
    async def scenario():
        from channels.layers import get_channel_layer
        layer = get_channel_layer()
        async with sockets(*paths) as opened:
            await layer.group_send(group, {"type": "jobs.deleted", "jobs": [public.id], "private": [], "time": "t"})
            await layer.group_send(group, {"type": "jobs.deleted", "jobs": [secret.id, later.id],
                                           "private": [secret.id], "time": "t"})
            await asyncio.sleep(listhub.COALESCE_S * 2)  # the burst's window closed
            return [(await receive_all(socket))[0] for socket in opened]

    for_alice, for_bob = scenario()
    assert deleted_ids(for_alice) == [public.id, secret.id, later.id]
    assert deleted_ids(for_bob) == [public.id, later.id]
    assert "private" not in str(for_alice) + str(for_bob)


def test_an_experiments_trials_are_announced_a_batch_a_message_and_the_newest_told_on_their_own_sockets(monkeypatch):
    monkeypatch.setattr(live, "DELETED_BATCH", 2)
    monkeypatch.setattr(listhub, "COALESCE_S", 0.5)  # the batches after the first arrive together
    alice = member("team-a", "alice")
    experiment = finished_experiment(alice, 5)
    trials = list(Job.objects.filter(trial__experiment=experiment).order_by("trial__number").values_list("id", flat=True))
    token = token_for(alice)

    @async_to_sync
    async def scenario():
        async with sockets(f"/ws/jobs/?token={token}", f"/ws/jobs/{trials[-1]}/?only=status&token={token}",
                           f"/ws/jobs/{trials[0]}/?only=status&token={token}") as opened:
            await receive_all(opened[1])
            await receive_all(opened[2])
            await deleting(alice, f"/api/v1/experiments/{experiment.id}/")()
            await asyncio.sleep(listhub.COALESCE_S * 2)
            return [await receive_all(socket) for socket in opened]

    (listed, _), (waiting, code), untold = scenario()
    assert sorted(deleted_ids(listed)) == sorted(trials)
    first, burst = listed
    assert first["type"] == "deleted" and len(first["jobs"]) == 2
    assert [len(change["jobs"]) for change in burst["changes"]] == [2, 1]
    assert waiting == [{"type": "deleted", "job": trials[-1], "time": first["time"]}]
    assert code == consumers.CLOSE_NOT_FOUND
    # Only the newest DELETED_BATCH trials' own sockets are told; the oldest's closes at its recheck.
    assert untold == ([], None)


def test_a_private_experiments_trials_reach_only_those_who_could_see_them():
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    experiment = finished_experiment(alice, 3, private=True)
    trials = set(Job.objects.filter(trial__experiment=experiment).values_list("id", flat=True))
    paths = [f"/ws/jobs/?token={token_for(who)}" for who in (alice, bob)]

    @async_to_sync
    async def scenario():
        async with sockets(*paths) as opened:
            await deleting(alice, f"/api/v1/experiments/{experiment.id}/")()
            await asyncio.sleep(listhub.COALESCE_S * 2)
            return [await receive_all(socket) for socket in opened]

    (for_alice, _), for_bob = scenario()
    assert set(deleted_ids(for_alice)) == trials
    assert for_bob == ([], None)


def test_a_refused_deletion_tells_nobody():
    """A job still running is not deleted: nothing is published, its sockets stay open."""
    alice = member("team-a", "alice")
    running = job(alice, status=Status.PROCESSING)
    token = token_for(alice)

    @database_sync_to_async
    def refused():
        assert client_for(alice).delete(f"/api/v1/jobs/{running.id}/").status_code == 409

    @async_to_sync
    async def scenario():
        async with sockets(f"/ws/jobs/{running.id}/?token={token}", f"/ws/jobs/?token={token}") as opened:
            await receive_all(opened[0])
            await refused()
            return [await receive_all(socket) for socket in opened]

    assert scenario() == [([], None), ([], None)]
