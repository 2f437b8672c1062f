"""frameworks: what running through Trainyard costs for each framework, and what a second learner buys.

For each framework's example the same command runs bare (the thread settings the agent gives a
1-CPU learner, in a control group of the manifest's CPUs as its learner runs: bench.baseline) and
then through a freshly started platform on the embedded defaults (submit → COMPLETED, as a script
waiting with `trainyard.Client.wait` sees it). Each platform run sits between two bare runs, and
`overhead_ratio_<framework>` is the median of each platform run over the mean of the bare runs around
it (bench.baseline.measure_overhead), with its bootstrap 95% interval and the ratio of the two sides' medians
beside it; `overhead_ratio_vs_unlimited_<framework>` divides the platform's median by that of a bare
run without the CPU limit instead (it also counts the limit the manifest asked for). `tensorflow` runs
the Keras example under `framework: tensorflow` (the same program, timed bare again beside its own runs).
`ddp_2_learner_speedup` is the training throughput (samples/s over all learners, as the example
reports it) of the 2-learner PyTorch DDP job over the same job with 1 learner, both through the
platform. Frameworks whose packages are missing are left out and listed as skipped. Each ratio
comes from BENCH_FRAMEWORKS_RUNS platform runs (3), and from more for a short example: as many as
give its bare side MIN_BARE_S seconds in all (the sklearn example's 1 s runs: 9), since on this
machine a second's run moves by a tenth from one run to the next. `phases_s_<framework>` is the
median timeline of its platform runs (bench.timeline): where the fixed cost goes.
`fixed_cost_s` is that cost alone: submit → COMPLETED (as a script sees it) of a job whose command
prints two lines and exits, the median of BENCH_FRAMEWORKS_FIXED_RUNS (20), with its timeline in
`phases_s_fixed_cost`. Its runs are a second apart, as a platform's jobs are when each runs for a second
or more: a deploy has the next spare agent started half a second after it (jobs.backends.local).
"""
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import timeline
from bench.baseline import cpu_limited, measure_overhead
from bench.report import median, publish
from bench.targets import shown
from tests.support.harness import EXAMPLES, start_session

RUNS = int(os.environ.get("BENCH_FRAMEWORKS_RUNS", 3))
MIN_BARE_S = float(os.environ.get("BENCH_FRAMEWORKS_MIN_BARE_S", 10))
ONLY = [name for name in os.environ.get("BENCH_FRAMEWORKS", "").split(",") if name]  # e.g. "sklearn,jax"
DDP = os.environ.get("BENCH_FRAMEWORKS_DDP", "1") == "1"
# framework: (example, command, module it needs)
CASES = {
    "pytorch": ("pytorch-digits", "python train.py --epochs 4", "torch"),
    "keras": ("keras-digits", "python train.py --epochs 3", "tensorflow"),
    "tensorflow": ("keras-digits", "python train.py --epochs 3", "tensorflow"),
    "jax": ("jax-regression", "python train.py --steps 500", "jax"),
    "sklearn": ("sklearn-digits", "python train.py --epochs 10", "sklearn"),
    "custom": ("custom-shell", "bash run.sh", None),
}
# A global batch of 512 (256 per learner) so each step computes more than it communicates, as in
# real data-parallel training; the example's default (128) is tuned for learning, not throughput.
DDP_COMMAND = "python train.py --epochs 12 --global-batch 512"
FIXED_RUNS = int(os.environ.get("BENCH_FRAMEWORKS_FIXED_RUNS", 20))
FIXED_COMMAND = "echo start; echo end"
FIXED_GAP_S = 1.0


def manifest_for(example, command, *, framework=None, learners=None):
    text = (EXAMPLES / example / "manifest.yml").read_text()
    text = re.sub(r"(?m)^  command: .*$", f"  command: {command}", text)
    if framework:
        text = re.sub(r"(?m)^  name: .*$", f"  name: {framework}", text)
        text = re.sub(r"(?m)^  version: .*$", "  version: latest", text)
    if learners:
        text = re.sub(r"(?m)^learners: .*$", f"learners: {learners}", text)
    return text


