"""The elastic optimizer: how many learners and what global batch each elastic job gets, and where.

One pure call per cycle, `optimize(jobs, cluster, policy, now=...)`, over a snapshot of the elastic
jobs (queued and running) and the GPUs they may use; the platform's autoscaler (issue 13) carries the
plan out, resizing a job through its checkpoint. Steps:

1. Options: for each job, every learner count it may run at (0 = wait, only for a job not running:
   a running job keeps at least its minimum, as the paper's "every admitted job at least its minimum")
   with the best global batch for that count and the policy's value of it.
2. Allocation: the paper's knapsack DP, P[j][k] = max_g value_j(g) + P[j-1][k-g], exact for any
   separable objective; run per tenant within its quota, then across tenants within the cluster.
3. Placement, gang-aware: a learner's GPUs are always on one node; jobs that keep their shape keep
   their nodes; the rest are packed best-fit, largest learners first. A learner that cannot be placed
   (fragmentation) is dropped from its job, down to what the job already holds or its minimum.

Policies (value of a job at g GPUs; speedups are relative to the job at its minimum with its own batch):
- `fixed`: no scaling; each job at its requested learners and batch, first come first served.
- `gpu_only`: the paper's baseline: learners change, the global batch stays the job's own; DP over
  the sum of throughput speedups.
- `paper`: DP over learners and batch size for the sum of throughput speedups.
- `trainyard`: goodput (throughput x statistical efficiency) speedups, combined as Pollux's power
  mean with p = -1 (maximise -sum 1/speedup: a job at a small share costs more than a big job gains),
  a waiting job worth `waiting_speedup`; a change of shape of a running job is discounted by
  horizon / (horizon + restart cost), horizon = time since it started + `min_horizon_s` (a job
  that has run long will likely run on), so a resize happens only when it pays for its restart.
"""
import functools
from dataclasses import dataclass, field

import numpy as np

from gpu_scheduler.throughput import GENERIC_PRIOR, ThroughputModel, goodput, nodes_spanned

POLICIES = ("fixed", "gpu_only", "paper", "trainyard")
NEG = -1e18  # "impossible" in the DP tables


@dataclass(frozen=True)
class ElasticJob:
    job_id: str
    tenant: str
    min_learners: int
    max_learners: int
    gpus_per_learner: int
    base_batch: int  # the job's own global batch (what `fixed` and `gpu_only` keep)
    batch_min: int
    batch_max: int
    requested_learners: int = 1  # what `fixed` gives it
    max_local_batch: int = 10**9  # per GPU (memory)
    model: ThroughputModel = GENERIC_PRIOR
    noise_scale: float | None = None  # gradient noise scale; None = job reports no gradient statistics
    restart_s: float = 60.0  # measured cost of one resize
    learners: int = 0  # current; 0 = not running
    batch: int = 0
    placement: tuple = ()  # current: node name per learner
    started_s: float | None = None  # when it first ran, for the restart horizon
    order: int = 0  # submission order, for `fixed`

    @property
    def running(self):
        return self.learners > 0


@dataclass(frozen=True)
class ElasticCluster:
    nodes: dict  # node name -> GPUs elastic jobs may use (including the ones they hold now)
    quotas: dict = field(default_factory=dict)  # tenant -> GPUs at most; a tenant not listed: unlimited


@dataclass(frozen=True)
class Target:
    learners: int
    batch: int
    placement: tuple  # node name per learner


@dataclass(frozen=True)
class ElasticPolicy:
    name: str = "trainyard"
    waiting_speedup: float = 0.1  # trainyard: what a waiting job counts as (p = -1 needs a finite value)
    min_horizon_s: float = 600.0
    batch_steps: int = 8  # batch sizes tried: base x 2^-steps .. base x 2^steps inside the job's bounds

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"elastic policy must be one of {POLICIES}, got {self.name!r}")


# --- 1. options ---------------------------------------------------------------------------------------
def batch_choices(job, learners, policy):
    """Global batches the policy may give the job at this learner count."""
    return _batch_choices(policy.name, policy.batch_steps, job.base_batch, job.batch_min, job.batch_max,
                          learners * job.gpus_per_learner, job.max_local_batch)


