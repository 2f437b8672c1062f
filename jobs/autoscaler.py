"""The autoscaler: carries out the elastic optimizer's plan (gpu_scheduler.elastic.optimize) for the
running elastic jobs, resizing them through their checkpoint (jobs.lifecycle.resize), or changing
their batch inside the running learners where they can (jobs.lifecycle.change_batch).

The scheduling loop runs it after each cycle (jobs.scheduler_loop; a pass returns at once unless an
elastic job runs on GPUs: may_resize), and a Celery task every TRAINYARD_ELASTIC_INTERVAL seconds. One pass, under the admission lock (so it never races a
scheduling cycle):

1. snapshot: the running elastic jobs that may change now, the GPUs they may use (their own plus the
   idle ones, less what the queued jobs waiting for capacity need: a grow never takes GPUs a queued
   job could be admitted onto), and what each tenant's GPU quota leaves them;
2. measure: each job's throughput per shape from its Allocation rows (samples per second, learner
   0's `samples` reports) and its current attempt, fitted into a throughput model
   (gpu_scheduler.throughput.fit); its gradient noise scale, re-read each pass from the latest
   `noise_scale` reports (learner_agent.goodput); and its resize cost as measured on its earlier
   resizes (else the platform's other resizes, else TRAINYARD_ELASTIC_RESIZE_COST);
3. decide: optimize(); a job resized less than TRAINYARD_ELASTIC_MIN_INTERVAL seconds ago is held at
   its size; a job is not grown past twice the largest shape it has measured, nor at all while its
   sampled GPU use is under TRAINYARD_ELASTIC_GROW_MIN_GPU_USE, and a job that reports
   no noise scale is never given a larger global batch than its own (it scales its learners only);
   the plan is carried out only if its predicted gain in goodput over TRAINYARD_ELASTIC_HORIZON
   seconds beats the restarts it costs (hysteresis: no resize for a gain the restart eats); another
   global batch at the same learners (the noise scale moved) is a batch change inside the running
   learners when they apply them (learner_agent.batch_changes), worth making from a gain of
   LIVE_BATCH_MIN_GAIN; for learners that do not, only a larger batch, through the checkpoint (and
   for an attempt that let one go unapplied for BATCH_CHANGE_PATIENCE_S: it is withdrawn, and the
   attempt is not asked again);
4. act: shrinks first, then grows onto GPUs idle now (a grow that would need a shrinking job's GPUs
   waits for a later pass). Grows also wait while GPUs are being released: until no attempt has
   given GPUs back for TRAINYARD_ELASTIC_GROW_SETTLE seconds (a stabilisation window, as the
   Kubernetes HPA has one), so jobs ending together free their GPUs into one resize — growing onto
   the first of them would cost a second restart for the rest, or leave them idle for
   TRAINYARD_ELASTIC_MIN_INTERVAL.

Elastic jobs without GPUs (gpus: 0) are not resized by the autoscaler: the optimizer divides GPUs.
"""
import logging
import math
import statistics
from dataclasses import dataclass, replace
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from gpu_scheduler import elastic as optimizer
from gpu_scheduler import throughput
from gpu_scheduler.model import Resources
from gpu_scheduler.placement import learners_hosted
from jobs import admission, elastic_timeline, lifecycle
from jobs.backends import get_backend
from jobs.models import ACTIVE, Allocation, Job, MetricPoint, ResourceSample, Status
from tenants import quotas
from tenants.models import Quota, UsageRecord
from trainyard import elasticity

