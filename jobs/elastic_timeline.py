"""What people see of an elastic job: its bounds and the shape it runs at now (the job detail's `elastic`,
the cluster page) and its allocation timeline (`GET /api/v1/jobs/ID/allocations/`, `trainyard show`, the
job page's chart).

Read-only views over `Job.runtime["elastic"]` (written at submission) and the `Allocation` rows the
platform opens and closes at each attempt; nothing in that part decides or changes a shape.

The timeline itself (jobs.models.Allocation), one row per shape: each attempt's first, and one more
for each batch change made inside its running learners; each says what shape it ran at, why, what
the change that led to it cost, and how many samples it trained on.

Kept by a status-change listener (connected in JobsConfig.ready), inside the transaction of each
change, so the timeline never disagrees with the job's history:
- an attempt that becomes PENDING (admitted, or re-deployed at a new size after a resize) gets its
  row; a resize wrote that row already when it was requested (jobs.lifecycle.resize), with its reason and
  the time of the signal;
- when every learner of the attempt runs (PROCESSING) the row starts, and a resize's cost is the
  time from its signal to then;
- when the attempt lets go of its resources (its job moves on to another attempt or out of the
  active states) the row ends, with the samples learner 0 reported (`report(samples=N)`); a batch
  change asked of it and not yet applied is dropped.
And by ingest (`batch_applied`): when learner 0 reports a batch change applied, the row before it
ends and the change's row starts, at the step where the learners switched.
"""
from django.db.models import Max, Min

from jobs import runtime
from jobs.models import ACTIVE, Allocation, Job, MetricPoint, Status
from learner_agent.batch_changes import APPLIED_METRIC, LISTENING_METRIC
from trainyard import elasticity

# The metric an elastic job's rank 0 reports its cumulative samples under (learner_agent.report(samples=)).
SAMPLES_METRIC = "samples"
# Reports at or past this count of samples are passed over, as are negative ones: a BigIntegerField
# holds less, and a report the learner wrote must not fail its job's every transition.
SAMPLES_BOUND = 2.0 ** 63
BATCH = Allocation.Kind.BATCH


def timeline(job):
    """The job's Allocation rows, oldest first (a batch change asked and not yet applied among them)."""
    return Allocation.objects.filter(job=job).order_by("attempt", "id")


def _shapes_run(job):
    """The job's rows less the batch changes asked and not yet applied."""
    return Allocation.objects.filter(job=job).exclude(kind=BATCH, started_at=None)


def current(job):
    """The shape of the job's newest attempt that has one (what it holds now, or held last)."""
    return _shapes_run(job).filter(attempt__lte=job.attempt).order_by("-attempt", "-id").first()


def summary(job):
    """The job detail's `elastic`: None for a fixed-size job; else its bounds and the shape it runs at now
    (learners is `Job.learners`, what it holds; the batch fields come from its current allocation and
    are null until it has one)."""
    elastic = elasticity.of(job)
    if elastic is None:
        return None
    now = current(job)
    return {**elastic.to_runtime(), "learners": job.learners,
            "global_batch": now.global_batch if now else None, "local_batch": now.local_batch if now else None,
            "lr_scale": now.lr_scale if now else None, "allocation_attempt": now.attempt if now else None}


def size(job):
    """The cluster page's figure for an elastic job: {learners, min_learners, max_learners}; None if fixed."""
    elastic = elasticity.of(job)
    if elastic is None:
        return None
    return {"learners": job.learners, "min_learners": elastic.min_learners, "max_learners": elastic.max_learners}


# --- keeping the timeline ---------------------------------------------------------------------------
def on_transition(job, *, before, when):
    """The status-change listener (jobs.states.listen)."""
    if not job.is_first_attempt:  # the first has no earlier one whose row could still be open
        for row in Allocation.objects.filter(job=job, ended_at=None, attempt__lt=job.attempt):
            close(row, when)
    if job.status != Status.PROCESSING and job.batch_request is not None:
        drop_batch_request(job)
    if job.status not in ACTIVE:
        # A resize that was requested but never carried out (the job failed, was terminated or
        # requeued meanwhile) leaves a row for an attempt that never ran at that shape.
        later = job.attempt if job.status == Status.QUEUED else job.attempt + 1
        Allocation.objects.filter(job=job, attempt__gte=later, started_at=None).delete()
    if job.status == Status.PENDING and before != Status.PENDING:
        open_attempt(job)
    elif job.status == Status.PROCESSING and before != Status.PROCESSING:
        start(job, when)
    elif job.status not in ACTIVE:
        for row in Allocation.objects.filter(job=job, attempt=job.attempt, ended_at=None):
            close(row, when)


def shape_of(job, wanted_batch=None):
    """The Shape (trainyard.elasticity) of the job's current attempt at its current learners."""
    elastic = runtime.of(job).elastic
    if elastic is None:
        return elasticity.Shape(job.learners, None, None, 1.0)
    return elasticity.shape(elastic, job.learners, wanted_batch)


def open_attempt(job):
    """The row of the job's current attempt (kept if a resize wrote it already)."""
    if job.is_first_attempt:  # no row a resize wrote, no samples reported yet
        return _create_row(job, samples_start=None)
    row = Allocation.objects.filter(job=job, attempt=job.attempt).exclude(kind=BATCH).first()
    if row is not None:
        if row.samples_start is None:  # a resize's row: the job goes on from where the last attempt stopped
            row.samples_start = last_samples(job)
            row.save(update_fields=["samples_start"])
        return row
    return _create_row(job, samples_start=last_samples(job))


