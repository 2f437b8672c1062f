"""Idle GPUs: each tenant's policy (IdleGpuPolicy) judged against its running jobs' resource samples.

A job whose GPUs all stay below the tenant's utilisation threshold for the tenant's window is flagged
(`Job.gpus_idle_since`, shown on its page and in the jobs list), a GPUS_IDLE webhook event is written
in the same transaction (listeners registered with `listen`: notifications), and where the policy says
halt it is halted through its checkpoint (jobs.lifecycle.halt), which frees its GPUs.

It is a periodic pass of its own on Celery beat (TRAINYARD_IDLE_GPU_INTERVAL), beside reconcile and
the autoscaler, and not part of the scheduling cycle: it judges what learners did, never what may be
admitted, and it changes a job only through `lifecycle.halt`'s transition, whose compare-and-swap makes
a second pass (or a second beat) harmless.

Idleness is read from the samples' own times (the agent's clock), not the pass's: a job is idle when
its latest sample and the first sample after its last busy one are `minutes` apart, every sample between
below the threshold. Sampled every P seconds, a learner whose GPUs go quiet at t is seen idle for the
window by the sample at t + window + P at the latest; the pass acts on it within one interval of its
arrival. A sample without GPU utilisation (no NVML, a virtual GPU without a stand-in:
learner_agent.telemetry.load_nvml) says nothing either way, so such a job is never flagged.
"""
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Max, Q
from django.utils import timezone

from jobs import lifecycle
from jobs.models import IdleGpuPolicy, IdleWatch, Job, ResourceSample, Status
from jobs.states import InvalidTransition
from tenants import audit

log = logging.getLogger(__name__)
ACTOR = "idle-gpu-policy"
# Samples are read this far beyond the window: enough to find where an idle stretch began even when the
# agents' clocks run a little behind the platform's or their samples arrive late.
LOOKBACK_MARGIN = timedelta(minutes=5)
_listeners = []


def listen(listener):
    """Call `listener(job, *, since, policy, when)` inside the transaction that flags a job."""
    if listener not in _listeners:
        _listeners.append(listener)


@dataclass(frozen=True)
class Reading:
    """One attempt's GPU samples in the lookback: the newest, the newest at or above the threshold (None:
    none was), the oldest (read only where none was busy) and the first after the busy one (None: the
    newest is busy, or none busy)."""
    latest: datetime
    oldest: datetime | None = None
    last_busy: datetime | None = None
    first_idle: datetime | None = None


def idle_since(reading, *, window):
    """When the GPUs went idle, if they have stayed idle for `window` by the samples' times; else None."""
    start = reading.oldest if reading.last_busy is None else reading.first_idle
    if start is None or reading.latest - start < window:
        return None
    return start


def set_policy(tenant, *, below_percent, minutes, action, actor):
    """Create or change the tenant's policy (values checked by the caller: jobs.idle_api's serializer),
    with an audit entry; the next pass judges by it."""
    with transaction.atomic():
        policy = IdleGpuPolicy.objects.select_for_update().filter(tenant=tenant).first()
        before = policy.as_dict() if policy else None
        policy = policy or IdleGpuPolicy(tenant=tenant)
        policy.below_percent, policy.minutes, policy.action, policy.updated_by = below_percent, minutes, action, actor
        policy.save()
        audit.record("changed" if before else "created", "idle-gpu-policy", tenant.slug, tenant=tenant,
                     before=before, after=policy.as_dict())
    return policy


def remove_policy(tenant):
    with transaction.atomic():
        policy = IdleGpuPolicy.objects.select_for_update().filter(tenant=tenant).first()
        if policy is not None:
            audit.record("deleted", "idle-gpu-policy", tenant.slug, tenant=tenant, before=policy.as_dict())
            policy.delete()
            IdleWatch.objects.filter(job__tenant=tenant).delete()


def policy_text(policy):
    return f"GPUs below {policy.below_percent:g}% for {policy.minutes:g} min (the tenant's idle-GPU policy)"


def run(now=None):
    """One pass over every tenant with a policy; the ids of the jobs it flagged."""
    now = now or timezone.now()
    flagged = []
    IdleWatch.objects.exclude(job__status=Status.PROCESSING).delete()  # what it read of jobs that moved on
    for policy in IdleGpuPolicy.objects.all():
        jobs = {job.id: job for job in Job.objects.select_related("tenant").filter(
            tenant_id=policy.tenant_id, status=Status.PROCESSING, gpus__gt=0)}
        if not jobs:
            continue
        window = timedelta(minutes=policy.minutes)
        readings = _readings(jobs, policy, since=now - window - LOOKBACK_MARGIN)
        for job in jobs.values():
            reading = readings.get(job.id)
            if job.gpus_idle is not None:
                _recheck_flagged(job, reading, policy)
                continue
            since = idle_since(reading, window=window) if reading is not None else None
            if since is not None and flag(job, since=since, policy=policy, when=now):
                flagged.append(job.id)
    return flagged


