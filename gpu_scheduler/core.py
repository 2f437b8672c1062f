"""One scheduling cycle over a snapshot: take the queue in order, place each job's learners as a
gang (all or none), and say why every job left waiting waits.

This first policy is strict priority-then-FIFO with head-of-line blocking (no backfill), so a big
job at the head is never starved by small ones behind it.
"""
from dataclasses import dataclass, field

PRIORITY_RANK = {"high": 0, "normal": 1, "low": 2}


@dataclass(frozen=True)
class Request:
    job_id: str
    learners: int
    gpus: int  # per learner
    cpus: float  # per learner
    memory_bytes: int  # per learner
    priority: str = "normal"
    order: int = 0  # submission order (smaller first)


@dataclass
class NodeFree:
    name: str
    gpus: int
    cpus: float
    memory_bytes: int
    gpu_ids: list = field(default_factory=list)  # free GPU indices on this node

    def fits(self, request):
        return (self.gpus >= request.gpus and self.cpus + 1e-9 >= request.cpus
                and self.memory_bytes >= request.memory_bytes)

    def take(self, request):
        taken, self.gpu_ids = tuple(self.gpu_ids[:request.gpus]), self.gpu_ids[request.gpus:]
        self.gpus -= request.gpus
        self.cpus -= request.cpus
        self.memory_bytes -= request.memory_bytes
        return taken


@dataclass(frozen=True)
class Placement:
    node: str
    gpu_ids: tuple


@dataclass
class Decisions:
    admitted: dict = field(default_factory=dict)  # job_id -> [Placement per learner]
    waiting: dict = field(default_factory=dict)  # job_id -> human reason


def queue_order(requests):
    return sorted(requests, key=lambda r: (PRIORITY_RANK.get(r.priority, 1), r.order))


def schedule(requests, nodes):
    decisions = Decisions()
    blocked_by = None
    for position, request in enumerate(queue_order(requests), start=1):
        if blocked_by is not None:
            decisions.waiting[request.job_id] = f"{_ordinal(position)} in queue, behind {blocked_by}"
            continue
        placement = _place_gang(request, nodes)
        if placement is None:
            decisions.waiting[request.job_id] = _why_not(request, nodes)
            blocked_by = request.job_id
        else:
            decisions.admitted[request.job_id] = placement
    return decisions


def _place_gang(request, nodes):
    """Place all learners or none; prefer the fullest node that fits (packing keeps nodes whole)."""
    trial = [NodeFree(n.name, n.gpus, n.cpus, n.memory_bytes, list(n.gpu_ids)) for n in nodes]
    placements = []
    for _ in range(request.learners):
        candidates = [n for n in trial if n.fits(request)]
        if not candidates:
            return None
        node = min(candidates, key=lambda n: (n.gpus, n.cpus))
        placements.append(Placement(node.name, node.take(request)))
    for real, tried in zip(nodes, trial):
        real.gpus, real.cpus, real.memory_bytes, real.gpu_ids = tried.gpus, tried.cpus, tried.memory_bytes, tried.gpu_ids
    return placements


def _why_not(request, nodes):
    learners = f"{request.learners} learners × " if request.learners > 1 else ""
    if request.gpus and max((n.gpus for n in nodes), default=0) < request.gpus:
        largest = max((n.gpus for n in nodes), default=0)
        return f"waiting: needs {learners}{request.gpus} GPUs on one node; largest free block is {largest}"
    if max((n.cpus for n in nodes), default=0) + 1e-9 < request.cpus:
        largest = max((n.cpus for n in nodes), default=0)
        return f"waiting: needs {learners}{request.cpus:g} CPUs on one node; {largest:g} free"
    if max((n.memory_bytes for n in nodes), default=0) < request.memory_bytes:
        largest = max((n.memory_bytes for n in nodes), default=0)
        return (f"waiting: needs {learners}{request.memory_bytes / 2**30:.1f} GiB memory on one node; "
                f"{largest / 2**30:.1f} GiB free")
    return f"waiting: {request.learners} learners do not all fit at once"


def _ordinal(n):
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
