"""scheduler: Trainyard's scheduling policy against FfDL's default and a Kueue-like one, on the same
traces, through the simulator (which calls the real `gpu_scheduler.schedule`), plus the cost of one
scheduling cycle with 10,000 queued jobs on a 1,000-node x 8-GPU cluster.

Traces are synthetic (bench/simulator/synthetic.py: FfDL's shape, 30% of jobs in sweeps),
seeded, offered at a share of the cluster's GPUs ("load"), in three scenarios:
- `busy`: a contended cluster (32 nodes x 8 GPUs) offered 0.9 of its GPUs for about a week of
  arrivals (2,400 jobs per trace), long enough for the 24-hour tail of run times to reach a steady
  state. This is the regime a scheduler is for, and the one the JCT target is measured on;
- `bursty-small` / `bursty-large`: half a day of arrivals at load 1.0 on 32 and 128 nodes. Here
  most of the work is a few very long jobs that run on after the arrivals stop, queues stay short,
  and no scheduler can get far below FIFO+spread's JCT (see the floor);
- a load sweep of `busy` (BENCH_SCHED_SWEEP, FIFO+spread and full only), because how much any
  scheduler can save depends on how loaded the cluster is.
Every tenant has an equal guaranteed quota and may borrow. `jct_ratio_vs_fifo_spread` is measured on
`busy`; the other headline figures pool every trace of every scenario: utilisation while waiting as
total busy GPU-time over total GPU capacity-time of the intervals with a waiting job, Jain's index
averaged over traces, partial gangs summed. A `..._floor` is the mean run time over FIFO+spread's mean
JCT: no scheduler can complete a job faster than it runs, so no JCT ratio can go below it there.
BENCH_SCHED_SEEDS / BENCH_SCHED_LOAD (busy's load) / BENCH_SCHED_SWEEP change the traces;
BENCH_SCHED_CYCLES the timed cycles.
"""
import os
import random
import statistics
import time

from bench.report import percentile, publish
from bench.targets import shown
from gpu_scheduler import Node, Policy, Resources, Snapshot, TenantPolicy, Workload, schedule
from bench.simulator import Simulation, equal_quotas, summarise, synthetic_trace

GIB = 2**30
SEEDS = [int(s) for s in os.environ.get("BENCH_SCHED_SEEDS", "11,12,13").split(",")]
LOAD = float(os.environ.get("BENCH_SCHED_LOAD", 0.9))
SWEEP = [float(x) for x in os.environ.get("BENCH_SCHED_SWEEP", "0.8,1.0").split(",") if x]
TIMED_CYCLES = int(os.environ.get("BENCH_SCHED_CYCLES", 7))
HEADLINE = "busy"
# name, nodes, jobs per trace, traces per seed, load
SCENARIOS = ((HEADLINE, 32, 2400, 1, LOAD), ("bursty-small", 32, 800, 2, 1.0), ("bursty-large", 128, 3200, 1, 1.0))
POLICIES = (Policy.fifo_spread(), Policy.kueue_like(), Policy.full())


def cluster(nodes):
    return [Node(f"node-{i:04d}", 8, 64.0, 512 * GIB) for i in range(nodes)]


def simulate_all(scenarios=SCENARIOS, seeds=SEEDS, policies=POLICIES):
    """{scenario: {policy name: {"runs": [summary per trace], "jobs": [JobRecord of every trace]}}}"""
    results = {}
    for name, node_count, jobs, per_seed, load in scenarios:
        nodes = cluster(node_count)
        entry = results[name] = {p.name: {"runs": [], "jobs": []} for p in policies}
        for seed in seeds:
            for variant in range(per_seed):
                trace = synthetic_trace(jobs, seed=seed * 10 + variant, cluster_gpus=8 * node_count, load=load)
                tenants = equal_quotas(trace, nodes)
                for policy in policies:
                    result = Simulation(trace, nodes, tenants=tenants, policy=policy).run()
                    entry[policy.name]["runs"].append(summarise(result))
                    entry[policy.name]["jobs"].extend(result.jobs)
    return results


