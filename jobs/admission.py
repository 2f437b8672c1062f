"""Admission: feed the queue, the running jobs, the tenants' quotas and the backend's capacity into
gpu_scheduler's pure core, then carry out what it decides — admit (QUEUED → PENDING, deploy),
preempt (halt through the checkpoint, then back to QUEUED), or say why a job waits.

The scheduling loop (jobs.scheduler_loop) runs the cycles, in one process at a time. A cycle is one
transaction that holds the cluster-wide admission lock while it reads and decides, so two cycles
racing (a leader standing down late and the one taking over, a test's or a script's own) run one
after the other and the second sees the first's admissions: quotas hold whatever the interleaving.
The autoscaler's pass takes the same lock. This is the one lock of the cycle. On PostgreSQL it is a
transaction-scoped advisory lock (freed by the commit, or by the server when a killed process's
connection drops). On SQLite every transaction begins IMMEDIATE (portal/settings.py), which takes
the database's single write lock at BEGIN: the cycle's transaction is then the only writer from its
first read to its commit, the same serialisation, and likewise freed when the process dies.
"""
import dataclasses
import logging
import time

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

import gpu_scheduler as scheduler
from gpu_scheduler.reasons import job_seen_by, position_prefix, split_position
from jobs import lifecycle, prometheus_series
from jobs.backends import get_backend
from jobs.models import ACTIVE, AT_REST, FollowUp, Job, Status
from jobs.states import transition
from tenants import quotas
from tenants.models import Tenant
from trainyard import elasticity

log = logging.getLogger(__name__)
ACTOR = "scheduler"
ADMISSION_LOCK_KEY = 0x7472_6169  # any constant shared by every Trainyard process ("trai")
NO_LIMIT_GPUS = 10**9
NO_LIMIT_BYTES = 2**62
# Wait reasons per UPDATE on PostgreSQL: a VALUES list of this many rows stays well under its
# statement limits and plans quickly.
WAIT_REASON_BATCH = 500
# The places in a tenant queue written as they change; behind them, positions refresh on an interval
# (_reasons_to_write).
QUEUE_HEAD = 20
POSITIONS_REFRESHED_KEY = "admission:positions-refreshed"
# What a cycle reads of every queued and active job: whole rows (the manifest as sent and as parsed)
# and an owner object per job made building the rows most of a cycle's own time.
CYCLE_FIELDS = ("id", "tenant_id", "status", "attempt", "learners", "gpus", "cpus", "memory_bytes", "priority",
                "placement", "preempted_reason", "wait_reason", "created_at", "updated_at", "admitted_at", "private")


def run_cycle():
    """One scheduling cycle; returns the ids of the jobs it admitted."""
    started = time.perf_counter()
    nodes = tuple(get_backend().capacity().nodes)  # before the lock: may be a network call
    with transaction.atomic():
        take_admission_lock()
        queued = list(_cycle_rows(Job.objects.filter(status=Status.QUEUED).order_by("created_at")))
        if not queued:
            return []  # not timed: idle cycles (the loop's periodic ones) would drown the ones that decide
        running = list(_cycle_rows(Job.objects.filter(status__in=ACTIVE))) + list(_cycle_rows(being_torn_down()))
        tenants = _policies({job.tenant_id for job in queued + running})
        # As a subquery: Django compiles a list of every queued and active id slowly into the statement.
        attained = quotas.earlier_gpu_seconds(Job.objects.filter(status__in=(Status.QUEUED, *ACTIVE)).values("id"))
        snapshot = scheduler.Snapshot(nodes=nodes, tenants={p.name: p for p in tenants.values()},
                                      running=_holding_what_nodes_have(
                                          [_workload(job, tenants, attained) for job in running], nodes),
                                      now=timezone.now().timestamp())
        queue = [_workload(job, tenants, attained) for job in queued]
        yielding = _yielding(running)
        if yielding:
            decisions, shrinks = _schedule_with_yielding(snapshot, queue, yielding)
        else:
            decisions, shrinks = scheduler.schedule(snapshot, queue, _policy()), {}
        by_id = {job.id: job for job in queued + running}
        for job_id, (placement, why) in shrinks.items():
            _shrink(by_id[job_id], placement, why)
        for job_id, reason in decisions.preempt.items():
            _preempt(by_id[job_id], reason, tenant=tenants[by_id[job_id].tenant_id].name)
        admitted = [job_id for job_id, placement in decisions.admitted.items()
                    if _admit(by_id[job_id], placement, tenant=tenants[by_id[job_id].tenant_id].name)]
        _record_wait_reasons(_reasons_to_write(decisions.waiting, by_id))
    prometheus_series.SCHEDULING_CYCLE.observe(time.perf_counter() - started)
    return admitted


