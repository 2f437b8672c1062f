"""Figures of one simulation run.

- queueing time: time a job spent waiting to have all its learners placed, summed over its attempts;
- JCT (job completion time): completion minus submission;
- utilisation: GPU-time of jobs making progress / (schedulable GPUs x the run's length); GPUs held
  by a partly placed gang or by a job being halted count as idle;
- utilisation while waiting: the same ratio over only the intervals when some job was waiting;
- idle GPUs while waiting: mean number of GPUs not making progress over those intervals;
- partial gangs: distributed jobs (attempts) that ever had some but not all learners placed;
  gang timeouts: how many of those were torn down after waiting too long to become whole;
- Jain's fairness index across tenants: J = (sum x)^2 / (n * sum x^2) over the tenants' normalised
  service x_t = (sum of GPUs x run time of the tenant's completed jobs) / (sum of GPUs x JCT of the
  same jobs), i.e. the share of the time their GPU demand spent in the system that was spent being
  served. 1.0 = every tenant waits in the same proportion; 1/n = one tenant gets everything.
"""


def percentile(values, fraction):
    """Nearest-rank percentile (same convention as bench/report.py)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


def jain_index(values):
    values = [v for v in values if v is not None]
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def tenant_service(jobs):
    served, in_system = {}, {}
    for job in jobs:
        gpus = job.spec.gpus * job.spec.learners or 1  # CPU-only jobs weigh as one GPU
        served[job.spec.tenant] = served.get(job.spec.tenant, 0.0) + gpus * job.spec.duration_s
        in_system[job.spec.tenant] = in_system.get(job.spec.tenant, 0.0) + gpus * job.jct_s
    return {tenant: served[tenant] / in_system[tenant] for tenant in served}


def summarise(result):
    done = [j for j in result.jobs if j.finished_s is not None]
    queue = [j.queue_s for j in done]
    jct = [j.jct_s for j in done]
    start = min((j.spec.arrival_s for j in result.jobs), default=0.0)
    length = max(result.end_s - start, 1e-9)
    service = tenant_service(done)
    return {
        "policy": result.policy,
        "jobs": len(result.jobs),
        "completed": len(done),
        "unfinished": len(result.jobs) - len(done),
        "mean_queue_s": _mean(queue),
        "p95_queue_s": percentile(queue, 0.95),
        "mean_jct_s": _mean(jct),
        "p95_jct_s": percentile(jct, 0.95),
        "utilization": result.busy_gpu_s / (result.capacity_gpus * length),
        "utilization_while_waiting": (result.busy_gpu_s_while_waiting / (result.capacity_gpus * result.waiting_s)
                                      if result.waiting_s else None),
        "idle_gpus_while_waiting": (result.capacity_gpus - result.busy_gpu_s_while_waiting / result.waiting_s
                                    if result.waiting_s else 0.0),
        "waiting_fraction": result.waiting_s / length,
        "busy_gpu_s_while_waiting": result.busy_gpu_s_while_waiting,
        "capacity_gpu_s_while_waiting": result.capacity_gpus * result.waiting_s,
        "partial_gangs": result.partial_gangs,
        "gang_timeouts": result.gang_timeouts,
        "preemptions": sum(j.preemptions for j in result.jobs),
        "lost_gpu_hours": sum(j.lost_gpu_s for j in result.jobs) / 3600,
        "jain_fairness": jain_index(list(service.values())),
        "tenant_service": service,
        "makespan_s": length,
        "cycles": result.cycles,
    }


def _mean(values):
    return sum(values) / len(values) if values else None