def _create_row(job, *, samples_start):
    try:
        shape = shape_of(job)
    except runtime.RuntimeUnavailable:
        shape = elasticity.Shape(job.learners, None, None, 1.0)
    return Allocation.objects.create(
        job=job, attempt=job.attempt, learners=job.learners, gpus_per_learner=job.gpus,
        global_batch=shape.global_batch, local_batch=shape.local_batch, lr_scale=shape.lr_scale,
        placement=list(job.placement), reason=job.status_reason or "admitted",
        samples_start=samples_start)


def start(job, when):
    """Every learner of the attempt runs: the row starts; a resize's cost is measured up to here."""
    row = Allocation.objects.filter(job=job, attempt=job.attempt, started_at=None).exclude(kind=BATCH).first()
    if row is None:
        return
    row.started_at = when
    if row.resize_requested_at is not None:
        row.resize_cost_s = max(0.0, (when - row.resize_requested_at).total_seconds())
    row.save(update_fields=["started_at", "resize_cost_s"])


def close(row, when, *, until=None):
    """The stretch ends (its attempt let go of its resources, or a batch change took over at `until`):
    with the samples its learner 0 reported during it."""
    since = row.started_at if row.kind == BATCH else None  # an attempt's first row: all of it before
    span = samples_reported(row.job_id, row.attempt, since=since, until=until)
    first, last = (None if v is None else int(v) for v in (span["low"], span["high"]))
    if row.samples_start is None:
        row.samples_start = first
    row.samples_end = last if last is not None else row.samples_start
    row.ended_at = when
    row.save(update_fields=["samples_start", "samples_end", "ended_at"])


# --- batch changes inside a running attempt (jobs.lifecycle.change_batch asks for them) --------------
def listens_for_batch_changes(job):
    """Whether the current attempt's learner 0 said it applies batch changes while it runs
    (learner_agent.batch_changes reports LISTENING_METRIC when it starts), and has not let one go
    unapplied (withdraw_batch_request): an attempt that said so and did not is asked no more."""
    return (MetricPoint.objects.filter(job=job, attempt=job.attempt, learner=0, name=LISTENING_METRIC).exists()
            and not Allocation.objects.filter(job=job, attempt=job.attempt, kind=BATCH, started_at=None,
                                              ended_at__isnull=False).exists())


def pending_batch_change(job):
    """The row of a batch change asked of the current attempt and not yet applied, or None."""
    return Allocation.objects.filter(job=job, attempt=job.attempt, kind=BATCH, started_at=None,
                                     ended_at=None).first()


def withdraw_batch_request(job, when):
    """Give up on a batch change the learners have not applied: its row stays in the timeline, ended
    and never started, and the attempt is asked no more (listens_for_batch_changes). A learner that
    says it listens and never applies a change would otherwise hold its job at its size for good.
    Returns the row, or None when there was nothing to withdraw (applied meanwhile)."""
    locked = Job.objects.select_for_update().filter(pk=job.pk, attempt=job.attempt).first()
    row = pending_batch_change(job) if locked is not None and locked.batch_request is not None else None
    if row is None or locked.batch_request.get("id") != row.id:
        return None
    row.ended_at = when
    row.reason += f" (withdrawn: not applied after {(when - row.resize_requested_at).total_seconds():.0f} s)"
    row.save(update_fields=["ended_at", "reason"])
    _clear_request(job)
    return row


def batch_applied(job, request_id, when):
    """Learner 0 reported (APPLIED_METRIC) that the learners run at batch change `request_id` since
    `when`: the stretch before it ends and the change's starts. Called by ingest under the job's row
    lock; `job` has `batch_request` loaded. A report naming any other change (one since superseded
    or dropped, or made up) changes nothing."""
    request = job.batch_request
    if not isinstance(request, dict) or request.get("id") != request_id:
        return None
    row = pending_batch_change(job)
    _clear_request(job)
    if row is None or row.id != request_id:
        return None
    when = max(when, row.resize_requested_at)
    before = current(job)
    if before is not None and before.ended_at is None:
        close(before, when, until=when)
    row.started_at = when
    row.samples_start = before.samples_end if before is not None else None
    row.resize_cost_s = (when - row.resize_requested_at).total_seconds()
    row.save(update_fields=["started_at", "samples_start", "resize_cost_s"])
    return row


def drop_batch_request(job):
    """The attempt stops running: a batch change asked of it and not yet applied never will be."""
    Allocation.objects.filter(job=job, attempt=job.attempt, kind=BATCH, started_at=None, ended_at=None).delete()
    _clear_request(job)


def _clear_request(job):
    Job.objects.filter(pk=job.pk).update(batch_request=None)
    job.batch_request = None


def last_samples(job):
    """The job's progress so far in samples (learner 0's last report over all attempts), or None."""
    point = (_samples_points().filter(job=job)
             .order_by("-attempt", "-id").values_list("value", flat=True).first())
    return None if point is None else int(point)


def samples_reported(job_id, attempt, *, since=None, until=None):
    """Learner 0's `samples` reports of an attempt between `since` and `until`: {"first", "last"} (their
    times) and {"low", "high"} (their values), each None when there are none."""
    points = _samples_points().filter(job_id=job_id, attempt=attempt)
    if since is not None:
        points = points.filter(time__gte=since)
    if until is not None:
        points = points.filter(time__lte=until)
    return points.aggregate(first=Min("time"), last=Max("time"), low=Min("value"), high=Max("value"))


def _samples_points():
    """Learner 0's `samples` reports that can be a count of samples; any other is passed over."""
    return MetricPoint.objects.filter(name=SAMPLES_METRIC, learner=0, value__gte=0, value__lt=SAMPLES_BOUND)


def of_attempt(job):
    """The shape the job's current attempt runs at (its latest row, less a batch change not yet
    applied), or None."""
    return _shapes_run(job).filter(attempt=job.attempt).order_by("-id").first()
