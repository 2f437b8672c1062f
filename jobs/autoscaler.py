"""The autoscaler: carries out the elastic optimizer's plan (gpu_scheduler.elastic.optimize) for the
running elastic jobs, resizing them through their checkpoint (jobs.lifecycle.resize).

The scheduling loop runs it after each cycle (jobs.scheduler_loop; a pass returns at once unless an
elastic job runs on GPUs: may_resize), and a Celery task every TRAINYARD_ELASTIC_INTERVAL seconds. One pass, under the admission lock (so it never races a
scheduling cycle):

1. snapshot: the running elastic jobs that may change now, the GPUs they may use (their own plus the
   idle ones), and what each tenant's GPU quota leaves them;
2. measure: each job's throughput per shape from its Allocation rows (samples per second, learner
   0's `samples` reports) and its current attempt, fitted into a throughput model
   (gpu_scheduler.throughput.fit), and its resize cost as measured on its earlier resizes (else the
   platform's other resizes, else TRAINYARD_ELASTIC_RESIZE_COST);
3. decide: optimize(); a job resized less than TRAINYARD_ELASTIC_MIN_INTERVAL seconds ago is held at
   its size; the plan is carried out only if its predicted gain over TRAINYARD_ELASTIC_HORIZON
   seconds beats the restarts it costs (hysteresis: no resize for a gain the restart eats);
4. act: shrinks first, then grows onto GPUs idle now (a grow that would need a shrinking job's GPUs
   waits for a later pass). Grows also wait while GPUs are being released: until no attempt has
   given GPUs back for TRAINYARD_ELASTIC_GROW_SETTLE seconds (a stabilisation window, as the
   Kubernetes HPA has one), so jobs ending together free their GPUs into one resize — growing onto
   the first of them would cost a second restart for the rest, or leave them idle for
   TRAINYARD_ELASTIC_MIN_INTERVAL.

Elastic jobs without GPUs (gpus: 0) are not resized by the autoscaler: the optimizer divides GPUs.
"""
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Min
from django.utils import timezone

from gpu_scheduler import elastic as optimizer
from gpu_scheduler import throughput
from jobs import admission, elastic_timeline, lifecycle
from jobs.backends import get_backend
from jobs.models import ACTIVE, Allocation, Job, MetricPoint, Status
from tenants import quotas
from tenants.models import UsageRecord
from trainyard import elasticity

log = logging.getLogger(__name__)
ACTOR = "autoscaler"
# Relative communication overheads of the throughput prior, scaled to each job's own measured speed
# (gpu_scheduler.throughput.calibrated); measurements at other sizes pull the fit away from them.
PRIOR_OVERHEADS = {"within_2": 0.15, "within_4": 0.35, "across_8": 0.6}


@dataclass(frozen=True)
class Candidate:
    """A running elastic job the pass may resize, with what was measured of it."""
    job: Job
    elastic: elasticity.Elastic
    current: Allocation | None
    rate: float | None  # samples/s of the current attempt, measured
    model: throughput.ThroughputModel
    resize_cost_s: float
    frozen: bool  # resized too recently: held at its size this pass


def may_resize():
    """Whether a pass could resize anything: a job runs that is elastic and holds GPUs (what
    _candidate asks first). One query on the running jobs. A pass reads the cluster's capacity and
    every active job whole, and one runs after every scheduling cycle, on a cluster without a single
    elastic job too: several passes per job, each loading every running job."""
    return Job.objects.filter(status=Status.PROCESSING, gpus__gt=0).exclude(runtime__elastic=None).exists()


