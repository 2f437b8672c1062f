"""Waking workers: send a lifecycle task by name, so no module imports jobs.tasks to enqueue work
(jobs.tasks imports the lifecycle, not the other way round).

A message only wakes a worker; what it should do is already in the database (an outbox row,
jobs.outbox, or the queue the scheduler reads), and the reconcile pass sends again whatever is
still undone. So a broker that cannot be reached delays work and says so in the log; it does not
fail the request or the task that changed the state.
"""
import logging

from celery import current_app
from django.db import transaction
from kombu.exceptions import OperationalError

log = logging.getLogger(__name__)
PREFIX = "jobs.tasks."


def send(task, *args, countdown=None):
    """Send jobs.tasks.<task>(*args) now."""
    try:
        current_app.send_task(PREFIX + task, args=args, countdown=countdown)
    except (OperationalError, OSError) as exc:
        log.warning("could not send %s%s to the broker (%s); the reconcile pass sends it again", task, args, exc)


def send_on_commit(task, *args):
    """Send jobs.tasks.<task>(*args) once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: send(task, *args))
