"""What people see of an elastic job: its bounds and the shape it runs at now (the job detail's `elastic`,
the cluster page) and its allocation timeline (`GET /api/v1/jobs/ID/allocations/`, `trainyard show`, the
job page's chart).

Read-only views over `Job.runtime["elastic"]` (written at submission) and the `Allocation` rows the
platform opens and closes at each attempt; nothing here decides or changes a shape.
"""
from jobs.models import Allocation

# The metric an elastic job's rank 0 reports its cumulative samples under (learner_agent.report(samples=)).
SAMPLES_METRIC = "samples"


def bounds(job):
    """The manifest's elastic block as stored at submission, or None for a fixed-size job."""
    return (job.runtime or {}).get("elastic") or None


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
    stored = bounds(job)
    if stored is None:
        return None
    now = current(job)
    return {"min_learners": stored.get("min_learners"), "max_learners": stored.get("max_learners"),
            "batch": stored.get("batch"), "lr_scaling": stored.get("lr_scaling", "linear"),
            "learners": job.learners,
            "global_batch": now.global_batch if now else None, "local_batch": now.local_batch if now else None,
            "lr_scale": now.lr_scale if now else None, "allocation_attempt": now.attempt if now else None}


def size(job):
    """The cluster page's figure for an elastic job: {learners, min_learners, max_learners}; None if fixed."""
    stored = bounds(job)
    if stored is None:
        return None
    return {"learners": job.learners, "min_learners": stored.get("min_learners"),
            "max_learners": stored.get("max_learners")}