def _readings(jobs, policy, *, since):
    """{job id: Reading} of the jobs' current attempts, samples from `since` on. Each job's IdleWatch
    keeps its newest sample and its newest busy one, so only the samples stored since the pass before
    are read (an ingest post stores a job's samples under the job's lock: later ids commit later);
    where the quiet began is then one step along the (job, time) index."""
    watches = _watches(jobs, policy)
    _read_new(watches, threshold=policy.below_percent, since=since)
    IdleWatch.objects.bulk_create(watches.values(), update_conflicts=True, unique_fields=["job"],
                                  update_fields=["attempt", "below_percent", "minutes", "read_through", "latest",
                                                 "last_busy"])
    readings = {}
    for job_id, watch in watches.items():
        if watch.latest is None or watch.latest < since:
            continue
        last_busy = watch.last_busy if watch.last_busy is not None and watch.last_busy >= since else None
        if jobs[job_id].gpus_idle is not None:  # a flagged job is judged by its last busy sample alone
            readings[job_id] = Reading(latest=watch.latest, last_busy=last_busy)
        elif last_busy is None:
            readings[job_id] = Reading(latest=watch.latest, oldest=_first_sample(watch, after=since, inclusive=True))
        else:
            readings[job_id] = Reading(latest=watch.latest, last_busy=last_busy, first_idle=None
                                       if watch.latest == last_busy else _first_sample(watch, after=last_busy))
    return readings


def _watches(jobs, policy):
    """{job id: its IdleWatch}, a new one where there is none yet or its attempt or policy changed."""
    kept = {watch.job_id: watch for watch in IdleWatch.objects.filter(job_id__in=list(jobs))}
    watches = {}
    for job_id, job in jobs.items():
        watch = kept.get(job_id)
        if watch is None or (watch.attempt, watch.below_percent, watch.minutes) != (
                job.attempt, policy.below_percent, policy.minutes):
            watch = IdleWatch(job_id=job_id, attempt=job.attempt, below_percent=policy.below_percent,
                              minutes=policy.minutes)
        watches[job_id] = watch
    return watches


def _read_new(watches, *, threshold, since):
    """Move each watch past the samples of its attempt stored since it last read (a new one: those from
    `since`). A query per job, each one range of an index: one query for all of them was planned as a
    scan of every job's samples."""
    for watch in watches.values():
        stored = (Q(id__gt=watch.read_through) if watch.read_through else Q(time__gte=since))
        new = (ResourceSample.objects.filter(stored, job_id=watch.job_id, attempt=watch.attempt)
               .aggregate(top=Max("id"), latest=Max("time", filter=Q(gpu_utilization__isnull=False)),
                          last_busy=Max("time", filter=Q(gpu_utilization__gte=threshold))))
        if new["top"] is not None:
            watch.read_through = new["top"]
            watch.latest = _later(watch.latest, new["latest"])
            watch.last_busy = _later(watch.last_busy, new["last_busy"])


def _later(one, other):
    return other if one is None else one if other is None else max(one, other)


def _first_sample(watch, *, after, inclusive=False):
    """The time of the watched attempt's first sample with a GPU utilisation after `after` (at it, too,
    where `inclusive`)."""
    later = Q(time__gte=after) if inclusive else Q(time__gt=after)
    return (ResourceSample.objects.filter(later, job_id=watch.job_id, attempt=watch.attempt,
                                          gpu_utilization__isnull=False)
            .order_by("time").values_list("time", flat=True).first())


def flag(job, *, since, policy, when):
    """Flag the job's attempt as idle since `since`, tell the listeners, and halt it where the policy
    says. False when another pass flagged it first or the job moved on."""
    with transaction.atomic():
        won = (Job.objects.filter(pk=job.id, attempt=job.attempt, status=Status.PROCESSING)
               .exclude(gpus_idle_attempt=job.attempt)
               .update(gpus_idle_since=since, gpus_idle_attempt=job.attempt))
        if not won:
            return False
        job.gpus_idle_since, job.gpus_idle_attempt = since, job.attempt
        for listener in _listeners:
            listener(job, since=since, policy=policy, when=when)
    log.info("%s: GPUs idle since %s: %s", job.id, since.isoformat(), policy_text(policy))
    if policy.action == IdleGpuPolicy.Action.HALT:
        _halt(job, policy)
    return True


def _recheck_flagged(job, reading, policy):
    """A flagged job that is busy again loses its flag (and may be flagged anew); one whose policy says
    halt and is still running is halted (again: a pass that died between flag and halt left it so)."""
    if reading is not None and reading.last_busy is not None and reading.last_busy > job.gpus_idle_since:
        Job.objects.filter(pk=job.id, gpus_idle_attempt=job.attempt).update(gpus_idle_since=None, gpus_idle_attempt=0)
        return
    if policy.action == IdleGpuPolicy.Action.HALT:
        _halt(job, policy)


def _halt(job, policy):
    try:
        lifecycle.halt(job, actor=ACTOR, reason=f"idle {policy_text(policy)}")
    except InvalidTransition:
        pass  # it moved on meanwhile (it ended, or someone halted it)
