"""Waking workers: send a lifecycle task by name, so no module imports jobs.tasks to enqueue work
(jobs.tasks imports the lifecycle, not the other way round).

A message only wakes a worker; what it should do is already in the database (an outbox row,
jobs.outbox, or the queue the scheduler reads), and the reconcile pass sends again whatever is
still undone. So a broker that cannot be reached delays work and says so in the log; it does not
fail the request or the task that changed the state.
"""
import logging
import math
import os
import queue
import threading
import time
from contextlib import contextmanager

from celery import current_app
from django.core.cache import cache
from django.db import transaction
from kombu.exceptions import ChannelError, OperationalError

from jobs.serving import serving_loop

log = logging.getLogger(__name__)
PREFIX = "jobs.tasks."
# Tasks without arguments whose one run serves every request made before it starts (a scheduling
# cycle and the autoscaler read the whole queue): a request while one is already waiting to start
# sends nothing. A burst of submits and finishes then costs a few cycles instead of one each
# (bench concurrency).
COALESCED = {"schedule", "autoscale"}
# A waiting mark lives this long at most: if its message is lost, requests send again after it
# (and the reconcile pass runs a cycle meanwhile). Longer than OVERDUE_S, or nothing is ever overdue.
COALESCE_TTL_S = 60
# Pacing (rest_left, ran, defer; jobs.tasks.schedule): a scheduling cycle rests after each run as
# long as the run took (at most PACE_MAX_REST_S) before the next starts. A cycle reads and ranks the
# whole queue, most of a second at 10,000 queued jobs; while jobs end every moment, requests came
# faster than cycles ended and cycles ran back to back, each admitting a job or two, taking a worker
# process and much of PostgreSQL from everything else (bench controlplane). Paced, cycles take at
# most half of the time, and each admits what ended during the rest; a cycle over a short queue
# (milliseconds) rests milliseconds. (Volcano schedules in sessions a second apart, likewise.)
PACE_MAX_REST_S = 5.0
# A run asked for this long ago and not started is stuck behind other work in the broker's queue
# (overdue): longer than a cycle and its rest under load. At 10 s, paced runs were taken for stuck
# ones whenever a cycle took over 5 s (bench controlplane, 1,000 running and 10,000 queued jobs on
# 2 busy cores: 7.7 s), and the reconcile pass ran a cycle of its own that first waited for theirs
# (its pass took 8.5 s).
OVERDUE_S = 30.0


def _waiting_key(task):
    return f"dispatch:waiting:{task}"


def _rest_key(task):
    return f"dispatch:rest-until:{task}"


def send(task, *args, countdown=None):
    """Send jobs.tasks.<task>(*args) now; for a COALESCED task, only if none is waiting to start."""
    if task in COALESCED and not args and countdown is None and not _mark_waiting(task):
        return
    try:
        current_app.send_task(PREFIX + task, args=args, countdown=countdown)
    except (OperationalError, OSError) as exc:
        log.warning("could not send %s%s to the broker (%s); the reconcile pass sends it again", task, args, exc)


def send_on_commit(task, *args):
    """Send jobs.tasks.<task>(*args) once the current transaction commits (at once outside one).

    Serving a web request, the message leaves from the process's sending thread instead
    (`_send_later`), so the response does not wait for the broker: under load that wait (a round
    trip to mark a coalesced task, another to send) was a third of a submission's time (bench
    controlplane, py-spy). Nothing depends on the moment: a message only wakes a worker."""
    transaction.on_commit(lambda: _committed(task, args))


def _committed(task, args):
    held = getattr(_holding, "messages", {}).get(task)
    if held is not None:
        held.append(args)
    else:
        (_send_later if serving_loop() else send)(task, *args)


_holding = threading.local()  # .messages: {task: [args]} of the held() blocks this thread is in


@contextmanager
def held(task):
    """Within: the messages for `task` that changes committed in this thread would send are held
    in the list this yields (one tuple of arguments each) instead; the caller sends them or does
    their work itself. What a message would wake a worker for is in the database already, so one
    the caller drops (it died first) is sent by the reconcile pass, as a lost message is."""
    outer = getattr(_holding, "messages", {})
    messages = []
    _holding.messages = {**outer, task: messages}
    try:
        yield messages
    finally:
        _holding.messages = outer