def manifest_cpus(manifest):
    return float(re.search(r"(?m)^cpus: *([0-9.]+)", manifest).group(1))


def bare_seconds(example, command, cpus=None):
    """The example's command on its own, with the thread settings of a 1-CPU learner and, given
    `cpus`, held to that many CPUs as its learner would be."""
    if cpus is not None:
        with cpu_limited(cpus) as join:
            return _bare_seconds(example, command, preexec_fn=join)
    return _bare_seconds(example, command)


def _bare_seconds(example, command, preexec_fn=None):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "code"
        shutil.copytree(EXAMPLES / example, work)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   KERAS_BACKEND="tensorflow", CHECKPOINT_DIR=str(Path(tmp) / "ckpt"),
                   RESULT_DIR=str(Path(tmp) / "results"), DATA_DIR=str(Path(tmp) / "data"),
                   PYTHONPATH=str(EXAMPLES.parent), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        started = time.monotonic()
        subprocess.run(command, shell=True, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, preexec_fn=preexec_fn)
        return time.monotonic() - started


def platform_seconds(session, example, manifest, stamps=None):
    """Submit → COMPLETED as a script sees it (trainyard.Client.wait), and the job's id; its
    timeline goes to `stamps`."""
    submitted_at, started = time.time(), time.monotonic()
    job = session.submit(example, manifest_text=manifest)
    done = session.sdk().wait(job["id"], timeout=600)
    elapsed, seen_at = time.monotonic() - started, time.time()
    if done["status"] != "COMPLETED":
        raise RuntimeError(f"{example}: {job['id']} ended {done['status']}: {done['status_reason']}")
    if stamps is not None:
        stamps.append(timeline.job_timeline(session.data_dir, session.tenant, job["id"], submitted_at=submitted_at,
                                            seen_at=seen_at))
    return elapsed, job["id"]


def runs_for(bare_s):
    """How many runs of each side an example gets, from one bare run of it: RUNS, or enough for
    MIN_BARE_S seconds of bare runs."""
    return max(RUNS, math.ceil(MIN_BARE_S / max(bare_s, 0.1)))


def throughput(session, job_id):
    points = session.api("GET", f"/api/v1/jobs/{job_id}/metrics/").json()["results"]
    values = [p["value"] for p in points if p["name"] == "throughput_samples_per_s" and p["learner"] == 0]
    if not values:
        raise RuntimeError(f"{job_id} reported no throughput")
    return values[-1]