def pooled(entries):
    """One policy's figures over several {"runs", "jobs"} entries."""
    runs = [r for e in entries for r in e["runs"]]
    jobs = [j for e in entries for j in e["jobs"] if j.finished_s is not None]
    queue = [j.queue_s for j in jobs]
    jct = [j.jct_s for j in jobs]
    waiting_capacity = sum(r["capacity_gpu_s_while_waiting"] for r in runs)
    return {
        "mean_queue_s": statistics.fmean(queue), "p95_queue_s": percentile(queue, 0.95),
        "queued_over_15_min": sum(q > 15 * 60 for q in queue),
        "mean_jct_s": statistics.fmean(jct), "p95_jct_s": percentile(jct, 0.95),
        "mean_run_s": statistics.fmean(j.spec.duration_s for j in jobs),
        "utilization": statistics.fmean(r["utilization"] for r in runs),
        "utilization_while_waiting": sum(r["busy_gpu_s_while_waiting"] for r in runs) / waiting_capacity,
        "idle_gpus_while_waiting": statistics.fmean(r["idle_gpus_while_waiting"] for r in runs),
        "jain_fairness": statistics.fmean(r["jain_fairness"] for r in runs),
        "partial_gangs": sum(r["partial_gangs"] for r in runs), "preemptions": sum(r["preemptions"] for r in runs),
        "lost_gpu_hours": sum(r["lost_gpu_hours"] for r in runs), "unfinished": sum(r["unfinished"] for r in runs),
        "jobs": len(jobs),
    }


# --- one cycle at scale -----------------------------------------------------------------------------
def big_snapshot(*, seed=7, nodes=1000, tenants=20, queued_jobs=10_000):
    """A busy 1,000-node cluster (up to 90% of GPUs running, placed by the scheduler itself) and 10,000
    queued jobs of the synthetic shape, from 20 tenants with equal quotas (borrowing allowed)."""
    rng = random.Random(seed)
    node_list = cluster(nodes)
    names = [f"tenant-{i:02d}" for i in range(tenants)]
    share = Resources(8 * nodes // tenants, 64.0 * nodes / tenants, 512 * GIB * nodes // tenants)
    policies = {n: TenantPolicy(n, quota=share, can_borrow=True, weight=1.0 + (i % 3)) for i, n in enumerate(names)}
    shapes = synthetic_trace(queued_jobs + 4000, seed=seed, cluster_gpus=8 * nodes, max_job_gpus=64)
    now = 1_000_000.0

    def workload(index, spec, **extra):
        return Workload(f"job-{index:06d}", rng.choice(names), f"user-{rng.randrange(200)}", spec.learners,
                        Resources(spec.gpus, spec.cpus, spec.memory_bytes), spec.priority, order=index, **extra)

    candidates, gpus = [], 0
    for i, spec in enumerate(shapes[:4000]):
        if gpus + spec.gpus * spec.learners <= 0.9 * 8 * nodes:
            candidates.append(workload(i, spec))
            gpus += spec.gpus * spec.learners
    filling = schedule(Snapshot(tuple(node_list), {}), candidates,
                       Policy(quotas=False, fair_share=False, preemption=False, reservations=0))
    by_id = {w.job_id: w for w in candidates}
    running = tuple(Workload(w.job_id, w.tenant, w.user, w.learners, w.per_learner, w.priority, order=w.order,
                             placement=tuple(filling.admitted[w.job_id]), started=now - rng.uniform(0, 86400))
                    for w in (by_id[j] for j in filling.admitted))
    queued = [workload(4000 + i, spec, queued_at=now - rng.uniform(0, 4 * 3600))
              for i, spec in enumerate(shapes[4000:])]
    return Snapshot(tuple(node_list), policies, running, now=now), queued


def time_cycles(snapshot, queued, policy):
    """(median ms, fastest ms, decisions) over TIMED_CYCLES cycles. The fastest is what the code
    costs when nothing else on the machine interferes (as timeit reports); the median is the headline."""
    timings = []
    for _ in range(TIMED_CYCLES):
        started = time.perf_counter()
        decisions = schedule(snapshot, queued, policy)
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings), min(timings), decisions