def _holding_what_nodes_have(running, nodes):
    """The running workloads, each holding only GPUs its nodes report and no other job holds: a GPU a
    node no longer reports (failed, taken out by its device plugin) or a placement written twice made
    the scheduler refuse the snapshot, and so every cycle, for every tenant, until that job ended.
    Such a GPU holds nothing placeable now, and the job keeps the rest; the error names it."""
    gpus = {node.name: node.gpus for node in nodes}
    held, kept = set(), []
    for workload in running:
        placement = []
        for place in workload.placement:
            ids = place.gpu_ids
            if place.node in gpus:  # a node that left the cluster the scheduler passes over itself
                ids = tuple(g for g in ids if 0 <= g < gpus[place.node] and (place.node, g) not in held)
                held.update((place.node, g) for g in ids)
            if ids != place.gpu_ids:
                log.error("job %s holds GPU(s) %s of node %s, which reports %d or another job holds; left out "
                          "of this cycle", workload.job_id, ", ".join(str(g) for g in place.gpu_ids if g not in ids),
                          place.node, gpus[place.node])
                place = scheduler.Placement(place.node, ids)
            placement.append(place)
        placement = tuple(placement)
        kept.append(workload if placement == workload.placement else dataclasses.replace(workload, placement=placement))
    return tuple(kept)


def being_torn_down():
    """Jobs at rest whose teardown is open: their learners may still run (a terminated job's get a
    grace period, then a kill, and the backend confirms them gone), so they keep their GPUs until it
    is done, not to share one with the next tenant's learner (nor be grown onto: jobs.autoscaler). The
    teardown's end wakes the loop."""
    tearing_down = FollowUp.objects.filter(kind=FollowUp.Kind.TEARDOWN, done_at=None).values("job_id")
    return Job.objects.filter(pk__in=tearing_down, status__in=AT_REST).exclude(placement=[])


def _cycle_rows(jobs):
    """The jobs as the cycle reads them: named tuples of CYCLE_FIELDS and the owner's username.
    A model instance per row is a large share of a cycle over a long queue; the one path that needs
    a job's model (a shrink) loads it."""
    # Of the runtime block only its elastic part (null for most jobs): the whole block would be
    # decoded for every row.
    return jobs.annotate(owner_name=F("owner__username"), elastic=F("runtime__elastic")).values_list(
        *CYCLE_FIELDS, "owner_name", "elastic", named=True)


def _elastic(row):
    """elasticity.of for a cycle row, which carries the elastic block and not the whole runtime."""
    return elasticity.Elastic.from_runtime(row.elastic)


def _reasons_to_write(waiting, by_id):
    """The {job id: reason} of `waiting` to write now. A reason begins with the job's place in its
    tenant queue, so one admission changes the reason of every job behind it; as Kueue refreshes
    positions on an interval, a reason whose only change is a position past QUEUE_HEAD is written every
    QUEUE_POSITION_REFRESH_S, anything else (what the job waits for, the head's count-down) at once."""
    now, later = {}, {}
    for job_id, reason in waiting.items():
        written = by_id[job_id].wait_reason
        if written == reason:
            continue
        position, rest = split_position(reason)
        if position is None or position <= QUEUE_HEAD or split_position(written)[1] != rest:
            now[job_id] = reason
        else:
            later[job_id] = reason
    if later and _position_refresh_due():
        now.update(later)
    return now


