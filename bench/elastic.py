"""elastic: the elastic optimizer's policies (gpu_scheduler/elastic.py) on the same seeded traces
through the elastic simulator (bench/simulator/elastic.py), on Pollux's eight workloads at four
loads replayed with physics from its measured traces (bench/simulator/pollux_replay.py), plus
the cost of one optimizer call for 500 jobs on 4,096 GPUs.

Pollux's workloads: every policy (Tiresias+TunedJobs, gpu_only, paper, trainyard) on every workload
and load, each replay in its own process (as many as there are CPUs). `pollux_workloads_*` figures are
Trainyard's policy, averaged over the 8 workloads as Pollux averages (the mean of each workload's
mean, p99 and makespan); `mean_jct_ratio_vs_pollux_published_<load>` divides that mean by Pollux's
published mean, `tiresias_replay_vs_published_<load>` our Tiresias's by Tiresias's published mean
(both computed here from the published per-job JCTs). `pollux_replay` has every policy's figures, and
`trainyard_free_restarts` Trainyard's with re-allocations costing nothing (what its restarts cost it).

Cluster: 16 nodes x 4 GPUs (FfDL's 4-GPU nodes). Traces: BENCH_ELASTIC_JOBS jobs per trace, one per
seed (BENCH_ELASTIC_SEEDS), offered at each load of BENCH_ELASTIC_LOADS (the first is "light", the
last "overloaded"), 60 s restarts, admission limit 32 jobs in the system. Sweeps at the overloaded
load: admission limits, restart costs (30-300 s), and the profiles' gradient noise scales x0.25 / x4
(the noise scales are our choice, so the result's sensitivity to them is shown).

The paper's figures compare its own DP (`paper`) with `gpu_only`, so the SPEC keys without a suffix
are `paper` vs `gpu_only`; `_trainyard` keys are the same for Trainyard's policy. Every figure is the
mean over seeds of the per-seed value, with its min and max over seeds (`_spread`); `_efficiency_off`
is the same with the statistical-efficiency model off (jobs are a fixed number of epochs).
"""
import os
import random
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from bench.report import percentile, publish
from gpu_scheduler.elastic import POLICIES, ElasticCluster, ElasticJob, ElasticPolicy, optimize
from bench.simulator import pollux
from bench.simulator.elastic import PROFILES, elastic_trace, run_elastic
from bench.simulator.pollux_replay import REPLAY_POLICIES, RESTART_S, replay

SEEDS = [int(s) for s in os.environ.get("BENCH_ELASTIC_SEEDS", "1,2,3").split(",")]
JOBS = int(os.environ.get("BENCH_ELASTIC_JOBS", 200))
LOADS = [float(x) for x in os.environ.get("BENCH_ELASTIC_LOADS", "0.5,1,2,4").split(",")]
LIMIT = 32
LIMITS = (16, 64)
RESTARTS = (30.0, 300.0)
NOISE = (0.25, 4.0)
NODES = {f"node-{i:02d}": 4 for i in range(16)}
CHART = Path(__file__).resolve().parent.parent / "docs" / "elastic-jct-vs-load.svg"


def simulate(load, seed, policy, *, efficiency_model=True, limit=LIMIT, restart_s=60.0, noise=1.0):
    trace = elastic_trace(JOBS, seed=seed, cluster_gpus=sum(NODES.values()), load=load)
    if noise != 1.0:
        trace = [replace(j, profile=replace(j.profile, noise_scale=j.profile.noise_scale * noise)) for j in trace]
    result = run_elastic(trace, NODES, policy=ElasticPolicy(policy), restart_s=restart_s,
                         efficiency_model=efficiency_model, admission_limit=limit, seed=seed)
    return {"completed": result.completed_by_horizon(), "dropped": result.dropped(),
            "mean_jct_s": result.mean_jct_s(), "restarts_per_job": result.restarts_per_job()}


def sweep(loads, policies, **kwargs):
    """{(load, policy): [per-seed dict]}"""
    return {(load, p): [simulate(load, seed, p, **kwargs) for seed in SEEDS] for load in loads for p in policies}


