"""Quotas and usage: what each tenant holds now, what it consumed this period, and what the
scheduler may still give it.

Usage comes from the job state machine: an attempt starts holding its resources when it is
admitted (QUEUED → PENDING) and stops when it releases them (a final state, HALTED, or back to
QUEUED for a retry). jobs.states.transition() calls `on_transition()` (a status-change listener
connected in JobsConfig.ready) inside the same transaction as the status change, so accounting is
exact to the second and never disagrees with job history. Nothing here imports jobs: what this
module needs of a job is the row it is handed, and the queued jobs' demand comes in as an argument.
"""
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from tenants.models import Quota, UsageRecord
from trainyard.units import format_bytes

HOURS = 3600.0
QUEUED = "QUEUED"  # jobs.models.Status.QUEUED
HISTORY_PERIODS = 6
DECAY_HORIZON = 10  # recent_service reads attempts that ended within this many half-lives


# --- accounting ----------------------------------------------------------------------------------
def on_transition(job, *, holding_before, holding_after, when):
    """Open a usage record when an attempt starts holding resources, close it when it lets go."""
    if holding_after and holding_before and not job.is_first_attempt:
        # An elastic job resized goes on holding, as its next attempt at another size: the record
        # of the last attempt ends here and the new attempt's starts (usage counts what it holds).
        # A first attempt has no last one: most changes between active statuses skip the query.
        holding_before = not UsageRecord.objects.filter(job=job, ended_at__isnull=True).exclude(
            attempt=job.attempt).update(ended_at=when)
    if holding_after and not holding_before:
        UsageRecord.objects.get_or_create(job=job, attempt=job.attempt, defaults={
            "tenant_id": job.tenant_id, "user_id": job.owner_id, "gpus": job.gpus * job.learners,
            "cpus": job.cpus * job.learners, "memory_bytes": job.memory_bytes * job.learners, "started_at": when})
    elif holding_before and not holding_after:
        UsageRecord.objects.filter(job=job, ended_at__isnull=True).update(ended_at=when)


def job_usage(job, now=None):
    """What a job has consumed over all its attempts: GPU-hours, CPU-hours, seconds holding resources."""
    return records_usage(UsageRecord.objects.filter(job=job).only("gpus", "cpus", "started_at", "ended_at"), now)


def records_usage(records, now=None):
    """job_usage() of these usage records (none: a job that never held anything)."""
    now = now or timezone.now()
    gpu_s = cpu_s = held_s = 0.0
    for record in records:
        seconds = max(0.0, ((record.ended_at or now) - record.started_at).total_seconds())
        held_s += seconds
        gpu_s += record.gpus * seconds
        cpu_s += record.cpus * seconds
    return {"gpu_hours": round(gpu_s / HOURS, 4), "cpu_hours": round(cpu_s / HOURS, 4), "seconds": round(held_s, 1)}


def earlier_gpu_seconds(job_ids):
    """{job id: GPU-seconds its ended attempts held} (the scheduler's attained service; an attempt
    still running is counted by the scheduler itself from its start). `job_ids`: a list, or a query
    of ids."""
    attained = {}
    for record in UsageRecord.objects.filter(job_id__in=job_ids, ended_at__isnull=False).only(
            "job_id", "gpus", "started_at", "ended_at"):
        seconds = max(0.0, (record.ended_at - record.started_at).total_seconds())
        attained[record.job_id] = attained.get(record.job_id, 0.0) + record.gpus * seconds
    return attained


def recent_service(tenant_ids, now, half_life_s):
    """{tenant id: (GPU-seconds, CPU-seconds)} its attempts held, each second weighted by
    2^(-age / half_life_s): the tenants' attained service, which the scheduler uses to break ties
    between tenants (gpu_scheduler: TenantPolicy.recent_gpu_s). An attempt still running counts up
    to `now`; attempts that ended more than DECAY_HORIZON half-lives ago (weight under 0.1%) are not read."""
    rate = math.log(2) / half_life_s
    since = now - timedelta(seconds=DECAY_HORIZON * half_life_s)
    service = {}
    rows = UsageRecord.objects.filter(tenant_id__in=tenant_ids).filter(
        Q(ended_at__isnull=True) | Q(ended_at__gt=since)).values_list("tenant_id", "gpus", "cpus", "started_at",
                                                                      "ended_at")
    for tenant_id, gpus, cpus, started_at, ended_at in rows:
        # The integral of e^(-rate * age) over the seconds it held, ages from now.
        newest = max(0.0, (now - (ended_at or now)).total_seconds())
        oldest = max(newest, (now - started_at).total_seconds())
        seconds = (math.exp(-rate * newest) - math.exp(-rate * oldest)) / rate
        gpu_s, cpu_s = service.get(tenant_id, (0.0, 0.0))
        service[tenant_id] = (gpu_s + gpus * seconds, cpu_s + cpus * seconds)
    return service