log = logging.getLogger(__name__)
ACTOR = "autoscaler"
# The metric a learner reports its gradient noise scale under (learner_agent.goodput), and how many of
# its latest reports the autoscaler takes the median of (one report averages a few steps; it is noisy).
NOISE_SCALE_METRIC = "noise_scale"
NOISE_SCALE_REPORTS = 5
# How many of each learner's latest resource samples say how busy a job keeps its GPUs (measured_gpu_use).
GPU_USE_SAMPLES = 6
# The least relative gain in goodput a batch change inside the running learners must promise: it costs
# no restart, so without a margin a noise scale that wobbles around a boundary would move the batch
# back and forth (one change at a time: the next waits until the learners have applied the last).
LIVE_BATCH_MIN_GAIN = 0.05
# How long a batch change may wait for the learners to apply it (at their next step: seconds, for a
# slow step minutes) before it is withdrawn and the attempt's batch changes go through restarts.
BATCH_CHANGE_PATIENCE_S = 600.0
# A job is not grown past this many times the largest shape it has measured: the throughput model
# extrapolates from what it has seen, and errs more the further it goes.
GROWTH_PAST_MEASURED = 2
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
    frozen: bool  # resized too recently, or a batch change is on its way: held at its size this pass
    noise_scale: float | None = None  # measured (samples); None: the job reports none
    largest_measured: int = 0  # learners of the largest shape with a measured rate; 0: none yet
    gpu_use: float | None = None  # the share of its GPUs its learners keep busy, sampled; None: unmeasured
    live_batch: bool = False  # its learners change their batch while they run (no restart needed)
    batch_pending: bool = False  # a batch change asked of its learners is not applied yet


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
        candidates = _candidates(active, now)
        if not candidates:
            return []
        held = _held_gpus([*active, *admission.being_torn_down()])
        mine = {c.job.id for c in candidates}
        reserved = _reserved_for_queue(nodes, held, active)
        gpus_left = _tenant_gpus_left(active, mine)
        candidates = _over_quota_kept(candidates, gpus_left)
        caps = _grow_caps(candidates, active, nodes)
        cluster = optimizer.ElasticCluster(
            nodes={n.name: n.gpus - reserved.get(n.name, 0)
                   - sum(1 for (node, _), owner in held.items() if node == n.name and owner not in mine)
                   for n in nodes if n.schedulable},
            quotas=gpus_left)
        jobs = [_elastic_job(c, now, most=caps[c.job.id]) for c in candidates]
        policy = optimizer.ElasticPolicy(settings.ELASTIC_POLICY, min_horizon_s=settings.ELASTIC_HORIZON_S)
        try:
            targets = optimizer.optimize(jobs, cluster, policy, now=now.timestamp())
        except ValueError as exc:  # the running jobs' minimums do not fit what they may use
            log.warning("autoscaler: no plan: %s", exc)
            return []
        jobs_by_id = {c.job.id: c.job for c in candidates}
        changes = {c.job.id: targets[c.job.id] for c in candidates
                   if targets[c.job.id].learners and (targets[c.job.id].learners != c.job.learners
                                                      or _batch_changes(c, targets[c.job.id]))}
        if not changes:
            return []
        plan = {job_id: t.learners for job_id, t in changes.items()}
        gain = sum(predicted_gain_s(c, changes[c.job.id]) for c in candidates if c.job.id in changes)
        if gain <= 0:
            log.info("autoscaler: plan %s not carried out: its predicted gain does not beat its resize cost", plan)
            return []
        grows = any(learners > jobs_by_id[job_id].learners for job_id, learners in plan.items())
        if grows and _gpus_released_since(now - timedelta(seconds=settings.ELASTIC_GROW_SETTLE_S)):
            log.info("autoscaler: plan %s waits: GPUs were released less than %.0f s ago", plan,
                     settings.ELASTIC_GROW_SETTLE_S)
            return []
        return _carry_out(candidates, changes, held, {n.name: n.gpus - reserved.get(n.name, 0) for n in nodes})


# --- 1. snapshot --------------------------------------------------------------------------------------
def _candidates(active, now):
    """The jobs the pass may resize, each read on its own: what one job reported cannot stop the
    pass for every other tenant's (a job whose reads fail is left as it is, and logged)."""
    candidates = []
    for job in active:
        if not _may_be_candidate(job):
            continue  # no savepoint for each of the other tenants' running jobs
        try:
            with transaction.atomic():  # a savepoint: a failed read leaves the pass's transaction usable
                candidate = _candidate(job, now)
        except Exception:  # noqa: BLE001 - one job's failure is logged, the others go on
            log.exception("autoscaler: %s left as it is: reading it failed", job.id)
            continue
        if candidate is not None:
            candidates.append(candidate)
    return candidates


def _may_be_candidate(job):
    """An elastic job training on GPUs and not being halted: what _candidate asks first, read from the row."""
    return bool((job.runtime or {}).get("elastic") and job.gpus and job.status == Status.PROCESSING
                and not job.preempted_reason)


