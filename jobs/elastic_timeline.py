"""What people see of an elastic job: its bounds and the shape it runs at now (the job detail's `elastic`,
the cluster page) and its allocation timeline (`GET /api/v1/jobs/ID/allocations/`, `trainyard show`, the
job page's chart).

Read-only views over `Job.runtime["elastic"]` (written at submission) and the `Allocation` rows the
platform opens and closes at each attempt; nothing in that part decides or changes a shape.

The timeline itself (jobs.models.Allocation), one row per attempt, saying what shape the
attempt ran at, why, what the resize that led to it cost, and how many samples it trained on.

Kept by a status-change listener (connected in JobsConfig.ready), inside the transaction of each
change, so the timeline never disagrees with the job's history:
- an attempt that becomes PENDING (admitted, or re-deployed at a new size after a resize) gets its
  row; a resize wrote that row already when it was requested (jobs.lifecycle.resize), with its reason and
  the time of the signal;
- when every learner of the attempt runs (PROCESSING) the row starts, and a resize's cost is the
  time from its signal to then;
- when the attempt lets go of its resources (its job moves on to another attempt or out of the
  active states) the row ends, with the samples learner 0 reported (`report(samples=N)`).
"""
from django.db.models import Max, Min

from jobs import runtime
from jobs.models import ACTIVE, Allocation, MetricPoint, Status
from trainyard import elasticity

# The metric an elastic job's rank 0 reports its cumulative samples under (learner_agent.report(samples=)).
SAMPLES_METRIC = "samples"


def bounds(job):
    """The job's elastic block as stored at submission (trainyard.elasticity.Elastic), or None for a fixed-size job."""
    return elasticity.of(job)


def timeline(job):
    """The job's Allocation rows, oldest attempt first."""
    return Allocation.objects.filter(job=job).order_by("attempt")


def current(job):
    """The allocation of the job's newest attempt that has one (what it holds now, or held last)."""
    return Allocation.objects.filter(job=job, attempt__lte=job.attempt).order_by("-attempt").first()


def summary(job):
    """The job detail's `elastic`: None for a fixed-size job; else its bounds and the shape it runs at now
    (learners is `Job.learners`, what it holds; the batch fields come from its current allocation and
    are null until it has one)."""
    elastic = bounds(job)
    if elastic is None:
        return None
    now = current(job)
    return {**elastic.to_runtime(), "learners": job.learners,
            "global_batch": now.global_batch if now else None, "local_batch": now.local_batch if now else None,
            "lr_scale": now.lr_scale if now else None, "allocation_attempt": now.attempt if now else None}


def size(job):
    """The cluster page's figure for an elastic job: {learners, min_learners, max_learners}; None if fixed."""
    elastic = bounds(job)
    if elastic is None:
        return None
    return {"learners": job.learners, "min_learners": elastic.min_learners, "max_learners": elastic.max_learners}


# --- keeping the timeline ---------------------------------------------------------------------------
def on_transition(job, *, before, when):
    """The status-change listener (jobs.states.listen)."""
    if not job.is_first_attempt:  # the first has no earlier one whose row could still be open
        for row in Allocation.objects.filter(job=job, ended_at=None, attempt__lt=job.attempt):
            close(row, when)
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
    row = Allocation.objects.filter(job=job, attempt=job.attempt).first()
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
    row = Allocation.objects.filter(job=job, attempt=job.attempt, started_at=None).first()
    if row is None:
        return
    row.started_at = when
    if row.resize_requested_at is not None:
        row.resize_cost_s = max(0.0, (when - row.resize_requested_at).total_seconds())
    row.save(update_fields=["started_at", "resize_cost_s"])


def close(row, when):
    """The attempt let go of its resources: the row ends with the samples its learner 0 reported."""
    first, last = _samples_of(row.job_id, row.attempt)
    if row.samples_start is None:
        row.samples_start = first
    row.samples_end = last if last is not None else row.samples_start
    row.ended_at = when
    row.save(update_fields=["samples_start", "samples_end", "ended_at"])


def last_samples(job):
    """The job's progress so far in samples (learner 0's last report over all attempts), or None."""
    point = (MetricPoint.objects.filter(job=job, name=SAMPLES_METRIC, learner=0)
             .order_by("-attempt", "-id").values_list("value", flat=True).first())
    return None if point is None else int(point)


def _samples_of(job_id, attempt):
    points = MetricPoint.objects.filter(job_id=job_id, attempt=attempt, name=SAMPLES_METRIC, learner=0)
    values = points.aggregate(first=Min("value"), last=Max("value"))
    return tuple(None if v is None else int(v) for v in (values["first"], values["last"]))


def of_attempt(job):
    """The row of the job's current attempt, or None."""
    return Allocation.objects.filter(job=job, attempt=job.attempt).first()
