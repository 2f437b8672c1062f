"""The outbox: follow-up work that a change of a job requires, kept as rows (jobs.models.FollowUp).

jobs.states.transition() writes the rows a status change requires (deploy, halt, teardown) in the
transaction that makes the change; jobs.lifecycle adds `finish` when the last learner of an attempt
ends. So the work exists exactly when the change does. On commit a Celery message names the row
(jobs.dispatch) to wake a worker, which claims the row by compare-and-swap, does the work and marks
it done. Whatever happens to the message (a broker flushed, a worker killed mid-task), the row
stays open, and the reconcile pass (`sweep`) sends it again, for final jobs too, until it is done.

At most one open row per (job, attempt, kind) (a partial unique index): adding one that is already
open is a no-op, and a claimed row is the one worker doing that work for that job.
"""
import logging
import os
import socket
import threading
import uuid
from contextlib import contextmanager
from datetime import timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, DateTimeField, ExpressionWrapper, F, Q, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from jobs import dispatch
from jobs.models import ACTIVE, FollowUp, Job, Status

log = logging.getLogger(__name__)
Kind = FollowUp.Kind
TASK = "follow_up"  # jobs.tasks.follow_up(row id)
# A worker renews its claim every CLAIM_TTL_S / 3 while it works; a claim older than this belongs
# to a worker that died, and the sweep hands the row to another.
CLAIM_TTL_S = 10.0
# A row just written is woken by its own on-commit message; the sweep leaves it alone this long.
SEND_GRACE_S = 2.0
# ... unless messages wait in the workers' queue: then this long (see _sweep_table).
BACKLOG_TRUST_S = 120.0
# A row sent again is not sent again before this (or its age, if longer) has passed.
RESEND_MIN_S = 20.0
RETRY_MAX_S = 60.0
KEEP_DONE = timedelta(days=7)
# Every tenant may have this many follow-ups running at once; past it, a tenant's row waits its turn
# while another tenant's row waits with fewer of its own running (see _take_turn).
SHARE_PER_TENANT = 2
# A row waiting its turn is tried again after TURN_WAIT_S, plus TURN_WAIT_PER_ROW_S for each open row
# of its tenant's (so a tenant's thousand waiting rows come back a few a second, not all at once),
# up to TURN_WAIT_MAX_S.
TURN_WAIT_S = 1.0
TURN_WAIT_PER_ROW_S = 0.02
TURN_WAIT_MAX_S = 10.0
# Other apps keep outbox rows of their own (same fields: created, due_at, claimed_at, claimed_by,
# done_at, tries, last_error) and register them here, so one claim, backoff and sweep serve all:
# [(model, task name, queue: None for the workers' default one)], follow-ups first.
_tables = [(FollowUp, TASK, None)]


def register(model, task, queue=None):
    """Have the sweep send `task`(row id) again for the open rows of `model` too (notifications.apps);
    `queue` is the one its task is routed to, whose backlog the sweep looks at."""
    if (model, task, queue) not in _tables:
        _tables.append((model, task, queue))


# --- writing rows --------------------------------------------------------------------------------
def add(job_id, attempt, kind):
    """Record that `kind` must be done for this attempt, in the caller's transaction; a worker is
    woken once it commits. Returns the new row, or None when one is already open."""
    try:
        with transaction.atomic():  # a savepoint: a duplicate must not spoil the caller's transaction
            row = FollowUp.objects.create(job_id=job_id, attempt=attempt, kind=kind)
    except IntegrityError:
        return None
    dispatch.send_on_commit(TASK, row.pk)
    return row


def ensure(steps):
    """add() each (job id, attempt, kind) of `steps` that has no open row, finding the open ones in
    one query: the reconcile pass asks this for every job it judges, and most rows are open already."""
    steps = {(job_id, attempt, Kind(kind).value) for job_id, attempt, kind in steps}  # rows hold plain values
    if not steps:
        return
    open_rows = set(FollowUp.objects.filter(job_id__in={job_id for job_id, _, _ in steps}, done_at=None)
                    .values_list("job_id", "attempt", "kind"))
    for job_id, attempt, kind in sorted(steps - open_rows):
        add(job_id, attempt, kind)


