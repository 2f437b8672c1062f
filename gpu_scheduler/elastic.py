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
  that has run long will likely run on), so a resize happens only when it pays for its restart (a
  batch change at its learner count is no restart for a job whose learners change it live). A
  job that reports no gradient noise scale has no statistical efficiency to go by: its global batch
  is never raised past its own (it scales GPUs only, as under `gpu_only`).
"""
import functools
import heapq
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
    live_batch: bool = False  # its batch changes inside its running learners: no restart at its learner count
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
def batch_max(job, policy):
    """The largest global batch the policy may give the job. Under `trainyard` a job without a noise
    scale has no measure of what a bigger batch is worth (its efficiency would read 1, so throughput
    alone would pick the largest batch allowed: the harm of the paper's policy); it keeps at most its own."""
    if policy.name == "trainyard" and job.noise_scale is None:
        return min(job.batch_max, max(job.base_batch, job.batch_min))
    return job.batch_max


def batch_choices(job, learners, policy):
    """Global batches the policy may give the job at this learner count."""
    return _batch_choices(policy.name, policy.batch_steps, job.base_batch, job.batch_min, batch_max(job, policy),
                          learners * job.gpus_per_learner, job.max_local_batch)


@functools.lru_cache(maxsize=100_000)
def _batch_choices(policy_name, steps, base, low, high, gpus, max_local):
    return tuple(sorted(b for b in _batch_candidates(policy_name, steps, base, low, high)
                        if gpus <= b <= gpus * max_local))


def _batch_candidates(policy_name, steps, base, low, high):
    """The job's own batch, or for a policy that scales batches powers of two around it, clipped to its bounds."""
    if policy_name in ("fixed", "gpu_only"):
        return {base}
    return {min(max(int(round(base * 2.0**k)), low), high) for k in range(-steps, steps + 1)}


def rate(job, learners, batch, policy, gpus_per_node):
    """What the policy maximises per job: throughput (paper, gpu_only) or goodput (trainyard)."""
    gpus = learners * job.gpus_per_learner
    nodes = nodes_spanned(gpus, max(gpus_per_node, job.gpus_per_learner))
    noise = job.noise_scale if policy.name == "trainyard" else None
    return goodput(job.model, gpus, nodes, batch, job.base_batch, noise)


def best_batch(job, learners, policy, gpus_per_node, now=0.0):
    """(rate, batch) of the best batch at this learner count; (0, 0) if none is allowed. Under
    trainyard, any shape but a running job's current one is discounted by its restart (at its current
    learners, none is when it changes its batch live)."""
    best = _best_batch(job.model, job.noise_scale if policy.name == "trainyard" else None, job.base_batch,
                       batch_choices(job, learners, policy), learners * job.gpus_per_learner,
                       max(gpus_per_node, job.gpus_per_learner))
    if not (job.running and policy.name == "trainyard") or (job.live_batch and learners == job.learners):
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


def options(job, policy, gpus_per_node, now=0.0):
    """[(gpus, value, learners, batch)] for the DP; includes (0, ...) only for a job not running."""
    if job.running:
        return job_options(job, policy, gpus_per_node, now)
    # A waiting job's options depend only on its shape, and many jobs share one (same model, bounds).
    return list(shape_options(policy, gpus_per_node, job.model, job.noise_scale, job.base_batch, job.batch_min,
                              batch_max(job, policy), job.max_local_batch, job.gpus_per_learner, job.min_learners,
                              job.max_learners))


@functools.lru_cache(maxsize=10_000)
def shape_options(policy, gpus_per_node, model, noise_scale, base, low, high, max_local, per, lo, hi):
    shape = ElasticJob("", "", lo, hi, per, base, low, high, max_local_batch=max_local, model=model,
                       noise_scale=noise_scale)
    return tuple(job_options(shape, policy, gpus_per_node))


def job_options(job, policy, gpus_per_node, now=0.0):
    """`options` for a scaling policy (`fixed` needs none), as arrays: every learner count's best rate
    (one cached table per job state), a running job's restart discount and current shape, the policy's
    value of the speedup, and only options worth more than every smaller one (sizes grow with the
    learner count, so a running maximum): the DP never needs the others."""
    base_rate = reference_rate(job, gpus_per_node)
    noise = job.noise_scale if policy.name == "trainyard" else None
    counts, rates, batches = rate_table(policy.name, policy.batch_steps, job.model, noise, job.base_batch,
                                        job.batch_min, batch_max(job, policy), job.max_local_batch,
                                        job.gpus_per_learner, job.min_learners, job.max_learners, gpus_per_node)
    if job.running and policy.name == "trainyard":
        index = job.learners - job.min_learners
        undiscounted = rates[index] if job.live_batch and 0 <= index < len(counts) else None
        rates = rates * restart_discount(job, policy, now)
        if undiscounted is not None:  # its best batch at its learners is no restart away
            rates[index] = undiscounted
        if job.batch and 0 <= index < len(counts):
            current = rate(job, job.learners, job.batch, policy, gpus_per_node)
            if current >= rates[index]:
                rates, batches = rates.copy(), batches.copy()
                rates[index], batches[index] = current, job.batch
    if base_rate <= 0:
        counts = counts[:0]
    keep = batches > 0
    counts, batches, speedups = counts[keep], batches[keep], rates[keep] / base_rate if base_rate > 0 else rates[:0]
    values = -1.0 / np.maximum(speedups, 1e-9) if policy.name == "trainyard" else speedups
    sizes = counts * job.gpus_per_learner
    if not job.running:
        sizes, values = np.concatenate(([0], sizes)), np.concatenate(([waiting_value(policy)], values))
        counts, batches = np.concatenate(([0], counts)), np.concatenate(([0], batches))
    best_before = np.maximum.accumulate(np.concatenate(([NEG], values)))[:-1]
    kept = np.flatnonzero(values > best_before)
    result = list(zip(sizes[kept].tolist(), values[kept].astype(float).tolist(), counts[kept].tolist(),
                      batches[kept].tolist()))
    if job.running and not result:  # nothing allowed: keep what it has
        result.append((job.learners * job.gpus_per_learner, 0.0, job.learners, job.batch))
    return result


@functools.lru_cache(maxsize=20_000)
def rate_table(policy_name, steps, model, noise, base, low, high, max_local, per, lo, hi, gpus_per_node):
    """Arrays (learner counts, best rate, its batch) for learners lo..hi, as `_best_batch` computes them one
    count at a time: the same arithmetic in the same order, so the same floats; the first of equal
    rates wins (argmax), and a count with no allowed batch gets (0.0, 0)."""
    counts = np.arange(lo, hi + 1)
    gpus = counts.astype(float)[:, None] * per
    gpn = max(gpus_per_node, per)
    nodes = np.maximum(1, np.ceil(gpus / gpn))
    batch = np.array(sorted(_batch_candidates(policy_name, steps, base, low, high)), dtype=float)[None, :]
    allowed = (gpus <= batch) & (batch <= gpus * max_local)
    extra = np.maximum(0.0, gpus - 2)
    comm = np.where(nodes > 1, model.e + model.f * extra, np.where(gpus > 1, model.c + model.d * extra, 0.0))
    step = (model.a + model.b * (batch / gpus)) + comm
    with np.errstate(divide="ignore", invalid="ignore"):
        value = batch / step
        if noise is not None:
            value = value * ((noise + base) / (noise + batch))
    value = np.where(allowed & (value > 0), value, 0.0)
    if len(counts) == 0:
        return counts, np.zeros(0), np.zeros(0, dtype=int)
    best = value.argmax(axis=1)
    rates = value[np.arange(len(counts)), best]
    batches = np.where(rates > 0, batch[0, best], 0).astype(int)
    for array in (counts, rates, batches):
        array.flags.writeable = False  # cached: shared by every caller
    return counts, rates, batches


def reference_rate(job, gpus_per_node):
    """The rate speedups are relative to: the job at its minimum learners with its own batch."""
    return rate(job, job.min_learners, job.base_batch, ElasticPolicy("gpu_only"), gpus_per_node)


def waiting_value(policy):
    return -1.0 / policy.waiting_speedup if policy.name == "trainyard" else 0.0


# --- 2. allocation (the DP) ---------------------------------------------------------------------------
def knapsack(option_lists, capacity, *, only_at=None):
    """Maximise the sum of one chosen option's value per item, total size <= capacity.
    option_lists: per item [(size, value)]. Returns (table, steps): table[k] = best value within k
    (NEG if infeasible); steps[j] = (the table of the items before j, item j's sizes and values), what
    `backtrack` reads. With `only_at`, only table[only_at] is right (and `backtrack` from it).

    Each item is one max-plus step, table[k] = max_i before[k - size_i] + value_i, done as one 2-D
    array (budgets x options) read from a sliding window over the previous table; which option wins is
    left to `backtrack`, which asks only at the budgets it visits. Budgets skipped: past the sum of the
    items' largest sizes so far (every option reads the previous table where it is flat, so the last
    value repeats) and, with `only_at`, below only_at minus the later items' largest sizes (no
    solution within only_at passes there)."""
    arrays = [option_arrays(opts) for opts in option_lists]
    largest = [int(sizes.max()) for sizes, _ in arrays]
    lows, later = [], 0
    for big in reversed(largest):
        lows.append(0 if only_at is None else max(0, min(only_at, capacity) - later))
        later += big
    table = np.zeros(capacity + 1)  # -inf inside (infeasible); NEG in the result
    steps, reach = [], 0
    for (sizes, values), big, low in zip(arrays, largest, reversed(lows)):
        steps.append((table, sizes, values))
        reach = min(capacity, reach + big)
        start = min(low, reach)
        if start >= big:
            padded = table[start - big:reach + 1]
        else:
            padded = np.concatenate((np.full(big - start, -np.inf), table[:reach + 1]))
        # windows[k - start, t] = table[k - big + t], so column big - size_i is table[k - size_i]
        candidates = sliding_window_view(padded, big + 1)[:, big - sizes]
        candidates += values
        best = candidates.max(axis=1)
        table = np.full(capacity + 1, -np.inf)
        table[start:reach + 1] = best
        table[reach + 1:] = best[-1]
    return np.where(np.isneginf(table), NEG, table), steps


def option_arrays(opts):
    sizes = np.fromiter((o[0] for o in opts), dtype=np.intp, count=len(opts))
    return sizes, np.fromiter((o[1] for o in opts), dtype=float, count=len(opts))


def best_option(step, budget):
    """(value, index) of the option that wins within `budget` at this step of the DP: the first of
    equals, as the step computed it; value -inf if none fits."""
    table, sizes, values = step
    rest = budget - sizes
    candidates = np.where(rest >= 0, table[np.clip(rest, 0, None)] + values, -np.inf)
    index = int(candidates.argmax())
    return candidates[index], index


def backtrack(steps, capacity):
    """Option index per item for the best solution within `capacity`."""
    picked, k = [0] * len(steps), capacity
    for j in range(len(steps) - 1, -1, -1):
        _, picked[j] = best_option(steps[j], k)
        k -= int(steps[j][1][picked[j]])
    return picked


def allocate(job_options, tenant_of, quotas, capacity):
    """{job: option index}: the DP per tenant within its quota, then across tenants within capacity.
    job_options: {job_id: [(gpus, value, ...)]}. Exact for the separable objective (tested against
    brute force)."""
    by_tenant = {}
    for job_id in job_options:
        by_tenant.setdefault(tenant_of[job_id], []).append(job_id)
    tenants = sorted(by_tenant)
    tenant_tables, tenant_steps = [], []
    for tenant in tenants:
        limit = capacity if quotas.get(tenant) is None else min(capacity, quotas[tenant])
        lists = [job_options[j] for j in by_tenant[tenant]]
        table, steps = knapsack(lists, limit)
        tenant_tables.append(table)
        tenant_steps.append(steps)
    # Across tenants: a tenant's "options" are the GPU counts where its table improves. Only the
    # whole capacity is asked for, so each tenant's step skips the budgets no solution within it passes.
    tenant_lists = [[(k, float(t[k])) for k in improving_points(t)] for t in tenant_tables]
    table, steps = knapsack(tenant_lists, capacity, only_at=capacity)
    if table[capacity] <= NEG / 2:
        raise ValueError("elastic: running jobs' minimums do not fit the capacity or quotas they hold")
    picked = backtrack(steps, capacity)
    result = {}
    for tenant, job_steps, tenant_options, index in zip(tenants, tenant_steps, tenant_lists, picked):
        budget = tenant_options[index][0]
        for job_id, option in zip(by_tenant[tenant], backtrack(job_steps, budget)):
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
    free = FreeGPUs(cluster.nodes)
    kept = {}
    for job in jobs:
        keep = list(job.placement[:min(len(job.placement), wanted.get(job.job_id, 0))])
        for node in keep:
            free.take(node, job.gpus_per_learner)
        kept[job.job_id] = keep
    growing = sorted((j for j in jobs if wanted.get(j.job_id, 0) > len(kept[j.job_id])),
                     key=lambda j: (-j.gpus_per_learner, j.order, j.job_id))
    for job in growing:
        extra = place_learners(free, job.gpus_per_learner, wanted[job.job_id] - len(kept[job.job_id]))
        if not job.running and len(kept[job.job_id]) + len(extra) < job.min_learners:
            free.give_back(extra, job.gpus_per_learner)
            extra = []
        kept[job.job_id] += extra
    return {job_id: tuple(nodes) for job_id, nodes in kept.items()}


class FreeGPUs:
    """Free GPUs per node, with the nodes bucketed by how many they have free, so the fullest node
    that fits a learner (fewest free GPUs, then name) is found without scanning every node. A bucket is a
    heap of names; a name whose node has since changed is dropped when it reaches the top."""

    def __init__(self, nodes):
        self.free = dict(nodes)
        self.buckets = {}
        for node, gpus in sorted(self.free.items(), key=lambda item: item[1]):
            self.buckets.setdefault(gpus, []).append(node)
        for bucket in self.buckets.values():
            heapq.heapify(bucket)

    def take(self, node, gpus):
        self.free[node] -= gpus
        heapq.heappush(self.buckets.setdefault(self.free[node], []), node)

    def give_back(self, nodes, gpus):
        for node in nodes:
            self.take(node, -gpus)

    def fullest_fitting(self, gpus):
        """(free GPUs, node) of the fullest node with at least `gpus` free, or None."""
        for count in sorted(c for c in self.buckets if c >= gpus):
            bucket = self.buckets[count]
            while bucket and self.free[bucket[0]] != count:
                heapq.heappop(bucket)
            if bucket:
                return count, bucket[0]
        return None


def place_learners(free, gpus, count):
    """Up to `count` learners of `gpus` GPUs each, each on the fullest node that still fits it. After
    one learner the same node stays the fullest that fits, so it is filled before the next is sought."""
    placed = []
    while len(placed) < count:
        fitting = free.fullest_fitting(gpus)
        if fitting is None:
            break
        here = min(count - len(placed), fitting[0] // gpus)
        free.take(fitting[1], here * gpus)
        placed += [fitting[1]] * here
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
    free = FreeGPUs(cluster.nodes)
    for job in jobs:
        used[job.tenant] = used.get(job.tenant, 0) + job.learners * job.gpus_per_learner
        for node in job.placement:
            free.take(node, job.gpus_per_learner)
    for job in sorted((j for j in jobs if not j.running), key=lambda j: (j.order, j.job_id)):
        need = job.requested_learners * job.gpus_per_learner
        quota = cluster.quotas.get(job.tenant)
        if quota is not None and used.get(job.tenant, 0) + need > quota:
            continue
        placed = place_learners(free, job.gpus_per_learner, job.requested_learners)
        if len(placed) == job.requested_learners:
            used[job.tenant] = used.get(job.tenant, 0) + need
            wanted[job.job_id] = job.requested_learners
        else:
            free.give_back(placed, job.gpus_per_learner)
    return wanted


__all__ = ["POLICIES", "ElasticCluster", "ElasticJob", "ElasticPolicy", "Target", "allocate", "knapsack",
           "optimize"]