@functools.lru_cache(maxsize=100_000)
def _batch_choices(policy_name, steps, base, low, high, gpus, max_local):
    if policy_name in ("fixed", "gpu_only"):
        candidates = {base}
    else:  # powers of two around the job's own batch, clipped to its bounds
        candidates = {min(max(int(round(base * 2.0**k)), low), high) for k in range(-steps, steps + 1)}
    return tuple(sorted(b for b in candidates if gpus <= b <= gpus * max_local))


def rate(job, learners, batch, policy, gpus_per_node):
    """What the policy maximises per job: throughput (paper, gpu_only) or goodput (trainyard)."""
    gpus = learners * job.gpus_per_learner
    nodes = nodes_spanned(gpus, max(gpus_per_node, job.gpus_per_learner))
    noise = job.noise_scale if policy.name == "trainyard" else None
    return goodput(job.model, gpus, nodes, batch, job.base_batch, noise)


def best_batch(job, learners, policy, gpus_per_node, now=0.0):
    """(rate, batch) of the best batch at this learner count; (0, 0) if none is allowed. Under
    trainyard, any shape but a running job's current one is discounted by its restart."""
    best = _best_batch(job.model, job.noise_scale if policy.name == "trainyard" else None, job.base_batch,
                       batch_choices(job, learners, policy), learners * job.gpus_per_learner,
                       max(gpus_per_node, job.gpus_per_learner))
    if not (job.running and policy.name == "trainyard"):
        return best
    best = (best[0] * restart_discount(job, policy, now), best[1])
    if learners == job.learners and job.batch:
        current = rate(job, learners, job.batch, policy, gpus_per_node)
        if current >= best[0]:
            return current, job.batch
    return best


@functools.lru_cache(maxsize=200_000)
def _best_batch(model, noise, base, batches, gpus, gpus_per_node):
    nodes = nodes_spanned(gpus, gpus_per_node)
    best = (0.0, 0)
    for batch in batches:
        value = goodput(model, gpus, nodes, batch, base, noise)
        if value > best[0]:
            best = (value, batch)
    return best


def restart_discount(job, policy, now):
    """A job that has run long will likely run on (heavy tails), so a restart is amortised over its age."""
    age = 0.0 if job.started_s is None else max(0.0, now - job.started_s)
    horizon = policy.min_horizon_s + age
    return horizon / (horizon + job.restart_s)


def learner_range(job, policy):
    if policy.name == "fixed":
        return [job.learners] if job.running else [job.requested_learners]
    return list(range(job.min_learners, job.max_learners + 1))


def options(job, policy, gpus_per_node, now=0.0):
    """[(gpus, value, learners, batch)] for the DP; includes (0, ...) only for a job not running."""
    base_rate, _ = best_batch_plain(job, policy, gpus_per_node)
    result = [] if job.running else [(0, waiting_value(policy), 0, 0)]
    for learners in learner_range(job, policy):
        value, batch = best_batch(job, learners, policy, gpus_per_node, now)
        if batch and base_rate > 0:
            result.append((learners * job.gpus_per_learner, speedup_value(value / base_rate, policy), learners, batch))
    if job.running and len(result) == 0:  # nothing allowed: keep what it has
        result.append((job.learners * job.gpus_per_learner, 0.0, job.learners, job.batch))
    return undominated(result)


def undominated(opts):
    """Drop options worth no more than a smaller one: the DP never needs them (any plan using one is
    matched by the smaller option with GPUs to spare), and a job whose scaling has flattened then
    offers a handful of options instead of one per learner count (the cost of the DP is linear in them)."""
    kept, best = [], NEG
    for option in sorted(opts, key=lambda o: o[0]):
        if option[1] > best:
            kept.append(option)
            best = option[1]
    return kept


