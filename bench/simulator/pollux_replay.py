"""Pollux's workloads replayed with job physics from its traces (pollux.py), under Tiresias+TunedJobs
(tiresias.py) or one of the elastic optimizer's policies (gpu_scheduler.elastic.optimize).

The setting is Pollux's: 16 nodes x 4 GPUs, a decision every 60 s, every job runs to its target (no
admission cap, no drops), and 30 s of progress lost whenever a job's GPUs change (its start and a
resume included, the same for every policy); a change of batch alone keeps the GPUs and costs
nothing. Between decisions a job's progress is integrated exactly over the trace's intervals, so a
job finishes at the second its progress reaches the target, not at the next decision.

What the elastic policies see is what the platform would: step times the job has reported at the
shapes it has run, fitted (throughput.fit) from a generic prior, and, under `trainyard`, the noise
scale measured over the last finished interval of its own training at its current batch. A job with
no measurement yet is not given a larger batch than its owner asked for under `trainyard`.
"""
import bisect
import math
from collections import Counter
from dataclasses import dataclass, field

from gpu_scheduler.elastic import ElasticCluster, ElasticJob, ElasticPolicy, optimize
from bench.simulator import tiresias
from bench.simulator.metrics import percentile
from bench.simulator.pollux import application
from gpu_scheduler.throughput import GENERIC_PRIOR, fit

NODES = 16
GPUS_PER_NODE = 4
INTERVAL_S = 60.0
RESTART_S = 30.0
REPLAY_POLICIES = ("tiresias", "gpu_only", "paper", "trainyard")


@dataclass(eq=False)  # identity: jobs key the decisions
class ReplayJob:
    name: str
    arrival_s: float
    app: object  # pollux.Application
    gpus: int  # requested
    batch_asked: int
    order: int
    progress: float = 0.0  # steps at the application's B0
    placement: dict = field(default_factory=dict)  # node -> GPUs
    batch: int = 0
    ready_at: float = 0.0  # restarting until then
    started_s: float | None = None
    attained_gpu_s: float = 0.0
    finished_s: float | None = None
    restarts: int = 0
    observations: list = field(default_factory=list)
    observed: set = field(default_factory=set)
    model: object = GENERIC_PRIOR

    @property
    def jct_s(self):
        return self.finished_s - self.arrival_s


@dataclass
class ReplayResult:
    policy: str
    jobs: list

    def jcts(self):
        return [j.jct_s for j in self.jobs]

    def mean_jct_s(self):
        return sum(self.jcts()) / len(self.jobs)

    def p99_jct_s(self):
        return percentile(self.jcts(), 0.99)

    def makespan_s(self):
        return max(j.finished_s for j in self.jobs) - min(j.arrival_s for j in self.jobs)

    def restarts_per_job(self):
        return sum(j.restarts for j in self.jobs) / len(self.jobs)


def replay(workload_jobs, policy, *, nodes=NODES, gpus_per_node=GPUS_PER_NODE, interval_s=INTERVAL_S,
           restart_s=RESTART_S, root=None):
    """Run every job of `workload_jobs` (pollux.WorkloadJob) to its target under `policy` (one of
    REPLAY_POLICIES); returns a ReplayResult."""
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"replay policy must be one of {REPLAY_POLICIES}, got {policy!r}")
    cluster = {f"node-{i:02d}": gpus_per_node for i in range(nodes)}
    decide = decide_tiresias if policy == "tiresias" else ElasticDecider(policy, cluster, restart_s)
    pending = sorted(workload_jobs, key=lambda j: (j.arrival_s, j.name))
    jobs = [ReplayJob(w.name, w.arrival_s, application(w.app, root), w.gpus, w.batch, i) for i, w in enumerate(pending)]
    waiting_to_arrive, active, now = list(jobs), [], 0.0
    while waiting_to_arrive or active:
        while waiting_to_arrive and waiting_to_arrive[0].arrival_s <= now:
            active.append(waiting_to_arrive.pop(0))
        if not active:  # idle cluster: jump to the decision after the next arrival
            now = math.ceil(waiting_to_arrive[0].arrival_s / interval_s) * interval_s
            continue
        for job, (placement, batch) in decide(active, cluster, now).items():
            carry_out(job, placement, batch, now, restart_s)
        end = now + interval_s
        for job in active:
            advance(job, now, end)
        active = [j for j in active if j.finished_s is None]
        now = end
    return ReplayResult(policy, jobs)