def per_seed(runs, a, b, key, invert=False):
    """Per-seed ratio a/b of `key` (b/a with invert); None where the denominator is 0."""
    out = []
    for x, y in zip(runs[a], runs[b]):
        num, den = (y[key], x[key]) if invert else (x[key], y[key])
        out.append(num / den if den else None)
    return out


def summary(values):
    """(mean, [min, max]) over seeds, ignoring undefined ratios."""
    defined = [v for v in values if v is not None]
    if not defined:
        return None, None
    return round(statistics.fmean(defined), 3), [round(min(defined), 3), round(max(defined), 3)]


def headline(runs, light, heavy, suffix=""):
    figures = {}

    def put(name, values):
        figures[name + suffix], figures[name + suffix + "_spread"] = summary(values)

    for elastic, tag in (("paper", ""), ("trainyard", "_trainyard")):
        put("jobs_completed_ratio_vs_gpu_only" + tag, per_seed(runs, (heavy, elastic), (heavy, "gpu_only"), "completed"))
        put("mean_jct_ratio_gpu_only_over_elastic" + tag,
            per_seed(runs, (heavy, elastic), (heavy, "gpu_only"), "mean_jct_s", invert=True))
        put("dropped_ratio_gpu_only_over_elastic" + tag,
            per_seed(runs, (heavy, elastic), (heavy, "gpu_only"), "dropped", invert=True))
        put("mean_jct_ratio_elastic_over_fixed_low_load" + tag,
            per_seed(runs, (light, elastic), (light, "fixed"), "mean_jct_s"))
        # The paper says "up to": the largest mean ratio over the loads swept, and at which load.
        by_load = {load: summary(per_seed(runs, (load, elastic), (load, "gpu_only"), "mean_jct_s", invert=True))[0]
                   for load in sorted({load for load, _ in runs})}
        top = max(by_load, key=by_load.get)
        figures[f"mean_jct_ratio_gpu_only_over_elastic{tag}_max_over_loads{suffix}"] = [by_load[top], top]
    put("mean_jct_gain_over_paper_policy",
        [1 - r for r in per_seed(runs, (heavy, "trainyard"), (heavy, "paper"), "mean_jct_s")])
    put("restarts_per_job", [r["restarts_per_job"] for r in runs[(heavy, "trainyard")]])
    put("restarts_per_job_paper", [r["restarts_per_job"] for r in runs[(heavy, "paper")]])
    return figures


def table(runs, label):
    rows = []
    for (load, policy), seeds in sorted(runs.items()):
        jct = [s["mean_jct_s"] / 3600 for s in seeds]
        rows.append((f"{label} load {load:g} {policy}: mean JCT h (min-max) / completed / dropped / restarts",
                     f"{statistics.fmean(jct):.2f} ({min(jct):.2f}-{max(jct):.2f})",
                     f"{statistics.fmean(s['completed'] for s in seeds):.0f} / "
                     f"{statistics.fmean(s['dropped'] for s in seeds):.0f} / "
                     f"{statistics.fmean(s['restarts_per_job'] for s in seeds):.2f}"))
    return rows


def curves(runs):
    """{policy: [(load, mean JCT h, min, max)]} for the chart and the JSON."""
    out = {}
    for (load, policy), seeds in sorted(runs.items()):
        jct = [s["mean_jct_s"] / 3600 for s in seeds]
        out.setdefault(policy, []).append((load, round(statistics.fmean(jct), 3), round(min(jct), 3),
                                           round(max(jct), 3)))
    return out