_sender = (None, None)  # (pid, queue) of this process's sending thread
_sender_lock = threading.Lock()


def _send_later(task, *args):
    global _sender
    pid, outgoing = _sender
    if pid != os.getpid():
        with _sender_lock:
            pid, outgoing = _sender
            if pid != os.getpid():  # none yet, or the parent's (a forked child has no such thread)
                outgoing = queue.SimpleQueue()
                threading.Thread(target=_send_forever, args=(outgoing,), name="dispatch-sender", daemon=True).start()
                _sender = (os.getpid(), outgoing)
    outgoing.put((task, args))


def _send_forever(outgoing):
    while True:
        task, args = outgoing.get()
        try:
            send(task, *args)  # a broker it cannot reach it logs, as from a request
        except Exception:  # noqa: BLE001 - the thread outlives any one message; the reconcile pass resends
            log.exception("sending %s%s failed", task, args)


def _mark_waiting(task):
    """True if this request must send a message: no run of `task` was waiting to start. The mark
    holds when the first request it stands for was made (overdue)."""
    try:
        return cache.add(_waiting_key(task), time.time(), timeout=COALESCE_TTL_S)
    except Exception as exc:  # noqa: BLE001 - without the cache every request sends, as before
        log.warning("could not mark %s as waiting (%s); sending anyway", task, exc)
        return True


def starting(task):
    """Called by a COALESCED task before it reads anything: requests from now on need a run after
    this one, so they send again. (A request made before this call committed its change first, so
    this run sees it.)"""
    try:
        cache.delete(_waiting_key(task))
    except Exception as exc:  # noqa: BLE001 - the mark then expires by itself
        log.warning("could not clear the waiting mark of %s (%s)", task, exc)


def overdue(task):
    """True if a run of a COALESCED task was asked for over OVERDUE_S ago and has not started (its
    message waits behind other work, or was lost); False if none waits, or the cache cannot tell."""
    since = _waiting_since(task)
    return since is not None and time.time() - since > OVERDUE_S


def waiting(task):
    """True if a run of a COALESCED task was asked for and has not started yet (overdue or not)."""
    return _waiting_since(task) is not None


def _waiting_since(task):
    try:
        return cache.get(_waiting_key(task))
    except Exception as exc:  # noqa: BLE001
        log.warning("could not read the waiting mark of %s (%s)", task, exc)
        return None


def rest_left(task):
    """Seconds before a paced task may run again (0: now, or the cache cannot tell)."""
    try:
        until = cache.get(_rest_key(task))
    except Exception as exc:  # noqa: BLE001 - unpaced without the cache, as before
        log.warning("could not read the rest of %s (%s); running it now", task, exc)
        return 0.0
    return max(0.0, until - time.time()) if until else 0.0


def ran(task, seconds):
    """A run of a paced task took `seconds`: the next one waits as long (at most PACE_MAX_REST_S)."""
    rest = min(seconds, PACE_MAX_REST_S)
    try:
        cache.set(_rest_key(task), time.time() + rest, timeout=math.ceil(rest) + 1)
    except Exception as exc:  # noqa: BLE001 - the next run then starts at once
        log.warning("could not record the rest of %s (%s)", task, exc)


def defer(task, seconds):
    """Run a paced task after its rest: sent again with a countdown, and marked waiting (as a
    request marks it), so requests meanwhile are served by that run instead of sending their own."""
    _mark_waiting(task)
    send(task, countdown=seconds)


def backlog():
    """How many messages wait in the workers' queue for a worker to take them (None: the broker
    cannot tell). The outbox sweep asks before it sends rows again (jobs.outbox.sweep)."""
    try:
        with current_app.connection_for_read() as connection:
            queue = current_app.conf.task_default_queue
            return connection.default_channel.queue_declare(queue=queue, passive=True).message_count
    except ChannelError:  # no such queue yet: nothing was ever sent, or the broker lost it all
        return 0
    except Exception as exc:  # noqa: BLE001 - unknown: the sweep then sends as if none waited
        log.warning("could not read the length of the workers' queue (%s)", exc)
        return None
