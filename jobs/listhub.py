"""One subscription per web process and tenant for the job list's sockets (`/ws/jobs/`).

Every socket of a tenant's list gets every status change of the tenant's jobs. A group membership per
socket cost a decoding and a dispatch per socket and change, and bursts left the sockets seconds
behind. Here one hub per tenant joins the group with one channel, reads each change once, and sends
the sockets one message per burst: the first
change at once, the changes of the next COALESCE_S together (`{"type": "statuses", "changes": [...]}`),
each as a lone `status` message would be. A burst's message is encoded once for every socket that
sees all of it; a private job's change reaches only the sockets that may see it, checked once per user
and burst.

Deletions (jobs.live.publish_deleted_on_commit) come as batches of job ids and go out as changes of their
own in the same bursts, `{"type": "deleted", "jobs": [ids], "time"}`; the private jobs among them are
checked with the burst's, and reach only those who could see them before they went.
"""
import asyncio
import json
import logging
import weakref

from channels.layers import get_channel_layer

from jobs import live

log = logging.getLogger(__name__)
COALESCE_S = 0.05

_hubs = weakref.WeakKeyDictionary()  # event loop -> {tenant id: TenantHub}


async def join(tenant_id, socket):
    """Start sending `socket` the status changes of `tenant_id`'s jobs."""
    hubs = _hubs.setdefault(asyncio.get_running_loop(), {})
    while True:
        hub = hubs.get(tenant_id)
        if hub is None:
            hub = hubs[tenant_id] = TenantHub(tenant_id, hubs)
        if await hub.add(socket):
            return
        # it closed while we waited for it (its last socket left): the next one is made afresh


async def leave(tenant_id, socket):
    hub = _hubs.get(asyncio.get_running_loop(), {}).get(tenant_id)
    if hub is not None:
        await hub.remove(socket)


class TenantHub:
    def __init__(self, tenant_id, registry):
        self.group = live.tenant_group(tenant_id)
        self.registry, self.tenant_id = registry, tenant_id
        self.sockets = []  # in joining order
        self.lock = asyncio.Lock()  # joining and leaving, which subscribe and unsubscribe
        self.layer = self.channel = self.reader = None
        self.closed = False
        self.held = None  # changes waiting for the window to close; None when no window is open
        self.flusher = None

    async def add(self, socket):
        async with self.lock:
            if self.closed:
                return False
            if self.channel is None:
                self.layer = get_channel_layer()
                self.channel = await self.layer.new_channel()
                await self.layer.group_add(self.group, self.channel)
                self.reader = asyncio.ensure_future(self._read())
            self.sockets.append(socket)
            return True

    async def remove(self, socket):
        async with self.lock:
            if socket in self.sockets:
                self.sockets.remove(socket)
            if self.sockets or self.closed:
                return
            self.closed = True
            if self.registry.get(self.tenant_id) is self:
                del self.registry[self.tenant_id]
            for task in (self.reader, self.flusher):
                if task is not None:
                    task.cancel()
            if self.channel is not None:
                await self.layer.group_discard(self.group, self.channel)

    async def _read(self):
        while True:
            try:
                message = await self.layer.receive(self.channel)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the layer lost Redis: try again, as channels' consumers do
                log.warning("the job list's subscription for %s failed; retrying", self.group, exc_info=True)
                await asyncio.sleep(1)
                continue
            change = _change_in(message)
            if change is None:
                continue
            if self.held is not None:
                self.held.append(change)
                continue
            self.held = []
            self.flusher = asyncio.ensure_future(self._flush())
            await self._deliver([change])

    async def _flush(self):
        while True:
            await asyncio.sleep(COALESCE_S)
            held, self.held = self.held, []
            if not held:
                self.held = None  # quiet for a whole window: the next change goes out at once
                return
            await self._deliver(held)

    async def _deliver(self, changes):
        shared = None  # the message for a socket that sees every change, encoded once
        private = {change["job"] for change in changes if _is_private_status(change)}
        deleted = frozenset().union(*(change.private for change in changes if isinstance(change, Deleted)))
        # What each user may see of the burst's private jobs, checked once per user and burst, never per
        # socket and change: a private experiment's thousands of trials times a user's hundreds of sockets
        # would hold the thread pool every tenant's sockets share.
        sights = {}
        for socket in list(self.sockets):
            try:
                if socket.sight not in sights:
                    sights[socket.sight] = await _sight_of(socket, private, deleted)
                seen = [_as_seen(change, sights[socket.sight]) for change in changes]
                if all(mine is whole for mine, whole in zip(seen, changes)):
                    shared = shared or _encode(changes)
                    await socket.send(text_data=shared)
                elif seen := [change for change in seen if change is not None]:
                    await socket.send(text_data=_encode(seen))
            except Exception:  # noqa: BLE001 - that socket went away meanwhile, or takes nothing (let go)
                log.debug("could not send status changes to a list socket", exc_info=True)
                if socket in self.sockets:
                    self.sockets.remove(socket)  # never waited on again


class Deleted(dict):
    """A deletion's change as the sockets get it, and beside it (not sent) which of its jobs are private."""

    def __init__(self, message):
        super().__init__(type="deleted", jobs=list(message["jobs"]), time=message.get("time"))
        self.private = frozenset(message.get("private") or ())


def _change_in(message):
    """The change a message of the tenant's group brings its sockets, or None for anything else."""
    if message.get("type") == "job.status":
        return {"type": "status", **message["status"], "job_detail": message["job"]}
    if message.get("type") == "jobs.deleted":
        return Deleted(message)
    return None


def _is_private_status(change):
    return not isinstance(change, Deleted) and bool(change["job_detail"].get("private"))


async def _sight_of(socket, private, deleted):
    """Of a burst's private jobs, those the socket's user may see: the live ones, and the deleted ones
    they could see before they went (one query each for the batch)."""
    visible = set(await socket.may_see(private)) if private else set()
    return visible | (set(await socket.may_have_seen(deleted)) if deleted else set())


def _as_seen(change, visible):
    """`change` as a socket whose user may see `visible` of the burst's private jobs sees it: itself, None,
    or for a deletion the one without the private jobs its user could not see."""
    if isinstance(change, Deleted):
        hidden = change.private - visible
        if not hidden:
            return change
        jobs = [job_id for job_id in change["jobs"] if job_id not in hidden]
        return {**change, "jobs": jobs} if jobs else None
    if not _is_private_status(change) or change["job"] in visible:
        return change
    return None


def _encode(changes):
    return json.dumps(changes[0] if len(changes) == 1 else {"type": "statuses", "changes": changes})