def _candidate(job, now):
    elastic = elasticity.of(job)
    if elastic is None or not _may_be_candidate(job):
        return None
    current = elastic_timeline.of_attempt(job)
    if job.batch_request is not None and _unapplied_for(job, now) > BATCH_CHANGE_PATIENCE_S:
        elastic_timeline.withdraw_batch_request(job, now)
    # The minimum interval is between restarts: a batch change inside the learners costs none.
    last_restart = (Allocation.objects.filter(job=job, resize_requested_at__isnull=False)
                    .exclude(kind=Allocation.Kind.BATCH).aggregate(last=Max("resize_requested_at"))["last"])
    pending = job.batch_request is not None
    frozen = pending or (last_restart is not None
                         and now - last_restart < timedelta(seconds=settings.ELASTIC_MIN_INTERVAL_S))
    rate = _current_rate(job, current)
    stretches = _measured_stretches(job)
    # Learners of the largest shape the job has a measured rate at (the current one once it has one).
    largest = max([row.learners for row, _ in stretches] + ([job.learners] if rate else []), default=0)
    return Candidate(job=job, elastic=elastic, current=current, rate=rate, model=_model(job, current, rate, stretches),
                     resize_cost_s=_resize_cost_s(job), frozen=frozen, noise_scale=measured_noise_scale(job),
                     largest_measured=largest, gpu_use=measured_gpu_use(job),
                     live_batch=elastic_timeline.listens_for_batch_changes(job), batch_pending=pending)


def _unapplied_for(job, now):
    """Seconds the job's pending batch change has waited for its learners (0 if there is none)."""
    row = elastic_timeline.pending_batch_change(job)
    return (now - row.resize_requested_at).total_seconds() if row is not None else 0.0


def _held_gpus(active):
    """{(node, gpu id): job id} of every GPU the jobs hold."""
    return {(p["node"], gpu): job.id for job in active for p in job.placement for gpu in p["gpu_ids"]}


def _gpus_released_since(moment):
    """Whether an attempt gave GPUs back after `moment` (its usage record closed then)."""
    return UsageRecord.objects.filter(ended_at__gt=moment, gpus__gt=0).exists()


def _reserved_for_queue(nodes, held, active):
    """{node: idle GPUs kept for queued jobs}: what the queued jobs that wait for capacity (not for
    their tenant's quota or spent hard budget, nor for a cluster that can never hold them) need at
    least (an elastic one its minimum), taken from the idle GPUs, the nodes with the most first. The
    autoscaler never grows onto them, so a queued job is admitted by the next cycle once they are
    enough, rather than waiting for an elastic job to shrink again."""
    need = 0
    used = {}
    for job in active:
        used[job.tenant_id] = used.get(job.tenant_id, 0) + sum(len(p["gpu_ids"]) for p in job.placement)
    tenant_quotas, hosted = {}, {}
    schedulable = [n for n in nodes if n.schedulable]
    for job in Job.objects.filter(status=Status.QUEUED, gpus__gt=0).select_related("tenant").only(
            "id", "tenant", "learners", "gpus", "cpus", "memory_bytes", "runtime"):
        elastic = elasticity.of(job)
        learners = elastic.min_learners if elastic else job.learners
        gpus = learners * job.gpus
        if job.tenant_id not in tenant_quotas:
            tenant_quotas[job.tenant_id] = _startable_quota(job.tenant)
        quota = tenant_quotas[job.tenant_id]
        if quota is False:
            continue  # its tenant's hard budget is spent: nothing of it starts, whatever is idle
        if quota is not None and quota.gpus is not None and not quota.can_borrow \
                and used.get(job.tenant_id, 0) + gpus > quota.gpus:
            continue  # it waits for its tenant's quota, which no grow of another job's takes
        shape = (job.gpus, job.cpus, job.memory_bytes)
        if shape not in hosted:
            per = Resources(*shape)
            hosted[shape] = sum(learners_hosted(n.gpus, n.cpus, n.memory_bytes, per) for n in schedulable)
        if hosted[shape] < learners:
            continue  # the cluster can never hold it: keeping GPUs idle for it would keep them idle for good
        need += gpus
    idle = {n.name: n.gpus - sum(1 for node, _ in held if node == n.name) for n in nodes if n.schedulable}
    reserved = {}
    for node in sorted(idle, key=lambda name: (-idle[name], name)):
        take = min(need, max(0, idle[node]))
        if take:
            reserved[node] = take
            need -= take
    return reserved


def _startable_quota(tenant):
    """The tenant's quota (None: none), or False when its hard budget is spent (admission starts none
    of its jobs then)."""
    quota = quotas.quota_of(tenant)
    if quota is not None and quotas.budget_state(quota, quotas.usage_of(tenant, quota=quota))[0] == "hard_exceeded":
        return False
    return quota


