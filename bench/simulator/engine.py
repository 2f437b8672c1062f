"""A discrete-event simulator that replays a trace through the real `schedule()`.

Events are arrivals, completions and the end of halts. After the events of one instant are applied,
one scheduling cycle runs over a snapshot built exactly as the platform builds it (running and
stopping jobs with their placements, queued jobs in submission order), and its decisions are applied:
- an admitted job starts making progress once all its learners are placed (a partly placed job,
  possible only under the pod-by-pod baseline, holds its GPUs and makes no progress);
- a preempted job is halted through its checkpoint: it stops progressing at once, keeps its
  resources for `halt_seconds`, keeps the work up to its last periodic checkpoint (every
  `checkpoint_interval_s` of progress) and goes back to the queue with its original submission order;
- a partly placed job that is still not whole after `partial_gang_timeout_s` is torn down and queued
  again, as a pod-start timeout or an operator would; without it, two half-placed jobs waiting for
  each other's GPUs would deadlock the baseline for ever.
"""
import heapq
import math
from dataclasses import dataclass, field

from gpu_scheduler.core import schedule
from gpu_scheduler.model import Resources, Snapshot, TenantPolicy, Workload
from gpu_scheduler.policy import Policy

ARRIVE, FINISH, HALTED, GANG_TIMEOUT = "arrive", "finish", "halted", "gang_timeout"


@dataclass
class JobRecord:
    """What happened to one trace job."""
    spec: object  # TraceJob
    order: int
    remaining_s: float = 0.0
    state: str = "future"  # future | queued | running | stopping | done
    placement: list = field(default_factory=list)
    progress_since: float | None = None  # when the current attempt started progressing
    queued_since: float = 0.0
    queue_s: float = 0.0  # total time spent waiting to be fully placed, over all attempts
    finished_s: float | None = None
    attempt: int = 0
    preemptions: int = 0
    lost_gpu_s: float = 0.0  # progress thrown away by preemption (since the last checkpoint)
    attained_gpu_s: float = 0.0  # GPU time of its earlier (halted) attempts, kept or lost
    partial: bool = False  # was ever partly placed
    workload: Workload | None = None  # cached; rebuilt when state or placement changes

    @property
    def jct_s(self):
        return self.finished_s - self.spec.arrival_s


@dataclass
class SimulationResult:
    policy: str
    jobs: list  # JobRecord
    capacity_gpus: int
    end_s: float
    busy_gpu_s: float  # GPU-time of jobs making progress
    waiting_s: float  # time during which some job waited (queued or partly placed)
    busy_gpu_s_while_waiting: float
    partial_gangs: int  # jobs (attempts) that were ever partly placed
    gang_timeouts: int  # partly placed jobs torn down after partial_gang_timeout_s
    cycles: int