def carry_out(job, placement, batch, now, restart_s):
    placement = {node: gpus for node, gpus in placement.items() if gpus}
    if placement != job.placement:
        if placement:
            if job.started_s is not None:  # a resize or a resume after preemption
                job.restarts += 1
            job.ready_at = now + restart_s
            if job.started_s is None:
                job.started_s = now
        job.placement = placement
    job.batch = batch if placement else 0


def advance(job, start, end):
    """Integrate the job's progress over [start, end): piecewise constant per trace interval."""
    if not job.placement:
        return
    counts = tuple(job.placement.values())
    job.attained_gpu_s += sum(counts) * (end - start)
    t = max(start, job.ready_at)
    if t >= end:
        return
    app = job.app
    step = app.step_time(counts, job.batch)
    ends, gains = app.segments(job.batch)
    progress, last = job.progress, len(ends) - 1
    while True:
        i = min(bisect.bisect_right(ends, progress), last)
        rate = gains[i] / step
        stop = app.target if i == last else min(ends[i], app.target)
        needed = (stop - progress) / rate
        if t + needed > end:
            job.progress = progress + rate * (end - t)
            return
        t, progress = t + needed, stop
        if progress >= app.target:
            job.progress, job.finished_s = app.target, t
            return
        if t >= end:
            job.progress = progress
            return


# --- Tiresias ---------------------------------------------------------------------------------------
def decide_tiresias(active, cluster, now):
    candidates = [tiresias.Candidate(j.name, j.arrival_s, j.gpus, j.attained_gpu_s, j.placement) for j in active]
    plan = tiresias.allocate(candidates, cluster)
    return {j: (plan.get(j.name, {}), j.batch_asked) for j in active}


# --- the elastic optimizer ----------------------------------------------------------------------------
class ElasticDecider:
    def __init__(self, policy, cluster, restart_s):
        self.policy = ElasticPolicy(policy)
        self.cluster = ElasticCluster(dict(cluster))
        self.max_learners = sum(cluster.values())
        self.restart_s = restart_s
        self.last_state = None

    def __call__(self, active, cluster, now):
        for job in active:
            observe(job)
        # gpu_only and paper decide from the jobs alone (no clock, no noise scale): when no job came,
        # went or reported a new shape since their last plan was carried out, the plan would repeat.
        if self.policy.name != "trainyard":
            state = tuple((j.name, len(j.observations), j.batch, tuple(sorted(j.placement.items()))) for j in active)
            if state == self.last_state:
                return {}
        targets = optimize([self.elastic_job(j) for j in active], self.cluster, self.policy, now=now)
        plan = {}
        for job in active:
            target = targets[job.name]
            plan[job] = (dict(Counter(target.placement)), target.batch)
        if self.policy.name != "trainyard":
            self.last_state = tuple((j.name, len(j.observations), plan[j][1] if plan[j][0] else 0,
                                     tuple(sorted(plan[j][0].items()))) for j in active)
        return plan

    def elastic_job(self, job):
        app = job.app
        noise = None
        if self.policy.name == "trainyard" and job.batch:
            phi = app.measured_phi(job.batch, job.progress)
            noise = None if phi is None else min(phi, 1e12) * app.b0
        # Without a measured noise scale, trainyard does not grow the batch past what was asked for.
        batch_max = job.batch_asked if self.policy.name == "trainyard" and noise is None else app.max_batch
        learners = sum(job.placement.values())
        nodes = tuple(node for node, gpus in sorted(job.placement.items()) for _ in range(gpus))
        return ElasticJob(job.name, "pollux", 1, self.max_learners, 1, job.batch_asked, app.b0,
                          max(batch_max, job.batch_asked), requested_learners=job.gpus, model=job.model,
                          noise_scale=noise, restart_s=self.restart_s, learners=learners,
                          batch=job.batch if learners else 0, placement=nodes, started_s=job.started_s,
                          order=job.order)


def observe(job):
    """The job reports its step time at the shape it runs; the optimizer's model is refitted."""
    if not job.placement:
        return
    counts = tuple(job.placement.values())
    gpus = sum(counts)
    shape = (gpus, len(counts), job.batch / gpus)
    if shape in job.observed:
        return
    job.observed.add(shape)
    job.observations.append((*shape, job.app.step_time(counts, job.batch)))
    job.model = fit(job.observations, GENERIC_PRIOR)