def _tenant_gpus_left(active, mine):
    """tenant slug -> GPUs its elastic candidates may hold in all, for tenants whose GPU quota binds
    them (no borrowing); GPUs its other jobs hold count against it."""
    others, tenants = {}, {}
    for job in active:
        tenants[job.tenant_id] = job.tenant
        if job.id not in mine:
            others[job.tenant_id] = others.get(job.tenant_id, 0) + sum(len(p["gpu_ids"]) for p in job.placement)
    left = {}
    quota_of = {quota.tenant_id: quota for quota in Quota.objects.filter(tenant_id__in=tenants)}  # one read
    for tenant_id, tenant in tenants.items():
        quota = quota_of.get(tenant_id)
        if quota is None or quota.gpus is None or quota.can_borrow:
            continue
        left[tenant.slug] = max(0, quota.gpus - others.get(tenant_id, 0))
    return left


def _over_quota_kept(candidates, gpus_left):
    """The candidates, those of a tenant already past its GPU quota held at their size (frozen): its
    quota was lowered, or borrowing turned off, since they grew. `gpus_left` is raised to what they
    hold, so the plan fits: one tenant's overrun must not leave every tenant without a plan."""
    kept = []
    for tenant, left in gpus_left.items():
        theirs = [c for c in candidates if c.job.tenant.slug == tenant]
        holding = _holds([c.job for c in theirs], "gpus")
        if holding > left:
            gpus_left[tenant] = holding
            kept += [c.job.id for c in theirs]
    return [replace(c, frozen=True) if c.job.id in kept else c for c in candidates]


def _grow_caps(candidates, active, nodes):
    """{job id: the most learners it may grow to, or None}: a grow adds learners as an admission does,
    so it keeps what admission keeps beside GPUs: no grow once a hard budget is spent, the tenant's
    CPU and memory quota (unless it may borrow), its GPUs per user, and the CPUs and memory the
    schedulable nodes have free in all (the optimizer places by GPUs alone). What is left of each is
    shared evenly among the candidates it binds; a cap never asks a shrink."""
    caps = {c.job.id: None for c in candidates}
    schedulable = [n for n in nodes if n.schedulable]
    for resource in ("cpus", "memory_bytes"):
        free = sum(getattr(n, resource) for n in schedulable) - _holds(active, resource)
        _share_out(caps, candidates, free, resource)
    for tenant_id in {c.job.tenant_id for c in candidates}:
        theirs = [c for c in candidates if c.job.tenant_id == tenant_id]
        quota = quotas.quota_of(theirs[0].job.tenant)
        if quota is None:
            continue
        if quotas.budget_state(quota, quotas.usage_of(theirs[0].job.tenant, quota=quota))[0] == "hard_exceeded":
            caps.update({c.job.id: c.job.learners for c in theirs})
            continue
        holding = [job for job in active if job.tenant_id == tenant_id]
        if not quota.can_borrow:
            for resource, limit in (("cpus", quota.cpus), ("memory_bytes", quota.memory_bytes)):
                if limit is not None:
                    _share_out(caps, theirs, limit - _holds(holding, resource), resource)
        if quota.gpus_per_user is not None:
            for owner_id in {c.job.owner_id for c in theirs}:
                left = quota.gpus_per_user - _holds([job for job in holding if job.owner_id == owner_id], "gpus")
                _share_out(caps, [c for c in theirs if c.job.owner_id == owner_id], left, "gpus")
    return caps


def _holds(jobs, resource):
    """How much of `resource` (per learner) these jobs hold: a resize under way holds both shapes."""
    return sum(max(job.learners, len(job.placement)) * getattr(job, resource) for job in jobs)


