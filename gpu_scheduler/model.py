"""The scheduler's vocabulary: resources, nodes, tenants' policies, workloads (jobs), the cluster
snapshot one cycle decides over, and the decisions it returns. Plain frozen values, validated on
construction so that bad input fails here with a message naming the field, not deep inside a cycle."""
from dataclasses import dataclass, field

PRIORITY_RANK = {"high": 0, "normal": 1, "low": 2}  # smaller rank = served first
BUDGET_STATES = ("ok", "hard_exceeded", "soft_exceeded")
CPU_EPSILON = 1e-9  # CPUs are fractional; sums of floats must not refuse an exact fit


class SchedulingInputError(ValueError):
    """The snapshot or a queued workload is inconsistent (e.g. two jobs on one GPU)."""


@dataclass(frozen=True)
class Resources:
    gpus: int = 0
    cpus: float = 0.0
    memory_bytes: int = 0

    def __add__(self, other):
        return Resources(self.gpus + other.gpus, self.cpus + other.cpus, self.memory_bytes + other.memory_bytes)

    def __mul__(self, factor):
        return Resources(self.gpus * factor, self.cpus * factor, self.memory_bytes * factor)

    def fits_in(self, other):
        """Every dimension of self is at most the same dimension of other."""
        return (self.gpus <= other.gpus and self.cpus <= other.cpus + CPU_EPSILON
                and self.memory_bytes <= other.memory_bytes)

    def is_zero(self):
        return self.gpus == 0 and abs(self.cpus) <= CPU_EPSILON and self.memory_bytes == 0

    def check_non_negative(self, what):
        for name in ("gpus", "cpus", "memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise SchedulingInputError(f"{what}: {name} must be a non-negative number, got {value!r}")
        if not isinstance(self.gpus, int):
            raise SchedulingInputError(f"{what}: gpus must be an integer, got {self.gpus!r}")


@dataclass(frozen=True)
class Node:
    """Allocatable totals of one node; its GPUs are the indices 0..gpus-1."""
    name: str
    gpus: int
    cpus: float
    memory_bytes: int
    schedulable: bool = True  # False = cordoned: keeps what runs there, gets no new work

    def __post_init__(self):
        if not self.name:
            raise SchedulingInputError("node: name must not be empty")
        Resources(self.gpus, self.cpus, self.memory_bytes).check_non_negative(f"node {self.name}")


@dataclass(frozen=True)
class Placement:
    node: str
    gpu_ids: tuple  # one learner's GPUs on that node


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    quota: Resources | None = None  # nominal (guaranteed) resources at once; None = no quota (shared pool)
    max_jobs: int | None = None  # admitted (running) jobs at once
    max_gpus_per_user: int | None = None  # cap per user inside the tenant
    can_borrow: bool = False  # may use idle capacity beyond its quota; borrowed work is reclaimable
    budget: str = "ok"  # "ok" | "hard_exceeded" | "soft_exceeded"
    budget_reason: str = ""  # shown to waiting jobs, e.g. "GPU-hours budget 1.0/1.0 h used this month"
    weight: float = 1.0  # fair-share weight
    # Attained service: what the tenant's jobs held recently, as GPU-seconds and CPU-seconds with
    # older use counted less (the caller decays it; jobs.admission). Among jobs of equal priority,
    # the tenant that has had the least goes first (core._TenantState.recent_service).
    recent_gpu_s: float = 0.0
    recent_cpu_s: float = 0.0

    def __post_init__(self):
        if self.budget not in BUDGET_STATES:
            raise SchedulingInputError(f"tenant {self.name}: budget must be one of {', '.join(BUDGET_STATES)}, "
                                       f"got {self.budget!r}")
        if not self.weight > 0:
            raise SchedulingInputError(f"tenant {self.name}: weight must be positive, got {self.weight!r}")
        for name in ("recent_gpu_s", "recent_cpu_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise SchedulingInputError(f"tenant {self.name}: {name} must be a number >= 0, got {value!r}")
        if self.quota is not None:
            self.quota.check_non_negative(f"tenant {self.name} quota")
        for name in ("max_jobs", "max_gpus_per_user"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise SchedulingInputError(f"tenant {self.name}: {name} must be a non-negative integer or None, "
                                           f"got {value!r}")


@dataclass(frozen=True)
class Workload:
    """A job: queued (placement=()) or running (one Placement per placed learner)."""
    job_id: str
    tenant: str
    user: str
    learners: int
    per_learner: Resources
    priority: str = "normal"  # low | normal | high
    order: int = 0  # submission order, smaller = earlier (the FIFO key)
    placement: tuple = ()
    stopping: bool = False  # a halt is under way: still occupies, frees soon; never picked again
    preemptible: bool = True  # False for jobs that cannot be halted through a checkpoint
    started: float = 0.0  # when it started running (seconds, same clock as Snapshot.now); larger = more recent
    queued_at: float | None = None  # when it (re)entered the queue, same clock as Snapshot.now; None = unknown
    attained_gpu_s: float = 0.0  # GPU-seconds it ran in earlier attempts (its service so far, without this run)
    # An elastic job (0 = fixed): when its `learners` do not fit, it may start with as few as this.
    min_learners: int = 0
    private: bool = False  # seen by its owner and those it is shared with only: reasons do not name it

    def __post_init__(self):
        if not self.job_id:
            raise SchedulingInputError("workload: job_id must not be empty")
        if self.priority not in PRIORITY_RANK:
            raise SchedulingInputError(f"job {self.job_id}: priority must be one of high, normal, low, "
                                       f"got {self.priority!r}")
        if not isinstance(self.learners, int) or self.learners < 1:
            raise SchedulingInputError(f"job {self.job_id}: learners must be an integer >= 1, got {self.learners!r}")
        self.per_learner.check_non_negative(f"job {self.job_id} per_learner")
        if not isinstance(self.attained_gpu_s, (int, float)) or not self.attained_gpu_s >= 0:
            raise SchedulingInputError(f"job {self.job_id}: attained_gpu_s must be a number >= 0, "
                                       f"got {self.attained_gpu_s!r}")
        if self.per_learner.is_zero():
            raise SchedulingInputError(f"job {self.job_id}: per_learner asks for nothing (0 GPUs, CPUs and memory)")
        if len(self.placement) > self.learners:
            raise SchedulingInputError(f"job {self.job_id}: {len(self.placement)} placements for "
                                       f"{self.learners} learners")

    @property
    def total(self):
        return self.per_learner * self.learners

    def service_gpu_s(self, now):
        """GPU-seconds of service so far: earlier attempts plus, while placed, the current run."""
        if not self.placement:
            return self.attained_gpu_s
        return self.attained_gpu_s + max(0.0, now - self.started) * self.per_learner.gpus * len(self.placement)


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple
    tenants: dict = field(default_factory=dict)  # name -> TenantPolicy; a missing tenant gets TenantPolicy(name)
    running: tuple = ()  # Workloads holding resources (including stopping ones)
    now: float = 0.0  # the current time, on the clock of Workload.queued_at / started (e.g. Unix seconds)

    def tenant(self, name):
        policy = self.tenants.get(name)
        return policy if policy is not None else TenantPolicy(name)


@dataclass
class Decisions:
    admitted: dict = field(default_factory=dict)  # job_id -> [Placement per learner]
    preempt: dict = field(default_factory=dict)  # running job_id -> reason
    waiting: dict = field(default_factory=dict)  # job_id -> "waiting: <position>; <why>"
    position: dict = field(default_factory=dict)  # job_id -> 1-based position in its tenant queue
