"""Allocated against used: GPU-hours and CPU-hours per tenant, user and job over a period.

Allocated is what the tenant's attempts held (tenants.models.UsageRecord, from admission to release),
counted inside the period. Used is what their learners' resource samples (learner_agent.telemetry) say
they did with it: CPU seconds used (a sample's `cpu_cores` is its learner's cores over the period before
it) and GPU time (a sample's `gpus_busy`, the sum of its GPUs' utilisations: two GPUs at 50% are one GPU
busy). Each sample counts for the mean interval between its learner's samples in the period (the
sampling period, when samples come on time), so the report is one GROUP BY over the period's samples
whatever their number. A job whose samples carry no GPU utilisation (no NVML) has no used GPU-hours
(None), and its allocated GPU-hours are counted as unmeasured in the totals.

Here and not in tenants/ because it reads jobs' samples (jobs builds on tenants, never the reverse).
"""
import csv
import io
from collections import defaultdict
from datetime import datetime, time, timedelta

from django.conf import settings
from django.db.models import Count, Max, Min, Q, Sum
from django.utils import timezone

from jobs import retention, tenancy
from jobs.bounds import BadParameter
from jobs.models import Job, ResourceSample
from tenants import quotas, throttling
from tenants.models import UsageRecord

HOURS = 3600.0
MAX_SPAN = timedelta(days=400)
MIN_YEAR, MAX_YEAR = 1970, 9998
MAX_OFFSET = timedelta(hours=16)
FIELDS = ("allocated_gpu_hours", "used_gpu_hours", "allocated_cpu_hours", "used_cpu_hours")


class PeriodError(BadParameter):
    """A `start` or `end` the report cannot take: 400 {detail, field} (portal.api)."""

    def __init__(self, detail, *, field):
        super().__init__(field, detail)


def period_of(tenant, params, now=None):
    """[start, end) from `start`/`end` (ISO dates or times; a date is its midnight in the platform's time
    zone, an end date counts whole), else the tenant's current budget period."""
    now = now or timezone.now()
    quota = quotas.quota_of(tenant)
    start, end = quotas.period_bounds(quota.period if quota else "month", now)
    if params.get("start"):
        start = _moment(params["start"], "start")
    if params.get("end"):
        end = _moment(params["end"], "end", whole_day=True)
    if end <= start:
        raise PeriodError("end must be after start", field="end")
    if end - start > MAX_SPAN:
        raise PeriodError(f"a period of at most {MAX_SPAN.days} days", field="end")
    return start, end


def _moment(text, field, *, whole_day=False):
    try:
        value = datetime.fromisoformat(str(text))
    except ValueError:
        raise PeriodError("an ISO date (2026-11-01) or time (2026-11-01T12:00Z)", field=field) from None
    # Within what the database can compare: PostgreSQL refuses offsets past 15:59, and a day after the
    # last of year 9999 is no date at all.
    if not MIN_YEAR <= value.year <= MAX_YEAR:
        raise PeriodError(f"a date in the years {MIN_YEAR} to {MAX_YEAR}", field=field)
    offset = value.utcoffset()
    if offset is not None and abs(offset) >= MAX_OFFSET:
        raise PeriodError("a time zone offset within ±15:59", field=field)
    date_only = len(str(text)) == 10
    if timezone.is_naive(value):
        value = timezone.make_aware(value)
    if date_only and whole_day:
        value = timezone.make_aware(datetime.combine(value.date() + timedelta(days=1), time()))
    return value


def report_for(membership, *, start, end):
    """report() as `membership` may read it (its jobs rows: the jobs it may see), holding one of the
    tenant's USAGE_REPORTS slots: a period's samples are summed by the database every tenant shares,
    and a web thread waits for it, so one tenant's reloads cannot take either from the others
    (throttling.Busy when both are taken)."""
    # Deleted jobs it could see too: what they held is in the totals, and rows summing to less would
    # not add up.
    visible = tenancy.jobs_of(membership).values_list("id", flat=True).union(
        tenancy.deleted_jobs_of(membership).values_list("id", flat=True))
    with throttling.held(throttling.USAGE_REPORTS, membership.tenant_id):
        return report(membership.tenant, start=start, end=end, visible=visible)


