"""How long learners' resource samples are kept, and what is kept of them after.

Every learner's agent sends a sample every RESOURCE_SAMPLE_S seconds (17,280 a day at 5 s), so the
samples of a busy platform would outgrow every other table. `prune_pass` (celery beat) removes those
older than RESOURCE_SAMPLE_DAYS, one day of one job at a time, and keeps what the usage report needs
of them as that learner's day (jobs.models.ResourceDay: how many, the sums, the first and last time).
The report adds those days to the samples it reads (jobs.usage), so used hours of an old period stay
what they were. What goes for good is the detail: the job page's resource charts and the cluster's
history show the days still kept.

A day is summed and its samples deleted in one transaction, so a pass killed midway leaves whole days
either pruned or not. Samples that arrive for a day already pruned (an agent's spool delivered late)
are added to that day by the next pass.
"""
import logging
import time
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Max, Min, Sum
from django.utils import timezone

from jobs.models import Job, ResourceDay, ResourceSample

log = logging.getLogger(__name__)
PASS_BUDGET_S = 5.0  # a pass starts no further day past this


def prune_pass(now=None, budget_s=PASS_BUDGET_S):
    """Sum up and delete samples older than the retention, a job's day at a time, within the budget;
    how many days of a job it pruned. Nothing when RESOURCE_SAMPLE_DAYS is 0 (kept for ever)."""
    if not settings.RESOURCE_SAMPLE_DAYS:
        return 0
    cutoff = _cutoff(now or timezone.now())
    if cutoff is None:
        return 0
    deadline, pruned = time.monotonic() + budget_s, 0
    while time.monotonic() < deadline:
        oldest = ResourceSample.objects.filter(time__lt=cutoff).order_by("time").values("job_id", "time").first()
        if oldest is None:
            break
        pruned += _prune_day(oldest["job_id"], oldest["time"].astimezone(dt_timezone.utc).date())
    return pruned


def _cutoff(now):
    """The start of the first day kept. Whole UTC days only: a day is summed once all of it is past the
    retention. None when the retention reaches back before the first date (no sample is that old)."""
    try:
        oldest_kept = now - timedelta(days=settings.RESOURCE_SAMPLE_DAYS)
    except OverflowError:
        return None
    return datetime.combine(oldest_kept.astimezone(dt_timezone.utc).date(), datetime.min.time(),
                            tzinfo=dt_timezone.utc)


def _prune_day(job_id, day):
    start = datetime.combine(day, datetime.min.time(), tzinfo=dt_timezone.utc)
    samples = ResourceSample.objects.filter(job_id=job_id, time__gte=start, time__lt=start + timedelta(days=1))
    with transaction.atomic():
        # One pass at a time sums a job's days: two passes summing the same samples would count them twice.
        Job.objects.select_for_update().filter(pk=job_id).first()
        top = samples.aggregate(top=Max("id"))["top"]
        if top is None:  # another pass pruned it while this one waited
            return 0
        samples = samples.filter(id__lte=top)  # the ones summed, not one that arrives meanwhile
        sums = (samples.values("attempt", "learner")
                .annotate(n=Count("id"), cpu=Sum("cpu_cores"), gpu=Sum("gpus_busy"), gpu_n=Count("gpus_busy"),
                          first=Min("time"), last=Max("time")))
        for row in sums:
            _add_to_day(job_id, day, row)
        samples.delete()
    log.info("resource samples: pruned job %s's day %s", job_id, day)
    return 1


def _add_to_day(job_id, day, row):
    """Create the learner's day, or add to it (its samples of that day pruned before)."""
    kept, made = ResourceDay.objects.select_for_update().get_or_create(
        job_id=job_id, attempt=row["attempt"], learner=row["learner"], day=day,
        defaults={"samples": row["n"], "cpu_cores": row["cpu"], "gpus_busy": row["gpu"] or 0.0,
                  "gpu_samples": row["gpu_n"], "first": row["first"], "last": row["last"]})
    if not made:
        ResourceDay.objects.filter(pk=kept.pk).update(
            samples=F("samples") + row["n"], cpu_cores=F("cpu_cores") + row["cpu"],
            gpus_busy=F("gpus_busy") + (row["gpu"] or 0.0), gpu_samples=F("gpu_samples") + row["gpu_n"],
            first=min(kept.first, row["first"]), last=max(kept.last, row["last"]))


def days_within(tenant, start, end):
    """The tenant's pruned learner-days that begin inside [start, end), grouped as jobs.usage groups
    samples (job_id, attempt, learner, n, cpu, gpu, gpu_n, first, last). A query, not yet read: the
    report reads it in one statement with the samples still kept. A day counts whole."""
    return (ResourceDay.objects.filter(job__tenant=tenant, day__gte=_date(start), day__lt=_date(end))
            .values("job_id", "attempt", "learner")
            .annotate(n=Sum("samples"), cpu=Sum("cpu_cores"), gpu=Sum("gpus_busy"), gpu_n=Sum("gpu_samples"),
                      first=Min("first"), last=Max("last")))


def _date(moment):
    """The first UTC day that begins at or after `moment`."""
    utc = moment.astimezone(dt_timezone.utc)
    return utc.date() + timedelta(days=1) if utc.time() != datetime.min.time() else utc.date()