def _share_out(caps, candidates, left, resource):
    each = max(0, left) / len(candidates)
    for c in candidates:
        per_learner = getattr(c.job, resource)
        if per_learner:
            most = c.job.learners + int(each // per_learner)
            caps[c.job.id] = most if caps[c.job.id] is None else min(caps[c.job.id], most)


def _elastic_job(candidate, now, *, most=None):
    """The optimizer's view of a candidate; `most`: the learners it may have at most (_grow_caps)."""
    job, elastic, current = candidate.job, candidate.elastic, candidate.current
    low, high = (job.learners, job.learners) if candidate.frozen else (elastic.min_learners, max_learners(candidate))
    if most is not None:
        high = max(low, min(high, most))
    batch = (current.global_batch if current else None) or 0
    bounds = elastic.batch or elasticity.BatchBounds(*(_no_batch(elastic, job),) * 3)
    # No noise scale, no measure of what a bigger batch is worth: at most its own, whatever the policy.
    high_batch = bounds.high if candidate.noise_scale is not None else min(bounds.high, max(bounds.base, batch))
    return optimizer.ElasticJob(
        job_id=job.id, tenant=job.tenant.slug, min_learners=low, max_learners=high, gpus_per_learner=job.gpus,
        base_batch=bounds.base, batch_min=bounds.low, batch_max=high_batch, requested_learners=job.learners,
        model=candidate.model, noise_scale=candidate.noise_scale, restart_s=candidate.resize_cost_s,
        live_batch=candidate.live_batch, learners=job.learners,
        batch=batch or bounds.base, placement=tuple(p["node"] for p in job.placement),
        started_s=job.started_at.timestamp() if job.started_at else now.timestamp(),
        order=int(job.created_at.timestamp() * 1_000_000))


def max_learners(candidate):
    """The most learners the pass may give the job: its bound, and twice the largest shape it has
    measured (no grow until it has measured one). A job whose GPUs are mostly idle is not grown: what
    holds it back (its input, its host) is not what more GPUs give, and they would idle too."""
    if not candidate.largest_measured:
        return candidate.job.learners
    if candidate.gpu_use is not None and candidate.gpu_use < settings.ELASTIC_GROW_MIN_GPU_USE:
        return candidate.job.learners
    return max(candidate.job.learners,
               min(candidate.elastic.max_learners, GROWTH_PAST_MEASURED * candidate.largest_measured))


def _no_batch(elastic, job):
    """A job that declares no batch size changes only its learners: any batch every count divides."""
    return elastic.max_learners * job.gpus * 64


# --- 2. measure -------------------------------------------------------------------------------------
def _current_rate(job, current):
    """Samples per second at the shape the job runs at now (its attempt, since its last batch change)
    from learner 0's `samples` reports, or None."""
    since = current.started_at if current is not None and current.kind == Allocation.Kind.BATCH else None
    return _reported_rate(job.id, job.attempt, since=since)


def _stretch_rate(row):
    """Samples per second of a finished stretch, between learner 0's first and last `samples` reports
    in it, or None. Not the row's samples_per_s, which runs from every learner started: what the
    learners do before their first step (imports, loading data) is the cost of the change that
    started them, and would make a short stretch look slow whatever its shape."""
    return _reported_rate(row.job_id, row.attempt, since=row.started_at, until=row.ended_at)


def _measured_stretches(job):
    """(row, samples/s) of each of the job's rows that ran and ended at a measured rate (not a batch
    change withdrawn before it was applied)."""
    rows = Allocation.objects.filter(job=job, started_at__isnull=False, ended_at__isnull=False)
    return [(row, rate) for row in rows if (rate := _stretch_rate(row))]


def _reported_rate(job_id, attempt, *, since=None, until=None):
    span = elastic_timeline.samples_reported(job_id, attempt, since=since, until=until)
    if span["first"] is None or span["last"] <= span["first"] or span["high"] <= span["low"]:
        return None
    rate = (span["high"] - span["low"]) / (span["last"] - span["first"]).total_seconds()
    return rate if math.isfinite(rate) else None


def measured_noise_scale(job):
    """The job's gradient noise scale (samples): the median of its latest NOISE_SCALE_REPORTS
    `noise_scale` reports over all its attempts (it is a property of where training is, not of the
    shape), re-read each pass as training goes; None if it reports none."""
    values = list(MetricPoint.objects.filter(job=job, name=NOISE_SCALE_METRIC, value__gt=0)
                  .order_by("-id").values_list("value", flat=True)[:NOISE_SCALE_REPORTS])
    return statistics.median(values) if values else None


def measured_gpu_use(job):
    """The share (0-1) of the current attempt's GPUs its learners kept busy over their latest
    GPU_USE_SAMPLES resource samples each (learner_agent.telemetry; `gpus_busy` is a sample's
    utilisations summed, as GPUs); None before any sample has read a GPU."""
    if not job.gpus:
        return None
    busy = list(ResourceSample.objects.filter(job=job, attempt=job.attempt, gpus_busy__isnull=False)
                .order_by("-id").values_list("gpus_busy", flat=True)[:GPU_USE_SAMPLES * job.learners])
    return sum(busy) / len(busy) / job.gpus if busy else None


def _observation(learners, gpus_per_learner, nodes, global_batch, rate):
    gpus = learners * gpus_per_learner
    return gpus, max(1, nodes), global_batch / gpus, global_batch / rate


def _model(job, current, rate, stretches):
    """The job's throughput model: its measured shapes (`stretches`: (finished row, its rate)), pulled
    toward a prior scaled to its speed."""
    observations = []
    for row, measured in stretches:
        if row.global_batch is not None:
            nodes = len({p["node"] for p in row.placement if isinstance(p, dict)})
            observations.append(_observation(row.learners, row.gpus_per_learner, nodes, row.global_batch, measured))
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
    restarts = Allocation.objects.exclude(kind=Allocation.Kind.BATCH)  # a batch change's cost is no restart's
    for rows in (restarts.filter(job=job), restarts):
        measured = list(rows.filter(resize_cost_s__isnull=False).order_by("-id")
                        .values_list("resize_cost_s", flat=True)[:10])
        if measured:
            return sum(measured) / len(measured)
    return settings.ELASTIC_RESIZE_COST_S


# --- 3. decide --------------------------------------------------------------------------------------
def predicted_rate(candidate, learners, batch):
    gpus = learners * candidate.job.gpus
    return candidate.model.throughput(gpus, 1, batch or candidate.job.gpus * learners)


def statistical_efficiency(candidate, batch):
    """Useful fraction of a sample at `batch` against the job's own batch (1 without a noise scale)."""
    base = candidate.elastic.batch.base if candidate.elastic.batch else None
    if not batch or not base:
        return 1.0
    return throughput.efficiency(batch, base, candidate.noise_scale)


def predicted_gain_s(candidate, target):
    """Seconds of the job's present progress gained over the horizon by moving to `target`, less what
    the restart costs: (new goodput / goodput now - 1) x horizon - resize cost, goodput being samples/s
    x statistical efficiency (so a bigger batch that trains faster but learns less per sample is no gain)."""
    job = candidate.job
    now_batch = candidate.current.global_batch if candidate.current else None
    rate_now = candidate.rate or predicted_rate(candidate, job.learners, now_batch)
    shape = elasticity.shape(candidate.elastic, target.learners, target.batch or now_batch)
    rate_new = predicted_rate(candidate, target.learners, shape.global_batch)
    if not rate_now:
        return 0.0
    gain = (rate_new * statistical_efficiency(candidate, shape.global_batch)) / (
        rate_now * statistical_efficiency(candidate, now_batch))
    if _changes_live(candidate, target):
        return (gain - 1 - LIVE_BATCH_MIN_GAIN) * settings.ELASTIC_HORIZON_S
    return (gain - 1) * settings.ELASTIC_HORIZON_S - candidate.resize_cost_s


def _batch_changes(candidate, target):
    """Whether the target keeps the learners but changes the global batch (the job's noise scale has
    moved): inside the running learners when they apply batch changes (_changes_live), else as a
    resize at the same size, through the checkpoint, and then only upwards: a smaller batch alone (a
    small noise scale) waits for the next change of learners rather than cost a restart of its own.
    Not while a change is on its way, nor through a restart for a job held at its size."""
    current = candidate.current.global_batch if candidate.current else None
    held = candidate.batch_pending or (candidate.frozen and not candidate.live_batch)
    if held or candidate.elastic.batch is None or not current or not target.batch:
        return False
    batch = elasticity.shape(candidate.elastic, target.learners, target.batch).global_batch
    return batch != current if candidate.live_batch else batch > current


def _changes_live(candidate, target):
    """Whether moving to `target` is a batch change inside the running learners (no restart)."""
    return candidate.live_batch and target.learners == candidate.job.learners


# --- 4. act -----------------------------------------------------------------------------------------
def _carry_out(candidates, changes, held, node_gpus):
    rows = []
    ordered = sorted((c for c in candidates if c.job.id in changes),
                     key=lambda c: changes[c.job.id].learners - c.job.learners)  # shrinks first
    for candidate in ordered:
        job, target = candidate.job, changes[candidate.job.id]
        placement = _placement(job, target, held, node_gpus)
        same_size = target.learners == job.learners
        if len(placement) == job.learners and not same_size:
            continue  # a grow with no idle GPU on the planned nodes yet
        why = ("its measured gradient noise scale" if same_size else
               "idle GPUs" if len(placement) > job.learners else "GPUs for other elastic jobs")
        if _changes_live(candidate, target):
            row = lifecycle.change_batch(job, wanted_batch=target.batch, why=why, actor=ACTOR)
            if row is not None:
                rows.append(row)
            continue
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