def run(now=None):
    """One pass; returns the Allocation rows of the resizes it requested."""
    if not may_resize():
        return []
    nodes = tuple(get_backend().capacity().nodes)  # before the lock: may be a network call
    now = now or timezone.now()
    with transaction.atomic():
        admission.take_admission_lock()
        active = list(Job.objects.filter(status__in=ACTIVE).select_related("tenant"))
        candidates = [c for job in active if (c := _candidate(job, now)) is not None]
        if not candidates:
            return []
        held = _held_gpus(active)
        mine = {c.job.id for c in candidates}
        cluster = optimizer.ElasticCluster(
            nodes={n.name: n.gpus - sum(1 for (node, _), owner in held.items() if node == n.name and owner not in mine)
                   for n in nodes if n.schedulable},
            quotas=_tenant_gpus_left(active, mine))
        jobs = [_elastic_job(c, now) for c in candidates]
        policy = optimizer.ElasticPolicy(settings.ELASTIC_POLICY, min_horizon_s=settings.ELASTIC_HORIZON_S)
        try:
            targets = optimizer.optimize(jobs, cluster, policy, now=now.timestamp())
        except ValueError as exc:  # the running jobs' minimums do not fit what they may use
            log.warning("autoscaler: no plan: %s", exc)
            return []
        jobs_by_id = {c.job.id: c.job for c in candidates}
        changes = {c.job.id: targets[c.job.id] for c in candidates
                   if targets[c.job.id].learners and targets[c.job.id].learners != c.job.learners}
        if not changes:
            return []
        gain = sum(predicted_gain_s(c, changes[c.job.id]) for c in candidates if c.job.id in changes)
        if gain <= 0:
            log.info("autoscaler: plan %s not carried out: its predicted gain does not beat its resize cost",
                     {job_id: t.learners for job_id, t in changes.items()})
            return []
        grows = any(t.learners > jobs_by_id[job_id].learners for job_id, t in changes.items())
        if grows and _gpus_released_since(now - timedelta(seconds=settings.ELASTIC_GROW_SETTLE_S)):
            log.info("autoscaler: plan %s waits: GPUs were released less than %.0f s ago",
                     {job_id: t.learners for job_id, t in changes.items()}, settings.ELASTIC_GROW_SETTLE_S)
            return []
        return _carry_out(candidates, changes, held, {n.name: n.gpus for n in nodes})


# --- 1. snapshot --------------------------------------------------------------------------------------
def _candidate(job, now):
    elastic = elasticity.of(job)
    if elastic is None or not job.gpus or job.status != Status.PROCESSING or job.preempted_reason:
        return None
    current = elastic_timeline.of_attempt(job)
    last_resize = (Allocation.objects.filter(job=job, resize_requested_at__isnull=False)
                   .aggregate(last=Max("resize_requested_at"))["last"])
    frozen = last_resize is not None and now - last_resize < timedelta(seconds=settings.ELASTIC_MIN_INTERVAL_S)
    rate = _current_rate(job)
    return Candidate(job=job, elastic=elastic, current=current, rate=rate, model=_model(job, current, rate),
                     resize_cost_s=_resize_cost_s(job), frozen=frozen)


def _held_gpus(active):
    """{(node, gpu id): job id} of every GPU an active job holds."""
    return {(p["node"], gpu): job.id for job in active for p in job.placement for gpu in p["gpu_ids"]}


def _gpus_released_since(moment):
    """Whether an attempt gave GPUs back after `moment` (its usage record closed then)."""
    return UsageRecord.objects.filter(ended_at__gt=moment, gpus__gt=0).exists()


def _tenant_gpus_left(active, mine):
    """tenant slug -> GPUs its elastic candidates may hold in all, for tenants whose GPU quota binds
    them (no borrowing); GPUs its other jobs hold count against it."""
    left = {}
    for job in active:
        if job.tenant.slug in left:
            continue
        quota = quotas.quota_of(job.tenant)
        if quota is None or quota.gpus is None or quota.can_borrow:
            continue
        others = sum(len(p["gpu_ids"]) for j in active if j.tenant_id == job.tenant_id and j.id not in mine
                     for p in j.placement)
        left[job.tenant.slug] = max(0, quota.gpus - others)
    return left


def _elastic_job(candidate, now):
    job, elastic, current = candidate.job, candidate.elastic, candidate.current
    low, high = (job.learners, job.learners) if candidate.frozen else (elastic.min_learners, elastic.max_learners)
    batch = (current.global_batch if current else None) or 0
    bounds = elastic.batch or elasticity.BatchBounds(*(_no_batch(elastic, job),) * 3)
    return optimizer.ElasticJob(
        job_id=job.id, tenant=job.tenant.slug, min_learners=low, max_learners=high, gpus_per_learner=job.gpus,
        base_batch=bounds.base, batch_min=bounds.low, batch_max=bounds.high, requested_learners=job.learners,
        model=candidate.model, restart_s=candidate.resize_cost_s, learners=job.learners,
        batch=batch or bounds.base, placement=tuple(p["node"] for p in job.placement),
        started_s=job.started_at.timestamp() if job.started_at else now.timestamp(),
        order=int(job.created_at.timestamp() * 1_000_000))


def _no_batch(elastic, job):
    """A job that declares no batch size changes only its learners: any batch every count divides."""
    return elastic.max_learners * job.gpus * 64


# --- 2. measure -------------------------------------------------------------------------------------
def _current_rate(job):
    """Samples per second of the current attempt from learner 0's `samples` reports, or None."""
    points = MetricPoint.objects.filter(job=job, attempt=job.attempt, learner=0,
                                        name=elastic_timeline.SAMPLES_METRIC)
    span = points.aggregate(first=Min("time"), last=Max("time"), low=Min("value"), high=Max("value"))
    if span["first"] is None or span["last"] <= span["first"] or span["high"] <= span["low"]:
        return None
    return (span["high"] - span["low"]) / (span["last"] - span["first"]).total_seconds()