def best_batch_plain(job, policy, gpus_per_node):
    """The reference rate speedups are relative to: the job at its minimum learners with its own batch."""
    learners = job.requested_learners if policy.name == "fixed" else job.min_learners
    neutral = ElasticPolicy("gpu_only")
    return rate(job, learners, job.base_batch, neutral, gpus_per_node), job.base_batch


def waiting_value(policy):
    return -1.0 / policy.waiting_speedup if policy.name == "trainyard" else 0.0


def speedup_value(speedup, policy):
    if policy.name == "trainyard":
        return -1.0 / max(speedup, 1e-9)
    if policy.name == "fixed":
        return 1.0
    return speedup


# --- 2. allocation (the DP) ---------------------------------------------------------------------------
def knapsack(option_lists, capacity):
    """Maximise the sum of one chosen option's value per item, total size <= capacity.
    option_lists: per item [(size, value)]. Returns (table, choices): table[k] = best value within k
    (NEG if infeasible), choices[j][k] = option index of item j in the best solution within k."""
    table = np.zeros(capacity + 1)
    budgets = np.arange(capacity + 1)
    choices = []
    for opts in option_lists:
        sizes = np.array([o[0] for o in opts])[:, None]
        values = np.array([o[1] for o in opts], dtype=float)[:, None]
        rest = budgets[None, :] - sizes  # one row per option: what is left for the items before
        candidates = np.where(rest >= 0, table[np.clip(rest, 0, capacity)] + values, NEG)
        candidates[candidates < NEG / 2] = NEG
        pick = candidates.argmax(axis=0)
        table = candidates[pick, budgets]
        choices.append(pick)
    return table, choices


def backtrack(option_lists, choices, capacity):
    """Option index per item for the best solution within `capacity`."""
    picked, k = [0] * len(option_lists), capacity
    for j in range(len(option_lists) - 1, -1, -1):
        index = int(choices[j][k])
        picked[j] = index
        k -= option_lists[j][index][0]
    return picked


def allocate(job_options, tenant_of, quotas, capacity):
    """{job: option index}: the DP per tenant within its quota, then across tenants within capacity.
    job_options: {job_id: [(gpus, value, ...)]}. Exact for the separable objective (tested against
    brute force)."""
    by_tenant = {}
    for job_id in job_options:
        by_tenant.setdefault(tenant_of[job_id], []).append(job_id)
    tenants = sorted(by_tenant)
    tenant_tables, tenant_choices = [], []
    for tenant in tenants:
        limit = capacity if quotas.get(tenant) is None else min(capacity, quotas[tenant])
        lists = [[o[:2] for o in job_options[j]] for j in by_tenant[tenant]]
        table, choices = knapsack(lists, limit)
        tenant_tables.append(table)
        tenant_choices.append((lists, choices))
    # Across tenants: a tenant's "options" are the GPU counts where its table improves.
    tenant_lists = [[(k, float(t[k])) for k in improving_points(t)] for t in tenant_tables]
    table, choices = knapsack(tenant_lists, capacity)
    if table[capacity] <= NEG / 2:
        raise ValueError("elastic: running jobs' minimums do not fit the capacity or quotas they hold")
    picked = backtrack(tenant_lists, choices, capacity)
    result = {}
    for tenant, (lists, job_choices), tenant_options, index in zip(tenants, tenant_choices, tenant_lists, picked):
        budget = tenant_options[index][0]
        for job_id, option in zip(by_tenant[tenant], backtrack(lists, job_choices, budget)):
            result[job_id] = option
    return result


def improving_points(table):
    """GPU counts k where table[k] beats every smaller k (the only useful budgets to give a tenant)."""
    points, best = [], NEG
    for k, value in enumerate(table):
        if value > best + 1e-12:
            points.append(k)
            best = value
    return points


