"""Seeded synthetic traces shaped like FfDL's published usage: most jobs have one learner, about
half ask for one GPU, and run times are heavy-tailed (log-normal: many short jobs, a few very long).

The exact mix below is our calibration of that shape, not figures copied from the paper:
- learners: 1 (80%), 2 (10%), 4 (7%), 8 (3%);
- GPUs per learner: 1 (50%), 2 (20%), 4 (18%), 8 (12%);
- run time: log-normal, median 20 minutes, sigma 1.5, clipped to [1 minute, 24 hours];
- priority: high 10%, normal 80%, low 10%;
- tenants submit unequal shares (by default 40/30/20/10%), each with a few users;
- a share of the jobs (`sweep_fraction`, default 30%) comes in hyper-parameter sweeps: one user submits
  5-20 jobs of one shape at the same instant (run times still vary), the bursts that make a shared
  cluster queue;
- submissions (single jobs and whole sweeps) are Poisson at the rate that offers `load` x the
  cluster's GPU capacity.
"""
import math
import random

from bench.simulator.trace import GIB, TraceJob

LEARNERS = ((1, 0.80), (2, 0.10), (4, 0.07), (8, 0.03))
GPUS_PER_LEARNER = ((1, 0.50), (2, 0.20), (4, 0.18), (8, 0.12))
PRIORITIES = (("high", 0.10), ("normal", 0.80), ("low", 0.10))
MEDIAN_DURATION_S = 20 * 60
DURATION_SIGMA = 1.5
DURATION_BOUNDS_S = (60.0, 24 * 3600.0)
SWEEP_SIZE = (5, 20)
SWEEP_MEAN = sum(SWEEP_SIZE) / 2
DEFAULT_TENANT_SHARES = (("team-a", 0.4), ("team-b", 0.3), ("team-c", 0.2), ("team-d", 0.1))


def synthetic_trace(jobs, *, seed, cluster_gpus, load=0.9, tenant_shares=DEFAULT_TENANT_SHARES,
                    users_per_tenant=3, max_job_gpus=None, sweep_fraction=0.3):
    """`jobs` TraceJobs sorted by arrival. `max_job_gpus` caps a job's total GPUs (default: the cluster)."""
    if jobs < 1 or cluster_gpus < 1 or not load > 0 or not 0 <= sweep_fraction <= 1:
        raise ValueError("synthetic_trace: jobs and cluster_gpus must be >= 1, load > 0, 0 <= sweep_fraction <= 1")
    rng = random.Random(seed)
    cap = max_job_gpus or cluster_gpus
    tenants, shares = zip(*tenant_shares)
    # the share of submissions that are sweeps, so that `sweep_fraction` of the jobs are in one
    sweep_odds = sweep_fraction / (SWEEP_MEAN * (1 - sweep_fraction) + sweep_fraction)
    submissions, count = [], 0  # each: (tenant, user, [(learners, gpus, duration)])
    while count < jobs:
        tenant = rng.choices(tenants, shares)[0]
        user = f"{tenant}-user{rng.randrange(users_per_tenant)}"
        learners, gpus, duration = _shape(rng, cap)
        size = min(rng.randint(*SWEEP_SIZE), jobs - count) if rng.random() < sweep_odds else 1
        batch = [(learners, gpus, duration)] + [(learners, gpus, _duration(rng)) for _ in range(size - 1)]
        submissions.append((tenant, user, batch))
        count += size
    gpu_seconds = sum(learners * gpus * duration for _, _, batch in submissions for learners, gpus, duration in batch)
    rate = load * cluster_gpus * len(submissions) / gpu_seconds  # submissions per second
    arrival, trace = 0.0, []
    for tenant, user, batch in submissions:
        arrival += rng.expovariate(rate)
        for learners, gpus, duration in batch:
            trace.append(TraceJob(
                job_id=f"job-{len(trace):05d}", arrival_s=round(arrival, 3), tenant=tenant, user=user,
                learners=learners, gpus=gpus, cpus=4.0 * gpus, memory_bytes=16 * GIB * gpus, duration_s=duration,
                priority=_pick(rng, PRIORITIES)))
    return trace


def _shape(rng, cap):
    while True:
        learners, gpus = _pick(rng, LEARNERS), _pick(rng, GPUS_PER_LEARNER)
        if learners * gpus <= cap:
            return learners, gpus, _duration(rng)


def _duration(rng):
    duration = rng.lognormvariate(math.log(MEDIAN_DURATION_S), DURATION_SIGMA)
    return round(min(max(duration, DURATION_BOUNDS_S[0]), DURATION_BOUNDS_S[1]), 1)


def _pick(rng, weighted):
    values, weights = zip(*weighted)
    return rng.choices(values, weights)[0]