def report(tenant, *, start, end, visible=None, now=None):
    """{period, tenant, users, jobs}: allocated and used per job (those in `visible`, a query or list
    of ids, when given), per user and for the tenant (all its jobs)."""
    now = now or timezone.now()
    jobs = defaultdict(lambda: {"gpu_s": 0.0, "cpu_s": 0.0, "used_gpu_s": 0.0, "used_cpu_s": 0.0,
                                "gpu_measured": False})
    for record in (UsageRecord.objects.filter(tenant=tenant, started_at__lt=end)
                   .filter(Q(ended_at__isnull=True) | Q(ended_at__gt=start))
                   .only("job_id", "gpus", "cpus", "started_at", "ended_at")):
        seconds = record.seconds_within(start, end, now)
        entry = jobs[record.job_id]
        entry["gpu_s"] += record.gpus * seconds
        entry["cpu_s"] += record.cpus * seconds
    samples = (ResourceSample.objects.filter(job__tenant=tenant, time__gte=start, time__lt=end)
               .values("job_id", "attempt", "learner")
               .annotate(n=Count("id"), cpu=Sum("cpu_cores"), gpu=Sum("gpus_busy"), gpu_n=Count("gpus_busy"),
                         first=Min("time"), last=Max("time")))
    learners = {}
    # With what is kept of pruned samples (jobs.retention), in one statement: a day pruned while the
    # report reads is read either as its samples or as its sums, never as neither or both.
    for group in samples.union(retention.days_within(tenant, start, end), all=True):
        _merge(learners, group)
    for group in learners.values():
        interval = ((group["last"] - group["first"]).total_seconds() / (group["n"] - 1) if group["n"] > 1
                    else settings.RESOURCE_SAMPLE_S)
        entry = jobs[group["job_id"]]
        entry["used_cpu_s"] += group["cpu"] * interval
        if group["gpu_n"]:
            entry["gpu_measured"] = True
            entry["used_gpu_s"] += group["gpu"] * interval
    facts = {job["id"]: job for job in Job.objects.filter(id__in=list(jobs)).values("id", "name", "owner__username",
                                                                                     "deleted_at")}
    shown = set(jobs) if visible is None else set(jobs) & set(visible)
    job_rows = [{"job": job_id, "name": facts[job_id]["name"], "user": facts[job_id]["owner__username"],
                 "deleted": facts[job_id]["deleted_at"] is not None, **_hours(entry)}
                for job_id, entry in sorted(jobs.items()) if job_id in shown]
    by_user, total = {}, _zero()
    for job_id, entry in jobs.items():
        _add(by_user.setdefault(facts[job_id]["owner__username"], _zero()), entry)
        _add(total, entry)
    return {"period": {"start": start.isoformat(), "end": end.isoformat()},
            "tenant": {"tenant": tenant.slug, **_hours(total)},
            "users": [{"user": user, **_hours(entry)} for user, entry in sorted(by_user.items())],
            "jobs": job_rows}


def _merge(groups, group):
    """Add one learner's samples in the period, or its pruned days in it (jobs.retention), to what is
    read of that learner so far."""
    key = (group["job_id"], group["attempt"], group["learner"])
    kept = groups.get(key)
    if kept is None:
        groups[key] = group
        return
    groups[key] = {**kept, "n": kept["n"] + group["n"], "cpu": kept["cpu"] + group["cpu"],
                   "gpu": (kept["gpu"] or 0.0) + (group["gpu"] or 0.0), "gpu_n": kept["gpu_n"] + group["gpu_n"],
                   "first": min(kept["first"], group["first"]), "last": max(kept["last"], group["last"])}


def _zero():
    return {"gpu_s": 0.0, "cpu_s": 0.0, "used_gpu_s": 0.0, "used_cpu_s": 0.0, "gpu_measured": False,
            "unmeasured_gpu_s": 0.0}


def _add(into, entry):
    for name in ("gpu_s", "cpu_s", "used_gpu_s", "used_cpu_s"):
        into[name] += entry[name]
    if entry["gpu_measured"]:
        into["gpu_measured"] = True
    else:
        into["unmeasured_gpu_s"] += entry["gpu_s"]


def _hours(entry):
    """The report's figures of one row: hours, used GPU-hours None where nothing measured GPUs."""
    measured = entry["gpu_measured"]
    hours = {"allocated_gpu_hours": round(entry["gpu_s"] / HOURS, 4),
             "used_gpu_hours": round(entry["used_gpu_s"] / HOURS, 4) if measured else None,
             "allocated_cpu_hours": round(entry["cpu_s"] / HOURS, 4),
             "used_cpu_hours": round(entry["used_cpu_s"] / HOURS, 4)}
    if "unmeasured_gpu_s" in entry:
        hours["unmeasured_gpu_hours"] = round(entry["unmeasured_gpu_s"] / HOURS, 4)
    return hours


BY = {"job": ("job", "name", "user", "deleted"), "user": ("user",), "tenant": ("tenant",)}


def as_csv(body, *, by):
    """The report's rows `by` job, user or tenant as CSV text, the period on every row."""
    rows = [body["tenant"]] if by == "tenant" else body[f"{by}s"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["period_start", "period_end", *BY[by], *FIELDS])
    for row in rows:
        writer.writerow([body["period"]["start"], body["period"]["end"],
                         *(_cell(str(row[name]).lower() if isinstance(row[name], bool) else row[name])
                           for name in BY[by]),
                         *("" if row[name] is None else row[name] for name in FIELDS)])
    return out.getvalue()


def _cell(text):
    """A name as a spreadsheet shows it, never as a formula (=, +, -, @ first: CSV injection)."""
    text = str(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text
