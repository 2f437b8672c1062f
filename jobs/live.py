"""Fan-out of job updates to websocket clients, through the channel layer (Redis).

Publishing happens after the transaction commits, so a client never sees a status or a log line
that a rollback later takes back. A broken channel layer never fails the write that triggered it.

Access can end while a socket is open (a token revoked, a user deactivated or logged out, a job
unshared, a membership removed or its role changed). Each socket joins its user's group; the model
signals below send that group an `access.recheck` once the change commits, whichever path made it
(API, page, admin console, manage.py), and the consumers re-run their access check (jobs.consumers).
"""
import asyncio
import logging
import os
import threading
import weakref

from channels.layers import get_channel_layer
from django.db import transaction
from django.utils import timezone

from jobs.models import AT_REST, FINAL, Job
from jobs.serving import serving_loop

log = logging.getLogger(__name__)
CHUNK = 500  # lines per websocket message: big enough to batch, small enough to render smoothly
PUBLISH_TIMEOUT_S = 10.0  # a publication outside an ASGI server waits at most this (Redis unreachable)
# Deleted jobs named in one message to a tenant's list: an experiment's trials go in a few messages, each
# small enough for the channel layer and for a page to take at once. Also the most jobs of one deletion
# whose own sockets are told: the process's publications wait in one queue, so an experiment of ten
# thousand trials must not hold every tenant's live updates behind it; the sockets of the trials past
# it close at their access recheck (jobs.consumers) instead.
DELETED_BATCH = 1000


def job_group(job_id):
    return f"job.{job_id}"


def tenant_group(tenant_id):
    return f"tenant.{tenant_id}.jobs"


def user_group(user_id):
    return f"user.{user_id}"


def status_payload(job):
    """What a socket needs to redraw a job's status (the list row, the job page's header): a few
    columns of the row in hand. No serializer and no query: it is built inside the transaction of
    every status change, which for admissions holds the cluster-wide scheduling lock."""
    def iso(value):
        return value.isoformat() if value else None
    return {"id": job.id, "status": job.status, "status_reason": job.status_reason, "wait_reason": job.wait_reason,
            "attempt": job.attempt, "retries": job.retries, "exit_code": job.exit_code, "private": job.private,
            "final": job.status in FINAL, "created_at": iso(job.created_at), "started_at": iso(job.started_at),
            "finished_at": iso(job.finished_at), "page_url": f"/jobs/{job.id}/"}


def publish_status_on_commit(job):
    status = {"job": job.id, "status": job.status, "reason": job.status_reason, "attempt": job.attempt,
              "exit_code": job.exit_code, "time": job.updated_at.isoformat()}
    payload, own, listing = status_payload(job), job_group(job.id), tenant_group(job.tenant_id)
    # A change to a status at rest (what a script waits for) carries the job's REST detail to the job's
    # own sockets, built once after the commit, rather than read by the web process for each socket.
    detailed = job.status in AT_REST

    def send():
        # `time` is when the change was made, inside a transaction that may have gone on for a while
        # (an admission cycle's lasts as long as the cycle); `published` is when it became visible
        # and left for the sockets, so a client can tell the two delays apart.
        message = {"type": "job.status", "status": {**status, "published": timezone.now().isoformat()},
                   "job": payload}
        if not detailed:
            _send([own, listing], message)
            return
        _send([own], dict(message, detail=_detail_or_none(job.id)))  # the tenant's list needs no detail
        _send([listing], message)
    transaction.on_commit(send)


def _detail_or_none(job_id):
    try:
        return detail_of(job_id)
    except Exception:  # noqa: BLE001 - best effort, like the publication: without it the sockets read it
        log.warning("could not read %s for its sockets", job_id, exc_info=True)
        return None


def detail_of(job_id):
    """The job as the REST API shows it now (None if it is gone). No access check: only sockets that
    may see the job get it (each checked at connect, and again whenever access may have ended)."""
    from jobs.serializers import JobDetailSerializer
    job = Job.objects.select_related("owner", "tenant").filter(pk=job_id).first()
    return None if job is None else JobDetailSerializer(job).data


def on_status_change(job, *, before, when):
    """jobs.states listener (connected in JobsConfig.ready): every status change reaches the sockets."""
    publish_status_on_commit(job)


def publish_records_on_commit(job_id, lines, points):
    """lines, points: already in their JSON shape (jobs.serializers)."""
    if not lines and not points:
        return
    messages = [{"type": "job.logs", "lines": lines[i:i + CHUNK]} for i in range(0, len(lines), CHUNK)]
    if points:
        messages.append({"type": "job.metrics", "points": points})
    transaction.on_commit(lambda: _send([job_group(job_id)], *messages))


def recheck_user_on_commit(user_id):
    """Make every open socket of this user check again whether it may still see what it streams."""
    if user_id is not None:
        transaction.on_commit(lambda: _send([user_group(user_id)], {"type": "access.recheck"}))