def main():
    started = time.monotonic()
    # Timed first: the simulations below leave millions of objects for the garbage collector to
    # walk, which a scheduling cycle inside the platform does not pay for.
    snapshot, queued = big_snapshot()
    busy = sum(len(p.gpu_ids) for w in snapshot.running for p in w.placement)
    cycle_ms, fastest_ms, decisions = time_cycles(snapshot, queued, Policy.full())
    kueue_ms, _, _ = time_cycles(snapshot, queued, Policy.kueue_like())
    fifo_ms, _, _ = time_cycles(snapshot, queued, Policy.fifo_spread())
    results = simulate_all()
    names = [p.name for p in POLICIES]
    overall = {n: pooled([results[scenario][n] for scenario in results]) for n in names}
    by_scenario = {scenario: {n: pooled([results[scenario][n]]) for n in names} for scenario in results}
    sweep = load_sweep()
    full, fifo, kueue = overall["full"], overall["fifo_spread"], overall["kueue_like"]
    head = by_scenario[HEADLINE]
    jct_ratio, floor = _jct_ratio(head["full"], head["fifo_spread"]), _floor(head["fifo_spread"])
    bursty = {n: pooled([results[s][n] for s in results if s != HEADLINE]) for n in names}

    rows = []
    for scenario, figures in [("all", overall)] + list(by_scenario.items()):
        for name in names:
            f = figures[name]
            label = f"{scenario} {name}"
            rows += [(f"{label}: queueing mean / p95 (min)", _minutes(f["mean_queue_s"], f["p95_queue_s"]), ""),
                     (f"{label}: JCT mean / p95 (min)", _minutes(f["mean_jct_s"], f["p95_jct_s"]), ""),
                     (f"{label}: GPU util. all / while jobs wait",
                      f"{f['utilization']:.3f} / {f['utilization_while_waiting']:.3f}", ""),
                     (f"{label}: mean idle GPUs while jobs wait", round(f["idle_gpus_while_waiting"], 1), ""),
                     (f"{label}: partial gangs / preemptions / Jain",
                      f"{f['partial_gangs']} / {f['preemptions']} / {f['jain_fairness']:.3f}", "")]
    rows += [(f"mean JCT full / fifo_spread ({HEADLINE}, load {LOAD})", round(jct_ratio, 3), shown("scheduler", "jct_ratio_vs_fifo_spread")),
             ("  floor: mean run time / fifo_spread mean JCT", round(floor, 3), "no scheduler can go below"),
             (f"mean JCT full / kueue_like ({HEADLINE})", round(_jct_ratio(head["full"], head["kueue_like"]), 3),
              shown("scheduler", "jct_ratio_vs_kueue_like")),
             ("mean JCT full / fifo_spread (bursty traces) / floor",
              f"{_jct_ratio(bursty['full'], bursty['fifo_spread']):.3f} / {_floor(bursty['fifo_spread']):.3f}", "")]
    rows += [(f"{HEADLINE} at load {load}: mean JCT full / fifo_spread / floor",
              f"{point['jct_ratio_vs_fifo_spread']:.3f} / {point['floor']:.3f}", "") for load, point in sweep.items()]
    rows += [
             ("jobs queued > 15 min: fifo_spread / full",
              f"{fifo['queued_over_15_min']} / {full['queued_over_15_min']}", ""),
             ("partial gangs (full)", full["partial_gangs"], shown("scheduler", "partial_gangs")),
             ("utilisation while jobs wait (full)", round(full["utilization_while_waiting"], 3), shown("scheduler", "utilization_while_waiting")),
             ("cycle ms, 10k queued, 1k nodes (full, median)", round(cycle_ms, 1), shown("scheduler", "cycle_ms_10k_jobs_1k_nodes")),
             ("  fastest of the same cycles", round(fastest_ms, 1), ""),
             ("cycle ms, same: kueue_like / fifo_spread", f"{kueue_ms:.1f} / {fifo_ms:.1f}", "")]
    publish("scheduler", rows, {
        "jct_ratio_vs_fifo_spread": round(jct_ratio, 4),
        "jct_ratio_floor": round(floor, 4),
        "jct_ratio_vs_kueue_like": round(_jct_ratio(head["full"], head["kueue_like"]), 4),
        "jct_ratio_vs_fifo_spread_bursty": round(_jct_ratio(bursty["full"], bursty["fifo_spread"]), 4),
        "jct_ratio_floor_bursty": round(_floor(bursty["fifo_spread"]), 4),
        "jct_ratio_by_load": {str(load): point for load, point in sweep.items()},
        "queue_ratio_vs_fifo_spread": round(head["full"]["mean_queue_s"] / head["fifo_spread"]["mean_queue_s"], 4),
        "queued_over_15_min_fifo_spread_vs_full": round(
            fifo["queued_over_15_min"] / max(full["queued_over_15_min"], 1), 2),
        "partial_gangs": full["partial_gangs"],
        "partial_gangs_fifo_spread": fifo["partial_gangs"],
        "utilization_while_waiting": round(full["utilization_while_waiting"], 4),
        "utilization_while_waiting_fifo_spread": round(fifo["utilization_while_waiting"], 4),
        "utilization_while_waiting_kueue_like": round(kueue["utilization_while_waiting"], 4),
        "jain_fairness": round(full["jain_fairness"], 4),
        "jain_fairness_fifo_spread": round(fifo["jain_fairness"], 4),
        "jain_fairness_kueue_like": round(kueue["jain_fairness"], 4),
        "cycle_ms_10k_jobs_1k_nodes": round(cycle_ms, 2),
        "cycle_ms_10k_jobs_1k_nodes_fastest": round(fastest_ms, 2),
        "cycle_ms_10k_jobs_1k_nodes_kueue_like": round(kueue_ms, 2),
        "cycle_ms_10k_jobs_1k_nodes_fifo_spread": round(fifo_ms, 2),
        "cycle_admitted": len(decisions.admitted), "cycle_preempted": len(decisions.preempt),
        "cycle_running_gpus_of_8000": busy,
        "scenarios": {scenario: {n: _rounded(f) for n, f in figures.items()}
                      for scenario, figures in by_scenario.items()},
        "traces": {"seeds": SEEDS, "scenarios": [
            {"name": n, "cluster": f"{nodes} nodes x 8 GPUs", "jobs_per_trace": jobs, "traces": per_seed * len(SEEDS),
             "load": load} for n, nodes, jobs, per_seed, load in SCENARIOS]},
        "bench_seconds": round(time.monotonic() - started, 1),
    })


def load_sweep():
    """The headline scenario at other loads (FIFO+spread and full only): {load: ratio and floor}."""
    _, nodes, jobs, per_seed, _ = SCENARIOS[0]
    points = {}
    for load in SWEEP:
        result = simulate_all([(HEADLINE, nodes, jobs, per_seed, load)], policies=(Policy.fifo_spread(), Policy.full()))
        fifo, full = pooled([result[HEADLINE]["fifo_spread"]]), pooled([result[HEADLINE]["full"]])
        points[load] = {"jct_ratio_vs_fifo_spread": round(_jct_ratio(full, fifo), 4), "floor": round(_floor(fifo), 4),
                        "mean_queue_s_fifo_spread": round(fifo["mean_queue_s"], 1),
                        "mean_queue_s_full": round(full["mean_queue_s"], 1)}
    return points


def _jct_ratio(figures, baseline):
    return figures["mean_jct_s"] / baseline["mean_jct_s"]


def _floor(baseline):
    return baseline["mean_run_s"] / baseline["mean_jct_s"]


def _minutes(mean_s, p95_s):
    return f"{mean_s / 60:.1f} / {p95_s / 60:.1f}"


def _rounded(figures):
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items()}


if __name__ == "__main__":
    main()