def for_transition(job, *, before, attempt_before):
    """The follow-ups the change of `job` from `before` (at `attempt_before`) to its status requires."""
    target = Status(job.status)
    if target == Status.PENDING:
        add(job.id, job.attempt, Kind.DEPLOY)
    elif target == Status.HALTING:
        add(job.id, job.attempt, Kind.HALT)
    if before in ACTIVE and (target not in ACTIVE or job.attempt != attempt_before):
        # The attempt that held resources is over (final, halted, queued again for a retry, or
        # followed by the next attempt of a resized job): whatever the backend still runs or keeps
        # for it goes.
        add(job.id, attempt_before, Kind.TEARDOWN)


# --- doing the work ------------------------------------------------------------------------------
def worker_name():
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def claim(row_id, worker, model=FollowUp):
    """Take the row if it is open and nobody holds a live claim on it; None if someone else has it.
    The row is due now: should its worker die, the sweep sends it again as soon as the claim is stale,
    however far a resend had pushed its due time back."""
    now = timezone.now()
    free = Q(claimed_at=None) | Q(claimed_at__lt=now - timedelta(seconds=CLAIM_TTL_S))
    taken = (model.objects.filter(free, pk=row_id, done_at=None)
             .update(claimed_at=now, claimed_by=worker, tries=F("tries") + 1, due_at=now))
    # The row alone: its work reads what it needs (a join to the job decoded the whole job row, a
    # millisecond of each claim here, for nothing).
    return model.objects.filter(pk=row_id).first() if taken else None


class NotYet(Exception):
    """Raised by a row's work that cannot go on yet (it waits its turn for something its tenant
    shares): the row is sent again `after_s` later, and the wait counts as no failed try."""

    def __init__(self, reason, after_s=10.0):
        super().__init__(reason)
        self.after_s = after_s


def run(row_id, handlers):
    """Claim the row, do its work with `handlers[kind](job_id, attempt)`, mark it done.

    Returns the row once done; None when another worker holds it, it is done already, or the work
    failed (the failure is recorded on the row, which is sent again after a backoff)."""
    def work(row):
        _take_turn(row)
        handlers[row.kind](row.job_id, row.attempt)

    return run_row(row_id, work)


def _take_turn(row):
    """Raise NotYet when the row's tenant already has SHARE_PER_TENANT follow-ups or more running
    while a row of another tenant, with fewer of its own running, waits for a worker.

    The workers share one queue, first in first out: a tenant halting its hundreds of jobs at once
    put all their teardowns ahead of another tenant's deploy. Now the rows of the tenant holding the
    workers step aside (a query each) until the waiting tenant's rows are taken. With no one else
    waiting, a tenant gets every worker there is."""
    tenant = Job.objects.filter(pk=row.job_id).values_list("tenant_id", flat=True).first()
    now = timezone.now()
    running = dict(FollowUp.objects.filter(done_at=None, claimed_at__gte=now - timedelta(seconds=CLAIM_TTL_S))
                   .exclude(pk=row.pk).values_list("job__tenant_id").annotate(n=Count("pk")).order_by())
    mine = running.get(tenant, 0)
    if mine < SHARE_PER_TENANT:
        return
    waiting = (FollowUp.objects.filter(done_at=None, claimed_at=None, due_at__lte=now).exclude(job__tenant_id=tenant)
               .values_list("job__tenant_id", flat=True).distinct())
    if any(running.get(other, 0) < mine for other in waiting):
        queued = FollowUp.objects.filter(done_at=None, claimed_at=None, job__tenant_id=tenant).count()
        raise NotYet(f"its tenant has {mine} follow-ups running while another tenant's wait",
                     after_s=min(TURN_WAIT_MAX_S, TURN_WAIT_S + TURN_WAIT_PER_ROW_S * queued))


