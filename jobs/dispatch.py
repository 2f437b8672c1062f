"""Waking the platform's processes: a Celery worker by the name of a lifecycle task (so no module
imports jobs.tasks to enqueue work: jobs.tasks imports the lifecycle, not the other way round), and
the scheduling loop (jobs.scheduler_loop) through a Redis list it waits on.

A wake only wakes: what to do is already in the database (an outbox row, jobs.outbox, or the queue
the scheduling loop reads), the reconcile pass sends again whatever is still undone, and the loop
runs a cycle every few seconds even when no wake arrives. So a broker or Redis that cannot be reached
delays work and says so in the log; it does not fail the request or the task that changed the state.
"""
import logging
import os
import queue
import threading

import redis
from celery import current_app
from django.conf import settings
from django.db import transaction
from kombu.exceptions import ChannelError, OperationalError

from jobs.serving import serving_loop

log = logging.getLogger(__name__)
PREFIX = "jobs.tasks."
# The Redis list the scheduling loop blocks on (BLPOP). A wake pushes one item and trims the list to
# it, so a loop that is down finds one waiting when it comes back, never a pile.
SCHEDULER_WAKE_KEY = "trainyard:scheduler:wake"


def send(task, *args, countdown=None):
    """Send jobs.tasks.<task>(*args) now."""
    try:
        current_app.send_task(PREFIX + task, args=args, countdown=countdown)
    except (OperationalError, OSError) as exc:
        log.warning("could not send %s%s to the broker (%s); the reconcile pass sends it again", task, args, exc)


def send_on_commit(task, *args):
    """Send jobs.tasks.<task>(*args) once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: _leave(send, task, *args))


def wake_scheduler():
    """Have the scheduling loop run a cycle soon (after its minimum interval): something changed that
    may let a queued job in (a submission, resources released, a quota changed)."""
    try:
        with _redis().pipeline(transaction=True) as pipe:
            pipe.lpush(SCHEDULER_WAKE_KEY, 1).ltrim(SCHEDULER_WAKE_KEY, 0, 0).execute()
    except (redis.RedisError, OSError) as exc:
        log.warning("could not wake the scheduling loop (%s); its periodic cycle runs anyway", exc)


def wake_scheduler_on_commit():
    """wake_scheduler() once the current transaction commits (at once outside one): the cycle it
    wakes must see the change."""
    transaction.on_commit(lambda: _leave(wake_scheduler))


def _leave(call, *args):
    """Serving a web request, a message leaves from the process's sending thread instead
    (`_send_later`), so the response does not wait for its round trip to the broker or Redis, a good
    part of a submission's time under load. Nothing depends on the moment: a message only wakes."""
    if serving_loop():
        _send_later(call, *args)
    else:
        call(*args)


_redis_client = (None, None, None)  # (pid, URL, redis.Redis) of this process


def _redis():
    """This process's Redis client for wakes (short timeouts: a Redis that hangs must not hang the
    request or task that wakes)."""
    global _redis_client
    pid, url, client = _redis_client
    if pid != os.getpid() or url != settings.REDIS_URL:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
        _redis_client = (os.getpid(), settings.REDIS_URL, client)
    return client


_sender = (None, None)  # (pid, queue) of this process's sending thread
_sender_lock = threading.Lock()


def _send_later(call, *args):
    global _sender
    pid, outgoing = _sender
    if pid != os.getpid():
        with _sender_lock:
            pid, outgoing = _sender
            if pid != os.getpid():  # none yet, or the parent's (a forked child has no such thread)
                outgoing = queue.SimpleQueue()
                threading.Thread(target=_send_forever, args=(outgoing,), name="dispatch-sender", daemon=True).start()
                _sender = (os.getpid(), outgoing)
    outgoing.put((call, args))


def _send_forever(outgoing):
    while True:
        call, args = outgoing.get()
        try:
            call(*args)  # a broker it cannot reach it logs, as from a request
        except Exception:  # noqa: BLE001 - the thread outlives any one message; the reconcile pass resends
            log.exception("sending %s%s failed", getattr(call, "__name__", call), args)


def backlog(queue=None):
    """How many messages wait in `queue` (the workers' default one when None) for a worker to take
    them (None: the broker cannot tell). The outbox sweep asks before it sends rows again (jobs.outbox.sweep)."""
    try:
        with current_app.connection_for_read() as connection:
            queue_name = queue or current_app.conf.task_default_queue
            return connection.default_channel.queue_declare(queue=queue_name, passive=True).message_count
    except ChannelError:  # no such queue yet: nothing was ever sent, or the broker lost it all
        return 0
    except Exception as exc:  # noqa: BLE001 - unknown: the sweep then sends as if none waited
        log.warning("could not read the length of the workers' queue (%s)", exc)
        return None