def publish_deleted_on_commit(jobs, *, when):
    """Once the deletion of `jobs` commits (jobs.deletion), tell whoever follows them that they went:
    its tenant's list, DELETED_BATCH jobs a message (an experiment's thousands of trials are a few
    messages, each one for the list hub to forward), naming the private ones, which the hub forwards only
    to those who could see them (jobs.listhub); and the own sockets of the first DELETED_BATCH jobs, which
    then close (jobs.consumers). `when`: the deletion's time."""
    named = [(job.id, job.tenant_id, job.private) for job in jobs]
    time = when.isoformat()

    def send():
        sends, by_tenant = [], {}
        for job_id, tenant_id, private in named:
            by_tenant.setdefault(tenant_id, []).append((job_id, private))
        for tenant_id, listed in by_tenant.items():
            for start in range(0, len(listed), DELETED_BATCH):
                batch = listed[start:start + DELETED_BATCH]
                sends.append((tenant_group(tenant_id), {
                    "type": "jobs.deleted", "jobs": [job_id for job_id, _ in batch],
                    "private": [job_id for job_id, private in batch if private], "time": time}))
        sends += [(job_group(job_id), {"type": "job.deleted", "job": job_id, "time": time})
                  for job_id, _, _ in named[:DELETED_BATCH]]
        _send_each(sends)
    if named:
        transaction.on_commit(send)


def _send(groups, *messages):
    _send_each([(group, message) for message in messages for group in groups])


def _send_each(sends):
    """sends: (group, message) pairs, published in this order."""
    layer = get_channel_layer()
    if layer is None:
        return
    loop = serving_loop()
    if loop is not None:
        # A web request's thread: the process's event loop publishes, and the request goes on rather
        # than wait for a loop busy with its sockets.
        try:
            loop.call_soon_threadsafe(_enqueue, layer, sends)
            return
        except RuntimeError:  # the loop closed meanwhile (the process is stopping): send from here
            pass
    try:
        # Outside an ASGI server (a Celery worker, a management command): the process's own publishing
        # loop, one trip for every group and message, waited for so they leave in order.
        asyncio.run_coroutine_threadsafe(_group_send_all(layer, sends), _publishing_loop()).result(PUBLISH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - live updates are best effort; REST and the backlog are the record
        log.warning("could not publish to %s", _groups_named(sends), exc_info=True)


def _groups_named(sends):
    groups = list(dict.fromkeys(group for group, _ in sends))
    return ", ".join(groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")


_publisher = (None, None)  # (pid, event loop) of this process's publishing loop
_publisher_lock = threading.Lock()


def _publishing_loop():
    """This process's own event loop, in a daemon thread, publishing for code outside an ASGI server, so
    the channel layer keeps one Redis connection rather than a loop and a connection per publication
    (async_to_sync). Per process id: a forked child (Celery's pool) has no parent's thread, and starts its own."""
    global _publisher
    pid, loop = _publisher
    if pid == os.getpid() and loop.is_running():
        return loop
    with _publisher_lock:
        pid, loop = _publisher
        if pid != os.getpid() or not loop.is_running():
            loop = asyncio.new_event_loop()
            started = threading.Event()
            loop.call_soon(started.set)
            threading.Thread(target=loop.run_forever, name="live-publisher", daemon=True).start()
            started.wait(PUBLISH_TIMEOUT_S)
            _publisher = (os.getpid(), loop)
        return loop


# One queue and one publishing task per event loop: messages leave in the order they were sent (a job's
# log lines by seq; concurrent publishes could take different Redis connections and overtake).
_queues = weakref.WeakKeyDictionary()


def _enqueue(layer, sends):
    """Runs in the event loop (call_soon_threadsafe)."""
    loop = asyncio.get_running_loop()
    queue = _queues.get(loop)
    if queue is None:
        queue = _queues[loop] = asyncio.Queue()
        loop.create_task(_publish_forever(queue))
    queue.put_nowait((layer, sends))


async def _publish_forever(queue):
    while True:
        layer, sends = await queue.get()
        try:
            await _group_send_all(layer, sends)
        except Exception:  # noqa: BLE001 - as above: best effort, the next message is tried anyway
            log.warning("could not publish to %s", _groups_named(sends), exc_info=True)


async def _group_send_all(layer, sends):
    for group, message in sends:
        await layer.group_send(group, message)


# --- what ends access: each receiver names the user whose sockets must check again --------------
def _ends_nothing(kwargs):
    # Something new grants, never takes away; fixtures and migrations (raw) have no sockets to close.
    return kwargs.get("created") or kwargs.get("raw")


def _recheck_holder(sender, instance, **kwargs):
    """A token, membership or object permission of a user changed or went."""
    if not _ends_nothing(kwargs):
        recheck_user_on_commit(instance.user_id)


def _recheck_user(sender, instance, **kwargs):
    # Deactivation and a password change (which voids the user's other sessions) are saves of the user.
    if not _ends_nothing(kwargs):
        recheck_user_on_commit(instance.pk)


def _recheck_session_user(sender, instance, **kwargs):
    # Logging out deletes the session row; the browser's socket rode on it.
    try:
        user_id = instance.get_decoded().get("_auth_user_id")
    except Exception:  # noqa: BLE001 - an undecodable session authenticated nobody
        return
    recheck_user_on_commit(user_id)


def connect_access_signals():
    from django.contrib.auth import get_user_model
    from django.contrib.sessions.models import Session
    from django.db.models.signals import post_delete, post_save
    from guardian.models import UserObjectPermission

    from tenants.models import ApiToken, Membership
    for model, receiver in ((ApiToken, _recheck_holder), (Membership, _recheck_holder),
                            (UserObjectPermission, _recheck_holder), (get_user_model(), _recheck_user)):
        post_save.connect(receiver, sender=model, dispatch_uid=f"live-recheck-save-{model.__name__}")
        post_delete.connect(receiver, sender=model, dispatch_uid=f"live-recheck-delete-{model.__name__}")
    post_delete.connect(_recheck_session_user, sender=Session, dispatch_uid="live-recheck-logout")
