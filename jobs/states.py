"""The job state machine (SPEC §3): the only code that writes Job.status.

Each change is a compare-and-swap on the row (`UPDATE ... WHERE status IN (allowed sources)`), so
two workers racing to move the same job cannot both win. In the same transaction it writes the
event row (history and status never disagree), the follow-up work the change requires (jobs.outbox:
deploy, halt, teardown) and calls the status-change listeners registered with `listen()` (usage
accounting: tenants.quotas; websocket fan-out after commit: jobs.live; both connected in
JobsConfig.ready, so this module imports neither).
"""
import functools
import logging

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs import outbox
from jobs.models import ACTIVE, AT_REST, FINAL, Job, JobEvent, Status

log = logging.getLogger(__name__)
__all__ = ("ACTIVE", "FINAL", "TRANSITIONS", "InvalidTransition", "listen", "transition", "require_transition")
_listeners = []
# A compare-and-swap that lost only because the job moved on to another status the change is allowed
# from reads again; the job's own moves are few, so a handful of tries settles it.
CAS_TRIES = 5

TRANSITIONS = {
    Status.QUEUED: {Status.PENDING, Status.FAILED, Status.TERMINATED},
    Status.PENDING: {Status.DOWNLOADING, Status.PROCESSING, Status.STORING, Status.QUEUED, Status.HALTING,
                     Status.FAILED, Status.TERMINATED},
    Status.DOWNLOADING: {Status.PROCESSING, Status.STORING, Status.QUEUED, Status.HALTING, Status.FAILED,
                         Status.TERMINATED},
    Status.PROCESSING: {Status.STORING, Status.QUEUED, Status.HALTING, Status.FAILED, Status.TERMINATED},
    # STORING -> PENDING: an elastic job resized goes on as its next attempt at the new size
    # (checkpoint stored, learners re-deployed) without going back through the queue.
    Status.STORING: {Status.COMPLETED, Status.HALTED, Status.PENDING, Status.FAILED, Status.TERMINATED},
    Status.HALTING: {Status.STORING, Status.HALTED, Status.FAILED, Status.TERMINATED},
    Status.HALTED: {Status.QUEUED, Status.TERMINATED},
    Status.COMPLETED: set(),
    Status.FAILED: set(),
    Status.TERMINATED: set(),
}


class InvalidTransition(Exception):
    """The job is not in a state from which the requested change is allowed."""


def listen(listener):
    """Call `listener(job, before=status, when=time)` inside the transaction of every status change."""
    if listener not in _listeners:
        _listeners.append(listener)


def sources_of(target):
    return {source for source, targets in TRANSITIONS.items() if target in targets}


def transition(job_id, target, *, actor, reason="", attempt=None, attempt_next=False, only_from=None, **fields):
    """Move a job to `target` if its current status allows it (and its attempt matches).

    Returns the updated Job, or None when the job's status (or attempt) does not allow the change,
    another worker having got there first included. `attempt_next` starts a new attempt (resume, retry, resize); `only_from`
    narrows the allowed sources (resume is QUEUED-from-HALTED only); `fields` are extra Job
    columns to set in the same update.
    """
    target = Status(target)
    now = timezone.now()
    updates = dict(fields, status=target, status_reason=reason, updated_at=now)
    if attempt_next:
        updates["attempt"] = F("attempt") + 1
        for name, fresh in (("placement", []), ("exit_code", None), ("finished_at", None)):
            updates.setdefault(name, fresh)  # a resize's next attempt keeps the placement it was given
    if target == Status.PENDING:
        updates.setdefault("admitted_at", now)
    if target in FINAL:
        updates.setdefault("finished_at", now)
    sources = sources_of(target) & set(only_from) if only_from else sources_of(target)
    for _ in range(CAS_TRIES):
        with transaction.atomic():
            # A deleted job (jobs.deletion) is not found: it never moves again, whatever still names it.
            current = Job.objects.filter(pk=job_id, deleted_at=None).values("status", "attempt").first()
            if (current is None or current["status"] not in sources
                    or (attempt is not None and current["attempt"] != attempt)):
                return None
            if not Job.objects.filter(pk=job_id, status=current["status"], attempt=current["attempt"],
                                      deleted_at=None).update(**updates):
                continue  # it moved between the read and the write (DOWNLOADING -> PROCESSING): read again
            job = _record(job_id, target, current, now=now, actor=actor, reason=reason)
            break
    else:
        return None
    log.info("%s: %s -> %s (%s) %s", job_id, current["status"], target, actor, reason)
    return job


def _record(job_id, target, current, *, now, actor, reason):
    """What goes with a status change, in its transaction: the event, the follow-up work, the listeners."""
    job = Job.objects.get(pk=job_id)
    JobEvent.objects.create(job=job, time=now, from_status=current["status"], to_status=target,
                            attempt=job.attempt, actor=actor, reason=reason)
    if target == Status.PROCESSING and job.started_at is None:
        Job.objects.filter(pk=job_id, started_at__isnull=True).update(started_at=now)
        job.started_at = now
    # What each step sends leaves in this order once the change commits. A job coming to rest is
    # heard of first (sockets, webhooks): a waiting script returns sooner, and the worker woken for
    # the teardown does not take the CPU from that publication. Any other change wakes its worker
    # first: an admission's deploy starts the learner sooner.
    follow_ups = functools.partial(outbox.for_transition, job, before=current["status"],
                                   attempt_before=current["attempt"])
    if target not in AT_REST:
        follow_ups()
    for listener in _listeners:
        listener(job, before=current["status"], when=now)
    if target in AT_REST:
        follow_ups()
    return job


def require_transition(job_id, target, **kwargs):
    """transition() for user requests: raise InvalidTransition with a reason instead of None."""
    job = transition(job_id, target, **kwargs)
    if job is None:
        status = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
        raise InvalidTransition(f"job {job_id} is {status}; it cannot become {Status(target).value}")
    return job