# --- 3. placement -------------------------------------------------------------------------------------
def place(jobs, wanted, cluster):
    """{job_id: node per learner}. Jobs keep their current learners where they are (up to what they
    want), then the rest are packed best-fit, largest learners first. A job not running gets nothing
    unless its minimum fits; a running job never goes below what it kept."""
    free = dict(cluster.nodes)
    kept = {}
    for job in jobs:
        keep = list(job.placement[:min(len(job.placement), wanted.get(job.job_id, 0))])
        for node in keep:
            free[node] -= job.gpus_per_learner
        kept[job.job_id] = keep
    growing = sorted((j for j in jobs if wanted.get(j.job_id, 0) > len(kept[j.job_id])),
                     key=lambda j: (-j.gpus_per_learner, j.order, j.job_id))
    for job in growing:
        extra = place_learners(free, job.gpus_per_learner, wanted[job.job_id] - len(kept[job.job_id]))
        if not job.running and len(kept[job.job_id]) + len(extra) < job.min_learners:
            for node in extra:
                free[node] += job.gpus_per_learner
            extra = []
        kept[job.job_id] += extra
    return {job_id: tuple(nodes) for job_id, nodes in kept.items()}


def place_learners(free, gpus, count):
    """Up to `count` learners of `gpus` GPUs each, each on the fullest node that still fits it. After
    one learner the same node stays the fullest that fits, so it is filled before the next is sought."""
    placed = []
    while len(placed) < count:
        fitting = [(f, n) for n, f in free.items() if f >= gpus]
        if not fitting:
            break
        _, node = min(fitting)
        here = min(count - len(placed), free[node] // gpus)
        free[node] -= here * gpus
        placed += [node] * here
    return placed


# --- the call -----------------------------------------------------------------------------------------
def optimize(jobs, cluster, policy=ElasticPolicy(), *, now=0.0):
    """{job_id: Target(learners, batch, placement)} for every job (learners 0 = wait / keep waiting)."""
    jobs = list(jobs)
    capacity = sum(cluster.nodes.values())
    gpus_per_node = max(cluster.nodes.values(), default=1)
    if policy.name == "fixed":
        wanted = fixed_allocation(jobs, cluster)
    else:
        job_options = {j.job_id: options(j, policy, gpus_per_node, now) for j in jobs}
        picked = allocate(job_options, {j.job_id: j.tenant for j in jobs}, cluster.quotas, capacity)
        wanted = {j: job_options[j][picked[j]][2] for j in job_options}
    placement = place(jobs, wanted, cluster)
    targets = {}
    for job in jobs:
        nodes = placement[job.job_id]
        learners = len(nodes)
        batch = final_batch(job, learners, policy, gpus_per_node, now)
        targets[job.job_id] = Target(learners, batch, nodes)
    return targets


def final_batch(job, learners, policy, gpus_per_node, now):
    if learners == 0:
        return 0
    if policy.name == "fixed" or (job.running and learners == job.learners and policy.name == "gpu_only"):
        return job.batch or job.base_batch
    return best_batch(job, learners, policy, gpus_per_node, now)[1] or job.base_batch


def fixed_allocation(jobs, cluster):
    """No scaling: running jobs keep their learners; waiting ones start in submission order at their
    requested learners when their tenant's quota and a gang placement allow (smaller ones backfill)."""
    wanted = {j.job_id: j.learners for j in jobs if j.running}
    used = {}
    free = dict(cluster.nodes)
    for job in jobs:
        used[job.tenant] = used.get(job.tenant, 0) + job.learners * job.gpus_per_learner
        for node in job.placement:
            free[node] -= job.gpus_per_learner
    for job in sorted((j for j in jobs if not j.running), key=lambda j: (j.order, j.job_id)):
        need = job.requested_learners * job.gpus_per_learner
        quota = cluster.quotas.get(job.tenant)
        trial = dict(free)
        if (quota is None or used.get(job.tenant, 0) + need <= quota) and \
                len(place_learners(trial, job.gpus_per_learner, job.requested_learners)) == job.requested_learners:
            free = trial
            used[job.tenant] = used.get(job.tenant, 0) + need
            wanted[job.job_id] = job.requested_learners
    return wanted


__all__ = ["POLICIES", "ElasticCluster", "ElasticJob", "ElasticPolicy", "Target", "allocate", "knapsack",
           "optimize"]
