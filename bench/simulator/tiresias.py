"""Tiresias (Gu et al., NSDI'19) as Pollux compared with it, "Tiresias+TunedJobs": every job runs at
the GPUs and batch its owner asked for; which jobs run is discretised two-dimensional least-attained-
service (2D-LAS): a job's attained service is GPUs x time it has held them, jobs below the queue
threshold are in queue 0 and go before the rest, FIFO (by arrival) inside a queue, preemptive. Two
queues with a threshold of 16 GPU-hours, as Pollux's evaluation configured it; no starvation rule.

Pure: `queue_order` and `allocate` decide, the replay (pollux_replay.py) carries decisions out.
"""
from dataclasses import dataclass

THRESHOLD_GPU_S = 16 * 3600.0


@dataclass(frozen=True)
class Candidate:
    name: str
    arrival_s: float
    gpus: int
    attained_gpu_s: float
    placement: dict  # node -> GPUs it holds now (empty: not running)


def queue_level(attained_gpu_s, threshold_gpu_s=THRESHOLD_GPU_S):
    return 0 if attained_gpu_s < threshold_gpu_s else 1


def queue_order(candidates, threshold_gpu_s=THRESHOLD_GPU_S):
    """Queue 0 before queue 1, first come first served inside a queue."""
    return sorted(candidates, key=lambda c: (queue_level(c.attained_gpu_s, threshold_gpu_s), c.arrival_s, c.name))


def allocate(candidates, nodes, threshold_gpu_s=THRESHOLD_GPU_S):
    """{name: {node: GPUs}} for the jobs that run this interval; the others wait (or are preempted).
    Jobs are admitted in queue order while their GPUs fit (a later, smaller job may backfill); a job
    that keeps running keeps its GPUs, the others are packed onto as few nodes as fit them."""
    ordered = queue_order(candidates, threshold_gpu_s)
    capacity, chosen, used = sum(nodes.values()), [], 0
    for job in ordered:
        if used + job.gpus <= capacity:
            chosen.append(job)
            used += job.gpus
    free = dict(nodes)
    result = {}
    for job in chosen:
        if job.placement:
            result[job.name] = dict(job.placement)
            for node, gpus in job.placement.items():
                free[node] -= gpus
    for job in chosen:
        if not job.placement:
            result[job.name] = pack(free, job.gpus)
    return result


def pack(free, gpus):
    """Take `gpus` from `free` on few nodes: one node that fits best if any, else whole nodes,
    emptiest first, and the rest on the node that fits it best."""
    placement = {}
    while gpus > 0:
        fitting = [(count, node) for node, count in free.items() if count >= gpus]
        if fitting:
            _, node = min(fitting)
            take = gpus
        else:
            count, node = max((count, node) for node, count in free.items() if count > 0)
            take = count
        free[node] -= take
        placement[node] = placement.get(node, 0) + take
        gpus -= take
    return placement
