"""Small builders for clusters, tenants and jobs, so each test states only what matters to it."""
from gpu_scheduler import Node, Placement, Resources, Snapshot, TenantPolicy, Workload

GIB = 2**30


def node(name="n1", gpus=8, cpus=64.0, memory_gib=512, schedulable=True):
    return Node(name, gpus, cpus, memory_gib * GIB, schedulable)


def nodes(count, gpus=8, **kwargs):
    return [node(f"n{i + 1}", gpus, **kwargs) for i in range(count)]


def job(job_id, *, tenant="t1", user="u1", learners=1, gpus=1, cpus=None, memory_gib=None, priority="normal",
        order=0, queued_at=None, **extra):
    """A queued job; cpus and memory default to 4 CPUs and 16 GiB per GPU (2 CPUs, 8 GiB without).
    Equal orders fall back to the job id, so jobs named a, b, c... are submitted in that order."""
    cpus = cpus if cpus is not None else (4.0 * gpus if gpus else 2.0)
    memory = (memory_gib if memory_gib is not None else (16 * gpus if gpus else 8)) * GIB
    return Workload(job_id, tenant, user, learners, Resources(gpus, cpus, memory), priority, order=order,
                    queued_at=queued_at, **extra)


def running(job_id, *where, **kwargs):
    """A running job; `where` is one (node, gpu_ids) pair per learner, e.g. ("n1", (0, 1))."""
    placement = tuple(Placement(name, tuple(ids)) for name, ids in where)
    kwargs.setdefault("learners", len(placement))
    kwargs.setdefault("gpus", len(placement[0].gpu_ids) if placement else 1)
    return job(job_id, placement=placement, **kwargs)


def tenant(name, gpus=None, *, cpus=None, memory_gib=None, **kwargs):
    quota = None
    if gpus is not None:
        quota = Resources(gpus, cpus if cpus is not None else 1e6, (memory_gib or 10**6) * GIB)
    return TenantPolicy(name, quota=quota, **kwargs)


def snapshot(cluster, *running_jobs, tenants=(), now=0.0):
    return Snapshot(tuple(cluster), {t.name: t for t in tenants}, tuple(running_jobs), now=now)


def gpus_in_use(decisions, snap):
    """{node: set of GPU ids} held by running jobs plus the newly admitted ones."""
    used = {}
    for workload in snap.running:
        for placement in workload.placement:
            used.setdefault(placement.node, []).extend(placement.gpu_ids)
    for placements in decisions.admitted.values():
        for placement in placements:
            used.setdefault(placement.node, []).extend(placement.gpu_ids)
    return used