# --- periods -------------------------------------------------------------------------------------
def period_bounds(period, now):
    """[start, end) of the budget period containing `now`, in the platform's time zone."""
    local = timezone.localtime(now)
    day = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == Quota.Period.DAY:
        return day, day + timedelta(days=1)
    if period == Quota.Period.WEEK:
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    start = day.replace(day=1)
    return start, _next_month(start)


def _next_month(start):
    return start.replace(year=start.year + (start.month == 12), month=start.month % 12 + 1)


def _previous_start(period, start):
    if period == Quota.Period.DAY:
        return start - timedelta(days=1)
    if period == Quota.Period.WEEK:
        return start - timedelta(days=7)
    return (start - timedelta(days=1)).replace(day=1)


# --- what a tenant uses --------------------------------------------------------------------------
@dataclass
class Usage:
    gpus: int = 0
    cpus: float = 0.0
    memory_bytes: int = 0
    jobs: int = 0
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0
    gpus_by_user: dict = field(default_factory=dict)  # user id -> GPUs held now
    period_start: datetime | None = None
    period_end: datetime | None = None


def consumed(tenant_id, start, end, now):
    """(GPU-hours, CPU-hours) the tenant's attempts held inside [start, end)."""
    records = UsageRecord.objects.filter(tenant_id=tenant_id, started_at__lt=end).filter(
        Q(ended_at__isnull=True) | Q(ended_at__gt=start)).only("gpus", "cpus", "started_at", "ended_at")
    gpu_s = cpu_s = 0.0
    for record in records:
        seconds = record.seconds_within(start, end, now)
        gpu_s += record.gpus * seconds
        cpu_s += record.cpus * seconds
    return gpu_s / HOURS, cpu_s / HOURS


def usage_of(tenant, now=None, quota=None):
    now = now or timezone.now()
    quota = quota if quota is not None else quota_of(tenant)
    start, end = period_bounds(quota.period if quota else Quota.Period.MONTH, now)
    usage = Usage(period_start=start, period_end=end)
    for record in UsageRecord.objects.filter(tenant=tenant, ended_at__isnull=True):
        usage.gpus += record.gpus
        usage.cpus += record.cpus
        usage.memory_bytes += record.memory_bytes
        usage.jobs += 1
        usage.gpus_by_user[record.user_id] = usage.gpus_by_user.get(record.user_id, 0) + record.gpus
    usage.gpu_hours, usage.cpu_hours = consumed(tenant.pk, start, end, now)
    return usage


def history(tenant, quota=None, now=None, periods=HISTORY_PERIODS):
    """GPU- and CPU-hours per period, newest first, this period included."""
    now = now or timezone.now()
    period = quota.period if quota else Quota.Period.MONTH
    start, end = period_bounds(period, now)
    rows = []
    for _ in range(periods):
        gpu_h, cpu_h = consumed(tenant.pk, start, end, now)
        rows.append({"period_start": start.isoformat(), "gpu_hours": round(gpu_h, 4), "cpu_hours": round(cpu_h, 4)})
        start, end = _previous_start(period, start), start
    return rows


def stored_bytes(tenant):
    """What the tenant keeps in storage, counted by the database: every recorded result, checkpoint
    and log file (each job's Artifact rows, written when it stores its output) and every code archive,
    kept until its job is deleted and purged (a trial's links to its experiment's, counted once, there):
    a deleted job's files take the disk until the purge pass has removed them (jobs.deletion)."""
    kept = tenant.jobs.filter(purged_at=None)
    outputs = kept.aggregate(total=Sum("artifacts__size"))["total"] or 0
    code = kept.filter(trial__isnull=True).aggregate(total=Sum("code_bytes"))["total"] or 0
    shared_code = tenant.experiments.filter(deleted_at=None).aggregate(total=Sum("code_bytes"))["total"] or 0
    return outputs + code + shared_code


def storage_state(quota, used):
    """("ok" | "full", reason): whether the tenant's stored bytes leave room under its storage quota."""
    if quota is None or quota.storage_bytes is None or used < quota.storage_bytes:
        return "ok", ""
    return "full", (f"tenant storage quota reached: {format_bytes(used)} of {format_bytes(quota.storage_bytes)} "
                    "stored (results, checkpoints, logs and code archives); delete ended jobs to free some, "
                    "or ask a platform admin to raise it")