def _position_refresh_due():
    """True at most once every QUEUE_POSITION_REFRESH_S among all of the platform's workers (a cache
    mark that lives that long); True without the cache (positions are then exact, as before)."""
    if not settings.QUEUE_POSITION_REFRESH_S:
        return True
    try:
        return cache.add(POSITIONS_REFRESHED_KEY, 1, timeout=settings.QUEUE_POSITION_REFRESH_S)
    except Exception as exc:  # noqa: BLE001 - exact positions cost time, never correctness
        log.warning("could not reach the cache for the queue positions' refresh (%s); writing them all", exc)
        return True


def _record_wait_reasons(reasons):
    """Write {job id: why it waits} in a few statements. A reason names the job's place in its
    queue, so one admission changes the reason of every job behind it: one UPDATE per job made a
    cycle over a long queue take seconds, holding the admission lock throughout, and so did an ORM
    CASE of many branches (Django compiles each branch). Plain SQL; only jobs still QUEUED are
    touched (a user may have terminated one meanwhile)."""
    changed = list(reasons.items())
    table = Job._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            # In-process SQLite has no round trips to save.
            cursor.executemany(f"UPDATE {table} SET wait_reason = %s WHERE id = %s AND status = %s",
                               [(reason, job_id, Status.QUEUED.value) for job_id, reason in changed])
            return
        for start in range(0, len(changed), WAIT_REASON_BATCH):
            batch = changed[start:start + WAIT_REASON_BATCH]
            rows = ", ".join(["(%s, %s)"] * len(batch))
            # A join with the batch's VALUES (hashed or by primary key), not a subquery per row that
            # searches the whole batch.
            cursor.execute(
                f"UPDATE {table} SET wait_reason = reason.text FROM (VALUES {rows}) AS reason(id, text) "
                f"WHERE {table}.id = reason.id AND {table}.status = %s",
                [value for pair in batch for value in pair] + [Status.QUEUED.value])


def _policy():
    hours = settings.SERVICE_LEVEL_GPU_HOURS
    return dataclasses.replace(scheduler.Policy.full(), service_levels=(hours * 3600.0,) if hours else ())


def take_admission_lock():
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADMISSION_LOCK_KEY])


def _policies(tenant_ids):
    """The scheduler's view of each tenant: its quota, whether its budget is spent, and its recent
    attained service (GPU- and CPU-seconds held, decayed: tenants.quotas.recent_service), which breaks
    ties between tenants so that one tenant's long backlog cannot starve another's jobs."""
    now = timezone.now()
    recent = quotas.recent_service(tenant_ids, now, settings.FAIR_SHARE_HALF_LIFE_S)
    policies = {}
    for tenant in Tenant.objects.filter(pk__in=tenant_ids):
        gpu_s, cpu_s = recent.get(tenant.pk, (0.0, 0.0))
        service = {"recent_gpu_s": gpu_s, "recent_cpu_s": cpu_s}
        try:
            policies[tenant.pk] = _tenant_policy(tenant, quotas.quota_of(tenant), now, service)
        except scheduler.SchedulingInputError as exc:
            # A quota the scheduler cannot take (written past the model's checks) holds back its
            # own tenant's jobs, with the reason, never the cycle that admits every tenant's.
            log.error("tenant %s: its quota cannot be used: %s", tenant.slug, exc)
            policies[tenant.pk] = scheduler.TenantPolicy(
                tenant.slug, budget="hard_exceeded",
                budget_reason=f"the tenant's quota cannot be used ({exc}); a platform admin must correct it", **service)
    return policies