# --- one optimizer call at scale ------------------------------------------------------------------------
def big_problem(seed=3):
    rng = random.Random(seed)
    jobs = []
    for i in range(500):
        profile, per = rng.choice(PROFILES), rng.choice([1, 1, 2])
        running = {}
        jobs.append(ElasticJob(f"job-{i:03d}", f"tenant-{i % 8}", 1, 64 // per, per, profile.base_batch,
                               profile.base_batch // 8, profile.base_batch * 32,
                               requested_learners=rng.choice([1, 2, 4]), max_local_batch=256, model=profile.model,
                               noise_scale=profile.noise_scale, order=i, **running))
    nodes = {f"node-{i:04d}": 8 for i in range(512)}
    return jobs, ElasticCluster(nodes, {f"tenant-{i}": 4096 // 6 for i in range(8)})


def time_optimizer(policy, repeats=5):
    jobs, cluster = big_problem()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        optimize(jobs, cluster, ElasticPolicy(policy), now=1000.0)
        timings.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(timings), 1), round(min(timings), 1)


# --- Pollux's workloads --------------------------------------------------------------------------------
def pollux_run(task):
    load, number, policy, restart_s = task
    result = replay(pollux.workload(number, load), policy, restart_s=restart_s)
    return {"mean_jct_s": result.mean_jct_s(), "p99_jct_s": result.p99_jct_s(), "makespan_s": result.makespan_s(),
            "restarts_per_job": result.restarts_per_job()}


def published_figures(policy, load):
    """Pollux's published JCTs, averaged like ours: per workload mean, p99 and makespan (from the
    workload's arrival times), then the mean over workloads."""
    per = pollux.published(policy, load)
    stats = []
    for number, jcts in sorted(per.items()):
        arrivals = {job.name: job.arrival_s for job in pollux.workload(number, load)}
        values = list(jcts.values())
        stats.append({"mean_jct_s": statistics.fmean(values), "p99_jct_s": percentile(values, 0.99),
                      "makespan_s": max(arrivals[n] + jct for n, jct in jcts.items()) - min(arrivals.values())})
    return {key: statistics.fmean(s[key] for s in stats) for key in stats[0]}


def pollux_figures():
    """Every policy on every workload and load; figures as the module docstring says."""
    # Trainyard once more with re-allocations free: how much of its JCT its restarts cost.
    variants = [(policy, RESTART_S) for policy in REPLAY_POLICIES] + [("trainyard", 0.0)]
    tasks = [(load, number, policy, restart) for load in reversed(pollux.LOADS) for policy, restart in variants
             for number in pollux.WORKLOADS]  # heaviest first, so the processes finish together
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {(load, number, policy) if restart == RESTART_S else (load, number, "trainyard_free_restarts"): run
                for (load, number, policy, restart), run in zip(tasks, pool.map(pollux_run, tasks))}
    figures, table_rows, by_policy = {}, [], {}
    for load in pollux.LOADS:
        published = {name: published_figures(name, load) for name in pollux.PUBLISHED_POLICIES}
        for policy in (*REPLAY_POLICIES, "trainyard_free_restarts"):
            per_workload = [runs[(load, number, policy)] for number in pollux.WORKLOADS]
            means = {key: statistics.fmean(r[key] for r in per_workload) for key in per_workload[0]}
            means["ratio_vs_pollux_published"] = means["mean_jct_s"] / published["pollux"]["mean_jct_s"]
            by_policy.setdefault(policy, {})[load] = {key: round(value, 3) for key, value in means.items()}
            table_rows.append((f"pollux load {load} {policy}: mean / p99 JCT s, makespan s, restarts per job",
                               f"{means['mean_jct_s']:.0f} / {means['p99_jct_s']:.0f}",
                               f"{means['makespan_s']:.0f}, {means['restarts_per_job']:.2f}"))
        ours = by_policy["trainyard"][load]
        figures[f"pollux_workloads_mean_jct_s_{load}"] = round(ours["mean_jct_s"])
        figures[f"mean_jct_ratio_vs_pollux_published_{load}"] = round(ours["ratio_vs_pollux_published"], 3)
        figures[f"pollux_workloads_p99_jct_s_{load}"] = round(ours["p99_jct_s"])
        figures[f"pollux_workloads_makespan_s_{load}"] = round(ours["makespan_s"])
        figures[f"mean_jct_ratio_vs_pollux_published_{load}_free_restarts"] = round(
            by_policy["trainyard_free_restarts"][load]["ratio_vs_pollux_published"], 3)
        figures[f"tiresias_replay_vs_published_{load}"] = round(
            by_policy["tiresias"][load]["mean_jct_s"] / published["tiresias"]["mean_jct_s"], 3)
        for name, values in published.items():
            figures[f"{name}_published_mean_jct_s_{load}"] = round(values["mean_jct_s"])
        figures[f"pollux_published_p99_jct_s_{load}"] = round(published["pollux"]["p99_jct_s"])
        figures[f"pollux_published_makespan_s_{load}"] = round(published["pollux"]["makespan_s"])
    figures["pollux_replay"] = by_policy
    return figures, table_rows


# --- chart ----------------------------------------------------------------------------------------------
COLOURS = {"fixed": "#777777", "gpu_only": "#1f77b4", "paper": "#d62728", "trainyard": "#2ca02c"}


def svg_chart(panels, path):
    """Mean JCT against load, one line per policy, min-max over seeds as error bars; one panel per
    efficiency setting. Plain SVG so the bench needs no plotting library."""
    width, height, pad = 360, 260, 46
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" height="{height + 30}" '
             f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for index, (title, data) in enumerate(panels):
        x0 = index * width
        loads = sorted({p[0] for series in data.values() for p in series})
        top = max(p[3] for series in data.values() for p in series) * 1.1

        def sx(load):
            return x0 + pad + (loads.index(load) / max(1, len(loads) - 1)) * (width - 2 * pad)

        def sy(value):
            return pad / 2 + (1 - value / top) * (height - pad)

        parts.append(f'<text x="{x0 + width / 2}" y="14" text-anchor="middle" font-weight="bold">{title}</text>')
        parts.append(f'<line x1="{x0 + pad}" y1="{sy(0)}" x2="{x0 + width - pad}" y2="{sy(0)}" stroke="black"/>')
        parts.append(f'<line x1="{x0 + pad}" y1="{sy(0)}" x2="{x0 + pad}" y2="{sy(top)}" stroke="black"/>')
        for tick in range(5):
            value = top * tick / 4
            parts.append(f'<text x="{x0 + pad - 4}" y="{sy(value) + 4}" text-anchor="end">{value:.1f}</text>')
        for load in loads:
            parts.append(f'<text x="{sx(load)}" y="{sy(0) + 14}" text-anchor="middle">{load:g}</text>')
        parts.append(f'<text x="{x0 + width / 2}" y="{height + 14}" text-anchor="middle">offered load '
                     f'(x cluster GPUs)</text>')
        parts.append(f'<text x="{x0 + 12}" y="{height / 2}" transform="rotate(-90 {x0 + 12} {height / 2})" '
                     f'text-anchor="middle">mean JCT (h)</text>')
        for row, (policy, series) in enumerate(sorted(data.items())):
            colour = COLOURS.get(policy, "black")
            points = " ".join(f"{sx(p[0]):.1f},{sy(p[1]):.1f}" for p in series)
            parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
            for load, _, low, high in series:
                parts.append(f'<line x1="{sx(load):.1f}" y1="{sy(low):.1f}" x2="{sx(load):.1f}" y2="{sy(high):.1f}" '
                             f'stroke="{colour}"/>')
            # Legend bottom right: every curve here rises from light load, so that corner stays empty.
            legend_y = sy(0) - 8 - 13 * (len(data) - 1 - row)
            parts.append(f'<text x="{x0 + width - pad - 60}" y="{legend_y}" fill="{colour}">{policy}</text>')
    parts.append("</svg>")
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def main():
    started = time.monotonic()
    replay_figures, replay_rows = pollux_figures()
    replay_s = time.monotonic() - started
    # The machine is shared: CPU time says what the replay costs whatever else runs beside it.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    optimizer_ms, optimizer_fastest = time_optimizer("trainyard")
    paper_ms, _ = time_optimizer("paper")
    light, heavy = LOADS[0], LOADS[-1]
    on = sweep(LOADS, POLICIES)
    off = sweep(LOADS, POLICIES, efficiency_model=False)
    limits = {limit: sweep([heavy], POLICIES, limit=limit) for limit in LIMITS}
    restarts = {cost: sweep([heavy], ("gpu_only", "paper", "trainyard"), restart_s=cost) for cost in RESTARTS}
    noise = {factor: sweep([heavy], ("gpu_only", "paper", "trainyard"), noise=factor) for factor in NOISE}
    figures = headline(on, light, heavy)
    figures.update(headline(off, light, heavy, "_efficiency_off"))
    figures.update(optimizer_ms_500_jobs_4096_gpus=optimizer_ms, optimizer_ms_500_jobs_4096_gpus_fastest=optimizer_fastest,
                   optimizer_ms_500_jobs_4096_gpus_paper=paper_ms)
    for limit, runs in limits.items():
        sub = headline({**runs, **{(light, p): on[(light, p)] for p in POLICIES}}, light, heavy, f"_limit_{limit}")
        figures.update({k: v for k, v in sub.items() if "low_load" not in k})
    for cost, runs in restarts.items():
        for name in ("paper", "trainyard"):
            figures[f"mean_jct_ratio_gpu_only_over_{name}_restart_{cost:g}s"] = summary(
                per_seed(runs, (heavy, name), (heavy, "gpu_only"), "mean_jct_s", invert=True))[0]
        figures[f"mean_jct_gain_over_paper_policy_restart_{cost:g}s"] = summary(
            [1 - r for r in per_seed(runs, (heavy, "trainyard"), (heavy, "paper"), "mean_jct_s")])[0]
        figures[f"restarts_per_job_restart_{cost:g}s"] = summary(
            [r["restarts_per_job"] for r in runs[(heavy, "trainyard")]])[0]
    for factor, runs in noise.items():
        for name in ("paper", "trainyard"):
            figures[f"mean_jct_ratio_gpu_only_over_{name}_noise_x{factor:g}"] = summary(
                per_seed(runs, (heavy, name), (heavy, "gpu_only"), "mean_jct_s", invert=True))[0]
        figures[f"mean_jct_gain_over_paper_policy_noise_x{factor:g}"] = summary(
            [1 - r for r in per_seed(runs, (heavy, "trainyard"), (heavy, "paper"), "mean_jct_s")])[0]
    figures["jct_vs_load_h"] = {"efficiency_on": curves(on), "efficiency_off": curves(off)}
    figures["limit_sweep"] = {str(limit): {f"{p} completed/dropped/jct_h": [
        round(statistics.fmean(s["completed"] for s in runs[(heavy, p)]), 1),
        round(statistics.fmean(s["dropped"] for s in runs[(heavy, p)]), 1),
        round(statistics.fmean(s["mean_jct_s"] for s in runs[(heavy, p)]) / 3600, 3)] for p in POLICIES}
        for limit, runs in {**limits, LIMIT: {(heavy, p): on[(heavy, p)] for p in POLICIES}}.items()}
    figures.update(replay_figures, pollux_replay_seconds=round(replay_s, 1),
                   pollux_replay_cpu_seconds=round(children.ru_utime + children.ru_stime, 1))
    figures.update(light_load=light, overloaded_load=heavy, admission_limit=LIMIT, restart_s=60.0, seeds=SEEDS,
                   jobs_per_trace=JOBS, cluster="16 nodes x 4 GPUs", seconds=round(time.monotonic() - started, 1),
                   cpu_seconds=round(time.process_time() + children.ru_utime + children.ru_stime, 1))
    svg_chart([("efficiency model on", curves(on)), ("efficiency model off (fixed epochs)", curves(off))], CHART)
    rows = replay_rows + table(on, "eff on") + table(off, "eff off")
    rows += [(k, v, "") for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    publish("elastic", rows, figures)


if __name__ == "__main__":
    main()