def main():
    unknown = set(ONLY) - set(CASES)
    if unknown:
        raise SystemExit(f"BENCH_FRAMEWORKS: no case {', '.join(sorted(unknown))}; choose from {', '.join(CASES)}")
    wanted = {name: case for name, case in CASES.items() if not ONLY or name in ONLY}
    available = {name: case for name, case in wanted.items() if case[2] is None or importlib.util.find_spec(case[2])}
    skipped = sorted(set(wanted) - set(available))
    data_dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    env_backup = {k: os.environ.pop(k) for k in ("DATABASE_URL", "REDIS_URL") if k in os.environ}
    session = start_session(data_dir, TRAINYARD_LOCAL_CPUS="4")
    os.environ.update(env_backup)
    bare, unlimited, through, ddp, stamps, fixed = {}, {}, {}, {}, {}, []
    try:
        for name, (example, command, _) in available.items():
            key = (example, command)
            manifest = manifest_for(example, command, framework=name if name == "tensorflow" else None)
            if key not in unlimited:
                # One untimed run first: the first import of a framework reads it from disk, which
                # would be charged to whichever side happened to run first.
                bare_seconds(example, command)
                unlimited[key] = []
            # Each platform run between two bare ones (bench.baseline.measure_overhead).
            bare[name], through[name] = [bare_seconds(example, command, manifest_cpus(manifest))], []
            for _ in range(runs_for(bare[name][0])):
                through[name].append(platform_seconds(session, example, manifest, stamps.setdefault(name, []))[0])
                unlimited[key].append(bare_seconds(example, command))
                bare[name].append(bare_seconds(example, command, manifest_cpus(manifest)))
        fixed_manifest = manifest_for("custom-shell", FIXED_COMMAND)
        for _ in range(FIXED_RUNS):
            time.sleep(FIXED_GAP_S)
            fixed.append(platform_seconds(session, "custom-shell", fixed_manifest, stamps.setdefault("fixed_cost", []))[0])
        for learners in (1, 2) if DDP else ():
            runs = [throughput(session, platform_seconds(session, "pytorch-ddp", manifest_for(
                "pytorch-ddp", DDP_COMMAND, learners=learners))[1]) for _ in range(RUNS)]
            ddp[learners] = median(runs)
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    figures, rows = {}, []
    for name, (example, command, _) in available.items():
        bare_s, through_s = median(bare[name]), median(through[name])
        measured = measure_overhead(through[name], bare[name])
        figures[f"overhead_ratio_{name}"] = round(measured.ratio, 4)
        figures[f"overhead_ratio_ci95_{name}"] = [round(measured.low, 4), round(measured.high, 4)]
        figures[f"overhead_ratio_of_medians_{name}"] = round(measured.ratio_of_medians, 4)
        figures[f"bare_wall_s_{name}"] = round(bare_s, 3)
        figures[f"bare_cpus_{name}"] = manifest_cpus(manifest_for(example, command))
        figures[f"overhead_ratio_vs_unlimited_{name}"] = round(through_s / median(unlimited[(example, command)]), 4)
        figures[f"platform_wall_s_{name}"] = round(through_s, 3)
        rows.append((f"{name} ({example}): bare / through Trainyard (s)", f"{bare_s:.1f} / {through_s:.1f}", ""))
        rows.append((f"overhead_ratio_{name}", figures[f"overhead_ratio_{name}"], shown("frameworks", f"overhead_ratio_{name}")))
        rows.append(("  95% interval / median ÷ median", "{:.3f}–{:.3f} / {:.3f}".format(
            *figures[f"overhead_ratio_ci95_{name}"], figures[f"overhead_ratio_of_medians_{name}"]), ""))
        rows.append(("  ÷ the bare run without a CPU limit", figures[f"overhead_ratio_vs_unlimited_{name}"], ""))
        figures[f"phases_s_{name}"] = phases = timeline.summarise(stamps[name])
        rows.append(("  submit → first line / last line → COMPLETED (median, s)",
                     f"{phases.get('submit_to_first_line_s', 0):.2f} / {phases.get('last_line_to_completed_s', 0):.2f}",
                     ""))
    if fixed:
        figures["fixed_cost_s"] = round(median(fixed), 4)
        figures["phases_s_fixed_cost"] = phases = timeline.summarise(stamps["fixed_cost"])
        rows.append((f"fixed_cost_s: a job that prints two lines, submit → COMPLETED (median of {len(fixed)})",
                     figures["fixed_cost_s"], ""))
        rows += timeline.rows(phases)
    if ddp:
        figures["ddp_1_learner_samples_per_s"] = round(ddp[1], 1)
        figures["ddp_2_learner_samples_per_s"] = round(ddp[2], 1)
        figures["ddp_2_learner_speedup"] = round(ddp[2] / ddp[1], 4)
    figures.update(runs=RUNS, runs_by_framework={name: len(values) for name, values in through.items()},
                   skipped_frameworks=skipped, cpus=os.cpu_count(),
                   load_average_1m=round(os.getloadavg()[0], 2))
    if ddp:
        rows += [("PyTorch DDP throughput, 1 learner (samples/s)", figures["ddp_1_learner_samples_per_s"], ""),
                 ("PyTorch DDP throughput, 2 learners (samples/s)", figures["ddp_2_learner_samples_per_s"], ""),
                 ("ddp_2_learner_speedup", figures["ddp_2_learner_speedup"], f"{os.cpu_count()} CPUs on this machine")]
    # A partial run (some frameworks, no DDP) is kept apart from the full run's headline figures.
    publish("frameworks" if not ONLY and DDP else "frameworks.partial", rows, figures)