def _tenant_policy(tenant, quota, now, service):
    if quota is None:
        return scheduler.TenantPolicy(tenant.slug, **service)
    budget, reason = quotas.budget_state(quota, quotas.usage_of(tenant, now, quota))
    limited = any(v is not None for v in (quota.gpus, quota.cpus, quota.memory_bytes))
    nominal = scheduler.Resources(
        gpus=NO_LIMIT_GPUS if quota.gpus is None else quota.gpus,
        cpus=float("inf") if quota.cpus is None else quota.cpus,
        memory_bytes=NO_LIMIT_BYTES if quota.memory_bytes is None else quota.memory_bytes) if limited else None
    return scheduler.TenantPolicy(
        tenant.slug, quota=nominal, max_jobs=quota.jobs, max_gpus_per_user=quota.gpus_per_user,
        can_borrow=quota.can_borrow, budget=budget, budget_reason=reason, **service)


def _workload(job, tenants, attained):
    elastic = _elastic(job)
    return scheduler.Workload(
        job_id=job.id, tenant=tenants[job.tenant_id].name, user=job.owner_name,
        # A resize under way holds the GPUs of both shapes (jobs.lifecycle.resize).
        learners=max(job.learners, len(job.placement)),
        min_learners=elastic.min_learners if elastic and job.status == Status.QUEUED else 0,
        per_learner=scheduler.Resources(job.gpus, job.cpus, job.memory_bytes), priority=job.priority,
        order=int(job.created_at.timestamp() * 1_000_000),
        placement=tuple(scheduler.Placement(p["node"], tuple(p["gpu_ids"])) for p in job.placement),
        stopping=job.status == Status.HALTING or job.status in AT_REST or bool(job.preempted_reason),
        started=job.admitted_at.timestamp() if job.admitted_at else 0.0,
        # A queued job's last transition put it in the queue (wait-reason updates leave updated_at alone).
        queued_at=job.updated_at.timestamp() if job.status == Status.QUEUED else None,
        attained_gpu_s=attained.get(job.id, 0.0), private=job.private)


def _admit(job, placement, *, tenant):
    """QUEUED → PENDING; the transition writes the attempt's deploy (jobs.outbox). An elastic job
    whose start size did not fit is admitted with fewer learners (the scheduler's placement says how many)."""
    queued_since = job.updated_at  # a queued job's last transition put it in the queue
    reason = "admitted"
    if len(placement) != job.learners:
        reason = f"admitted with {len(placement)} of its {job.learners} learners (the rest did not fit; it grows " \
                 "when GPUs are idle)"
    moved = transition(job.id, Status.PENDING, actor=ACTOR, reason=reason, attempt=job.attempt,
                       placement=[{"node": p.node, "gpu_ids": list(p.gpu_ids)} for p in placement], wait_reason="",
                       learners=len(placement))
    if moved is not None:
        prometheus_series.admitted(tenant, queued_since)
    return moved is not None


# --- elastic jobs make room before anyone is preempted ------------------------------------------
def _yielding(running):
    """{job id: min learners} of the running elastic jobs that hold GPUs beyond their minimum: those
    GPUs were idle when they grew onto them, and they give them back (a shrink, not a halt) to
    queued work before any job of a fixed size is preempted."""
    yielding = {}
    for job in running:
        elastic = _elastic(job)
        if (elastic and job.gpus and job.status == Status.PROCESSING and not job.preempted_reason
                and len(job.placement) > elastic.min_learners):
            yielding[job.id] = elastic.min_learners
    return yielding