def _observation(learners, gpus_per_learner, nodes, global_batch, rate):
    gpus = learners * gpus_per_learner
    return gpus, max(1, nodes), global_batch / gpus, global_batch / rate


def _model(job, current, rate):
    """The job's throughput model: its measured shapes, pulled toward a prior scaled to its speed."""
    observations = []
    for row in Allocation.objects.filter(job=job, ended_at__isnull=False, global_batch__isnull=False):
        if row.samples_per_s:
            nodes = len({p["node"] for p in row.placement if isinstance(p, dict)})
            observations.append(_observation(row.learners, row.gpus_per_learner, nodes, row.global_batch,
                                             row.samples_per_s))
    if rate and current is not None and current.global_batch:
        observations.append(_observation(job.learners, job.gpus, len({p["node"] for p in job.placement}),
                                         current.global_batch, rate))
    if not observations:
        return throughput.GENERIC_PRIOR
    gpus, _, local, step_s = observations[-1]
    prior = throughput.calibrated(per_gpu_batch=local, one_gpu_rate=local / step_s * (1 + _overhead(gpus)),
                                  **PRIOR_OVERHEADS)
    return throughput.fit(observations, prior)


def _overhead(gpus):
    """The prior's communication overhead at `gpus` GPUs in one node (to scale it to a measurement)."""
    if gpus <= 1:
        return 0.0
    within_2, within_4 = PRIOR_OVERHEADS["within_2"], PRIOR_OVERHEADS["within_4"]
    return within_2 + (within_4 - within_2) * (gpus - 2) / 2


def _resize_cost_s(job):
    """Seconds a resize of this job cost (its own resizes, else any job's), else the configured guess."""
    for rows in (Allocation.objects.filter(job=job), Allocation.objects.all()):
        measured = list(rows.filter(resize_cost_s__isnull=False).order_by("-id")
                        .values_list("resize_cost_s", flat=True)[:10])
        if measured:
            return sum(measured) / len(measured)
    return settings.ELASTIC_RESIZE_COST_S


# --- 3. decide --------------------------------------------------------------------------------------
def predicted_rate(candidate, learners, batch):
    gpus = learners * candidate.job.gpus
    return candidate.model.throughput(gpus, 1, batch or candidate.job.gpus * learners)


def predicted_gain_s(candidate, target):
    """Seconds of the job's present progress gained over the horizon by moving to `target`, less what
    the restart costs: (new rate / rate now - 1) x horizon - resize cost."""
    job = candidate.job
    now_batch = candidate.current.global_batch if candidate.current else None
    rate_now = candidate.rate or predicted_rate(candidate, job.learners, now_batch)
    shape = elasticity.shape(candidate.elastic, target.learners, target.batch or now_batch)
    rate_new = predicted_rate(candidate, target.learners, shape.global_batch)
    if not rate_now:
        return 0.0
    return (rate_new / rate_now - 1) * settings.ELASTIC_HORIZON_S - candidate.resize_cost_s


# --- 4. act -----------------------------------------------------------------------------------------
def _carry_out(candidates, changes, held, node_gpus):
    rows = []
    ordered = sorted((c for c in candidates if c.job.id in changes),
                     key=lambda c: changes[c.job.id].learners - c.job.learners)  # shrinks first
    for candidate in ordered:
        job, target = candidate.job, changes[candidate.job.id]
        placement = _placement(job, target, held, node_gpus)
        if len(placement) == job.learners:
            continue  # a grow with no idle GPU on the planned nodes yet
        why = "idle GPUs" if len(placement) > job.learners else "GPUs for other elastic jobs"
        row = lifecycle.resize(job, learners=len(placement), placement=placement, why=why, actor=ACTOR,
                               wanted_batch=target.batch or None)
        if row is not None:
            rows.append(row)
            for p in placement:
                for gpu in p["gpu_ids"]:
                    held[(p["node"], gpu)] = job.id
    return rows


def _placement(job, target, held, node_gpus):
    """The new attempt's placement: the job's first learners where they are, the added ones on GPUs
    idle now on the nodes the optimizer chose (as many as there are)."""
    keep = list(job.placement[:target.learners])
    for node in target.placement[len(keep):]:
        free = sorted(gpu for gpu in range(node_gpus.get(node, 0)) if (node, gpu) not in held
                      and not any(gpu in p["gpu_ids"] and p["node"] == node for p in keep))
        if len(free) < job.gpus:
            break
        keep.append({"node": node, "gpu_ids": free[:job.gpus]})
    return keep