def run_row(row_id, work, *, model=FollowUp, task=TASK):
    """Claim the row of `model`, call `work(row)`, mark it done; a failure is kept on the row, which
    `task` is sent for again after a backoff. Returns the row once done, else None."""
    worker = worker_name()
    row = claim(row_id, worker, model)
    if row is None:
        return None
    try:
        with _renewed(row.pk, worker, model):
            work(row)
    except NotYet as wait:
        _later(row, worker, wait, model, task)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure is kept on the row and retried, never lost
        _failed(row, worker, exc, model, task)
        return None
    model.objects.filter(pk=row.pk, claimed_by=worker).update(done_at=timezone.now(), last_error="")
    return row


def _failed(row, worker, exc, model=FollowUp, task=TASK):
    delay = min(RETRY_MAX_S, 2.0 ** row.tries)
    error = f"{type(exc).__name__}: {exc}".replace("\x00", "?")  # PostgreSQL stores no NUL in text
    log.warning("%s failed (try %d): %s; again in %.0fs", row, row.tries, error, delay, exc_info=True)
    model.objects.filter(pk=row.pk, claimed_by=worker).update(
        claimed_at=None, claimed_by="", last_error=error[:2000], due_at=timezone.now() + timedelta(seconds=delay))
    dispatch.send(task, row.pk, countdown=delay)


def _later(row, worker, wait, model, task):
    log.info("%s waits %.0fs: %s", row, wait.after_s, wait)
    model.objects.filter(pk=row.pk, claimed_by=worker).update(
        claimed_at=None, claimed_by="", tries=F("tries") - 1, due_at=timezone.now() + timedelta(seconds=wait.after_s))
    dispatch.send(task, row.pk, countdown=wait.after_s)


@contextmanager
def _renewed(row_id, worker, model=FollowUp):
    """Keep the claim fresh while the body runs (storing results may take minutes)."""
    done = threading.Event()

    def renew():
        try:
            while not done.wait(CLAIM_TTL_S / 3):
                try:
                    model.objects.filter(pk=row_id, claimed_by=worker, done_at=None).update(claimed_at=timezone.now())
                except Exception:  # noqa: BLE001 - a missed renewal risks a second worker, never lost work
                    # The next renewal goes on, on a new connection: this one may be what failed.
                    log.warning("could not renew the claim on follow-up %s", row_id, exc_info=True)
                    connection.close()
        finally:
            connection.close()  # this thread's own connection

    renewer = threading.Thread(target=renew, name=f"renew follow-up {row_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        done.set()
        renewer.join()


# --- the sweep -----------------------------------------------------------------------------------
def sweep(now=None):
    """Send again every open row nobody works on (never sent, message lost, worker died); returns
    their ids. Run by every reconcile pass."""
    now = now or timezone.now()
    rows = []
    for model, task, queue in _tables:
        rows += _sweep_table(model, task, now, backlog=dispatch.backlog(queue))
    return rows


def _sweep_table(model, task, now, *, backlog=None):
    """A row never claimed is sent again once SEND_GRACE_S old, unless messages wait in the workers'
    queue (`backlog`): its own is most likely among them, so it is left until BACKLOG_TRUST_S old.
    Each send pushes the row's due_at back by its age (RESEND_MIN_S at least), so a row whose
    messages keep getting lost is sent at ever longer intervals instead of on every pass. A claim
    gone stale (its worker died: live ones renew theirs) is sent again at once. (Resending every old
    row on every pass made a burst of deploys grow the queue with tasks that found their rows taken.)"""
    stale = now - timedelta(seconds=CLAIM_TTL_S)
    grace = SEND_GRACE_S if not backlog else BACKLOG_TRUST_S
    unsent = Q(claimed_at=None, created__lt=now - timedelta(seconds=grace))
    rows = list(model.objects.filter(unsent | Q(claimed_at__lt=stale), done_at=None, due_at__lte=now)
                .order_by("due_at").values_list("pk", flat=True)[:500])
    for row_id in rows:
        dispatch.send(task, row_id)
    # One statement for them all: due_at = now + max(RESEND_MIN_S, now - created).
    model.objects.filter(pk__in=rows).update(due_at=Greatest(
        Value(now + timedelta(seconds=RESEND_MIN_S)),
        ExpressionWrapper(Value(now) + (Value(now) - F("created")), output_field=DateTimeField())))
    model.objects.filter(done_at__lt=now - KEEP_DONE).delete()
    return rows