def _schedule_with_yielding(snapshot, queue, yielding):
    """Two passes: first admit what fits as things are (no one disturbed); then schedule the rest
    as if the yielding elastic jobs held only their minimum. A job the second pass places on GPUs
    an elastic job holds beyond its minimum waits while that job shrinks to the learners it keeps;
    preemption (of any job) is only chosen when even that is not room enough.
    Returns (decisions, {elastic job id: (placement it keeps, why)})."""
    # Nodes held for a job that waited long stay held in the first pass too: backfilling them there
    # would let later jobs take, while any elastic job could shrink, what the hold keeps for it.
    calm = dataclasses.replace(_policy(), preemption=False, consolidate=False)
    first = scheduler.schedule(snapshot, queue, calm)
    rest = [w for w in queue if w.job_id not in first.admitted]
    if not rest:
        return first, {}
    placed = [dataclasses.replace(w, placement=tuple(first.admitted[w.job_id]), min_learners=0,
                                  learners=len(first.admitted[w.job_id]), queued_at=None)
              for w in queue if w.job_id in first.admitted]
    running = {w.job_id: w for w in snapshot.running}
    # A trimmed job is a whole job at its minimum: still a victim of reclaim and of priority, as it
    # would be had it never grown (a job placed short of its learners is never one).
    trimmed = [dataclasses.replace(w, placement=w.placement[:keep], learners=keep)
               if (keep := yielding.get(w.job_id)) is not None else w for w in snapshot.running]
    second = scheduler.schedule(dataclasses.replace(snapshot, running=tuple(trimmed + placed)), rest, _policy())
    lent = {(p.node, gpu): job_id for job_id, keep in yielding.items()
            for p in running[job_id].placement[keep:] for gpu in p.gpu_ids}
    decisions = scheduler.Decisions(admitted=dict(first.admitted), preempt=dict(second.preempt),
                                    waiting=dict(second.waiting), position={**first.position, **second.position})
    taken = {}  # elastic job id -> GPUs (node, id) it gives back
    for job_id, placement in second.admitted.items():
        gpus = {(p.node, gpu) for p in placement for gpu in p.gpu_ids}
        lenders = {lent[g] for g in gpus if g in lent}
        if not lenders:
            decisions.admitted[job_id] = placement
            continue
        queued = next(w for w in rest if w.job_id == job_id)
        for lender in lenders:
            taken.setdefault(lender, (set(), queued))[0].update(g for g in gpus if lent.get(g) == lender)
        names = ", ".join(sorted(job_seen_by(queued.tenant, running[lender]) for lender in lenders))
        decisions.waiting[job_id] = (f"{position_prefix(second.position.get(job_id, 1))}for elastic {names} to "
                                     "shrink and make room")
    shrinks = {}
    for lender, (gpus, queued) in taken.items():
        if lender in decisions.preempt:
            continue  # halted whole: it frees its GPUs without a resize
        keep = tuple(p for p in running[lender].placement if not any((p.node, g) in gpus for g in p.gpu_ids))
        why = f"making room for {job_seen_by(running[lender].tenant, queued)}"
        shrinks[lender] = ([{"node": p.node, "gpu_ids": list(p.gpu_ids)} for p in keep], why)
    return decisions, shrinks


def _shrink(row, placement, why):
    """Resize an elastic job down to the learners it keeps (jobs.lifecycle.resize)."""
    lifecycle.resize(Job.objects.get(pk=row.id), learners=len(placement), placement=placement, why=why, actor=ACTOR)


def _preempt(job, reason, *, tenant):
    """Halt a running job through its checkpoint to make room; it is queued again once halted. The
    transition writes the halt (jobs.outbox)."""
    moved = transition(job.id, Status.HALTING, actor=ACTOR, reason=f"preempted: {reason}", attempt=job.attempt,
                       preempted_reason=reason)
    if moved:
        prometheus_series.preempted(tenant)
        log.info("%s: preempted (%s)", job.id, reason)


def used_resources():
    """{node: {gpus, cpus, memory_bytes, gpu_ids}} held by the learners of active jobs and of ended
    ones whose teardown is open (being_torn_down): what the cluster view shows as free is what the
    scheduler would give the next job."""
    used = {}
    holding = Job.objects.filter(Q(status__in=ACTIVE) | Q(pk__in=being_torn_down().values("pk")))
    for job in holding.only("placement", "cpus", "memory_bytes"):
        for learner in job.placement:
            node = used.setdefault(learner["node"], {"gpus": 0, "cpus": 0.0, "memory_bytes": 0, "gpu_ids": set()})
            node["gpus"] += len(learner["gpu_ids"])
            node["cpus"] += job.cpus
            node["memory_bytes"] += job.memory_bytes
            node["gpu_ids"].update(learner["gpu_ids"])
    return used