def quota_of(tenant):
    return Quota.objects.filter(tenant=tenant).first()


# --- intake: what a tenant may queue and submit (jobs.submission refuses past it) ---------------
@dataclass(frozen=True)
class Intake:
    queued_jobs: int  # jobs in QUEUED at once
    submissions_per_minute: int
    overridden: tuple = ()  # the names its quota sets; the others are the platform's defaults

    def source(self, name):
        """Where a limit comes from, for messages: the tenant's quota or the platform's setting."""
        return f"its quota's {name}" if name in self.overridden else f"the platform's {INTAKE_SETTINGS[name]}"


INTAKE_SETTINGS = {"queued_jobs": "TRAINYARD_MAX_QUEUED_JOBS", "submissions_per_minute": "TRAINYARD_SUBMITS_PER_MINUTE"}


def intake_of(quota):
    """The tenant's intake limits: its quota's where set, else the platform's defaults (settings)."""
    defaults = {"queued_jobs": settings.MAX_QUEUED_JOBS, "submissions_per_minute": settings.SUBMITS_PER_MINUTE}
    overridden = tuple(name for name in Quota.INTAKE if quota is not None and getattr(quota, name) is not None)
    return Intake(**{name: getattr(quota, name) if name in overridden else defaults[name] for name in Quota.INTAKE},
                  overridden=overridden)


def budget_state(quota, usage):
    """("ok" | "hard_exceeded" | "soft_exceeded", reason) for the period's GPU-/CPU-hour budgets."""
    if quota is None:
        return "ok", ""
    period = {"day": "today", "week": "this week", "month": "this month"}[quota.period]
    for name, limit, used in (("GPU-hours", quota.gpu_hours, usage.gpu_hours),
                              ("CPU-hours", quota.cpu_hours, usage.cpu_hours)):
        if limit is not None and used >= limit:
            state = "soft_exceeded" if quota.budget_mode == Quota.BudgetMode.SOFT else "hard_exceeded"
            kind = "soft " if state == "soft_exceeded" else ""
            return state, f"tenant {kind}{name} budget {used:.2f}/{limit:g} h used {period}"
    return "ok", ""


# --- quota changes take effect at once (jobs.apps reschedules on every save of a Quota) ---------
def set_quota(tenant, **limits):
    """Create or change a tenant's quota (fields as in Quota); unknown names are refused."""
    if unknown := set(limits) - set(Quota.SETTINGS):
        raise ValueError(f"unknown quota field(s): {', '.join(sorted(unknown))}")
    with transaction.atomic():
        quota = Quota.objects.select_for_update().filter(tenant=tenant).first() or Quota(tenant=tenant)
        for name, value in limits.items():
            setattr(quota, name, value)
        quota.full_clean()
        quota.save()
    return quota


# --- the summary shown by the API, the CLI, the tenant page and the admin console ----------------
def summary(tenant, *, user=None, now=None):
    now = now or timezone.now()
    quota = quota_of(tenant)
    usage = usage_of(tenant, now, quota)
    state, reason = budget_state(quota, usage)
    intake = intake_of(quota)
    stored = stored_bytes(tenant)
    # Through the tenant's reverse relation: this module does not import jobs (jobs builds on tenants).
    # Counted by the database: rows read through the reverse relation with only() cost one more
    # query each (Django sets the tenant on each from its deferred tenant_id).
    queued = tenant.jobs.filter(status=QUEUED).aggregate(jobs=Count("id"), gpus=Sum(F("gpus") * F("learners")))
    body = {
        "quota": (quota or Quota()).as_dict(),  # no quota: an unsaved one's defaults (no limits)
        "usage": {"gpus": usage.gpus, "cpus": usage.cpus, "memory_bytes": usage.memory_bytes, "jobs": usage.jobs,
                  "gpu_hours": round(usage.gpu_hours, 4), "cpu_hours": round(usage.cpu_hours, 4),
                  "period_start": usage.period_start.isoformat(), "period_end": usage.period_end.isoformat(),
                  "storage_bytes": stored},
        "budget": {"state": state, "reason": reason},
        "storage": dict(zip(("state", "reason"), storage_state(quota, stored))),
        "queued": {"jobs": queued["jobs"], "gpus": queued["gpus"] or 0},
        "intake": {"queued_jobs": intake.queued_jobs, "submissions_per_minute": intake.submissions_per_minute,
                   "overridden": list(intake.overridden)},
        "history": history(tenant, quota, now),
    }
    if user is not None:
        body["usage"]["my_gpus"] = usage.gpus_by_user.get(user.pk, 0)
    return body