class Simulation:
    def __init__(self, trace, nodes, *, tenants=None, policy=None, checkpoint_interval_s=600.0,
                 halt_seconds=60.0, partial_gang_timeout_s=1800.0, horizon_s=None, observer=None):
        self.nodes = tuple(nodes)
        self.tenants = dict(tenants or {})
        self.policy = policy or Policy.full()
        self.checkpoint_interval_s, self.halt_seconds = checkpoint_interval_s, halt_seconds
        self.partial_gang_timeout_s = partial_gang_timeout_s
        self.gang_timeouts = 0
        self.horizon_s = horizon_s
        self.observer = observer  # called as observer(snapshot, queued, decisions) after every cycle (tests)
        self.capacity_gpus = sum(n.gpus for n in self.nodes if n.schedulable)
        self.jobs = {}
        for order, spec in enumerate(sorted(trace, key=lambda j: (j.arrival_s, j.job_id))):
            if spec.job_id in self.jobs:
                raise ValueError(f"trace: job_id {spec.job_id!r} appears twice")
            self.jobs[spec.job_id] = JobRecord(spec, order, remaining_s=spec.duration_s)
        self.events, self._seq = [], 0
        self.active = {}  # job_id -> JobRecord for queued / running / stopping jobs
        self.now = 0.0
        self.busy_gpu_s = self.waiting_s = self.busy_while_waiting = 0.0
        self.partial_gangs = 0
        self.cycles = 0

    # --- events ------------------------------------------------------------------------------------
    def _push(self, when, kind, job_id, token=0):
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, kind, job_id, token))

    def run(self):
        for job in self.jobs.values():
            self._push(job.spec.arrival_s, ARRIVE, job.spec.job_id)
        while self.events:
            when = self.events[0][0]
            if self.horizon_s is not None and when > self.horizon_s:
                break
            self._account_until(when)
            while self.events and self.events[0][0] == when:
                _, _, kind, job_id, token = heapq.heappop(self.events)
                self._apply(kind, self.jobs[job_id], token)
            self._cycle()
        return SimulationResult(self.policy.name, list(self.jobs.values()), self.capacity_gpus, self.now,
                                self.busy_gpu_s, self.waiting_s, self.busy_while_waiting, self.partial_gangs,
                                self.gang_timeouts, self.cycles)

    def _apply(self, kind, job, token):
        if kind == ARRIVE:
            job.state, job.queued_since = "queued", self.now
            self.active[job.spec.job_id] = job
        elif kind == FINISH and job.state == "running" and token == job.attempt:
            job.state, job.finished_s, job.placement, job.workload = "done", self.now, [], None
            del self.active[job.spec.job_id]
        elif kind == HALTED and job.state == "stopping":
            job.state, job.placement, job.workload = "queued", [], None
            job.queued_since = self.now
            job.attempt += 1
        elif kind == GANG_TIMEOUT and job.state == "running" and job.progress_since is None and token == job.attempt:
            # torn down and queued again; it never started, so its queueing time keeps running
            job.state, job.placement, job.workload, job.partial = "queued", [], None, False
            job.attempt += 1
            self.gang_timeouts += 1

    def _account_until(self, when):
        elapsed = when - self.now
        if elapsed > 0:
            busy = sum(j.spec.gpus * j.spec.learners for j in self.active.values() if j.progress_since is not None)
            waiting = any(j.state == "queued" or (j.state == "running" and j.progress_since is None)
                          for j in self.active.values())
            self.busy_gpu_s += busy * elapsed
            if waiting:
                self.waiting_s += elapsed
                self.busy_while_waiting += busy * elapsed
        self.now = when

    # --- one scheduling cycle ------------------------------------------------------------------------
    def _cycle(self):
        running, queued = [], []
        for job in self.active.values():
            if job.workload is None:
                job.workload = self._workload(job)
            (queued if job.state == "queued" else running).append(job.workload)
        if not queued and not any(len(w.placement) < w.learners for w in running):
            return
        snapshot = Snapshot(self.nodes, self.tenants, tuple(running), now=self.now)
        decisions = schedule(snapshot, queued, self.policy)
        self.cycles += 1
        if self.observer is not None:
            self.observer(snapshot, queued, decisions)
        for job_id, placements in decisions.admitted.items():
            self._place(self.jobs[job_id], placements)
        for job_id in decisions.preempt:
            self._halt(self.jobs[job_id])

    def _workload(self, job):
        spec = job.spec
        return Workload(spec.job_id, spec.tenant, spec.user, spec.learners,
                        Resources(spec.gpus, spec.cpus, spec.memory_bytes), spec.priority, order=job.order,
                        placement=tuple(job.placement), stopping=job.state == "stopping",
                        preemptible=spec.preemptible, started=job.progress_since or 0.0,
                        queued_at=job.queued_since if job.state == "queued" else None,
                        attained_gpu_s=job.attained_gpu_s)

    def _place(self, job, placements):
        job.placement.extend(placements)
        job.state, job.workload = "running", None
        if len(job.placement) < job.spec.learners:
            if not job.partial:
                job.partial = True
                self.partial_gangs += 1
                self._push(self.now + self.partial_gang_timeout_s, GANG_TIMEOUT, job.spec.job_id, job.attempt)
            return
        job.queue_s += self.now - job.queued_since
        job.progress_since = self.now
        self._push(self.now + job.remaining_s, FINISH, job.spec.job_id, job.attempt)

    def _halt(self, job):
        if job.progress_since is not None:
            progress = self.now - job.progress_since
            kept = math.floor(progress / self.checkpoint_interval_s) * self.checkpoint_interval_s
            job.remaining_s -= kept
            job.lost_gpu_s += (progress - kept) * job.spec.gpus * job.spec.learners
            job.attained_gpu_s += progress * job.spec.gpus * job.spec.learners
        job.state, job.progress_since, job.workload = "stopping", None, None
        job.preemptions += 1
        job.partial = False  # a new attempt may be counted again
        self._push(self.now + self.halt_seconds, HALTED, job.spec.job_id)


def equal_quotas(trace, nodes, *, can_borrow=True):
    """Every tenant of the trace gets an equal share of the cluster as its guaranteed quota."""
    names = sorted({job.tenant for job in trace})
    schedulable = [n for n in nodes if n.schedulable]
    total = Resources(sum(n.gpus for n in schedulable), sum(n.cpus for n in schedulable),
                      sum(n.memory_bytes for n in schedulable))
    share = Resources(total.gpus // len(names), total.cpus / len(names), total.memory_bytes // len(names))
    return {name: TenantPolicy(name, quota=share, can_borrow=can_borrow) for name in names}
