"""overhead: what running through Trainyard costs compared with running the same training bare.

The PyTorch example is run bare (same thread settings the agent gives a 1-CPU learner, and in a
control group of the manifest's 1 CPU, as its learner runs: bench.baseline) and submitted to a
freshly started platform on the embedded defaults (submit → COMPLETED as `trainyard.Client.wait`
sees it). Each platform run sits between two bare runs, and `overhead_ratio` is the median of each
platform run over the mean of the bare runs around it, with a bootstrap 95% interval
(bench.baseline.overhead); the ratio of the two sides' medians is reported beside it, and every run's
time is in `runs_s`. A bare run without the CPU limit is measured beside them
(`overhead_ratio_vs_unlimited`, a ratio of medians): that ratio also counts the limit the manifest
asked for. Each platform run's timeline (bench.timeline) says where the rest goes: the median of
every phase between submit and the learner's first line, and between its last line and COMPLETED.
Submit→PROCESSING latency is measured on short jobs; RSS figures come from /proc.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from bench import timeline
from bench.baseline import cpu_limited, overhead
from bench.report import median, percentile, publish
from tests.support.harness import EXAMPLES, start_session

EXAMPLE = "pytorch-digits"
EXAMPLE_CPUS = 1.0  # examples/pytorch-digits/manifest.yml
# Platform runs (each between two bare ones). 5 moved the ratio by ±0.02 from one bench run to the next.
RUNS = int(os.environ.get("BENCH_OVERHEAD_RUNS", 9))
LATENCY_JOBS = int(os.environ.get("BENCH_LATENCY_JOBS", 20))
QUICK_JOB = """
name: latency-probe
cpus: 1
memory: 512MiB
framework: {name: custom, command: "echo ready"}
"""


def bare_run_seconds(cpus=None):
    """The example alone; with `cpus`, held to that many CPUs as its learner would be."""
    if cpus is not None:
        with cpu_limited(cpus) as join:
            return _bare_run_seconds(preexec_fn=join)
    return _bare_run_seconds()


def _bare_run_seconds(preexec_fn=None):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "code"
        shutil.copytree(EXAMPLES / EXAMPLE, work)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CHECKPOINT_DIR=str(Path(tmp) / "ckpt"),
                   RESULT_DIR=str(Path(tmp) / "results"), PYTHONPATH=str(EXAMPLES.parent))
        started = time.monotonic()
        subprocess.run([sys.executable, "train.py", "--epochs", "8"], cwd=work, env=env, check=True,
                       stdout=subprocess.DEVNULL, preexec_fn=preexec_fn)
        return time.monotonic() - started


def platform_run_seconds(session, peak, stamps):
    submitted_at, started = time.time(), time.monotonic()
    job = session.submit(EXAMPLE)
    watcher = threading.Thread(target=_watch_agent_rss, args=(session, job["id"], peak), daemon=True)
    watcher.start()
    done = session.sdk().wait(job["id"], timeout=600)  # as a script sees it
    elapsed, seen_at = time.monotonic() - started, time.time()
    if done["status"] != "COMPLETED":
        raise RuntimeError(f"{job['id']} ended {done['status']}: {done['status_reason']}")
    stamps.append(timeline.job_timeline(session.data_dir, session.tenant, job["id"], submitted_at=submitted_at,
                                        seen_at=seen_at))
    return elapsed


def submit_to_processing_seconds(session):
    job = session.submit("custom-shell", manifest_text=QUICK_JOB)
    session.wait_for(job["id"], timeout=120, poll=0.05)
    events = session.api("GET", f"/api/v1/jobs/{job['id']}/events/").json()["results"]
    processing = next(e["time"] for e in events if e["to_status"] == "PROCESSING")
    return (datetime.fromisoformat(processing) - datetime.fromisoformat(job["created_at"])).total_seconds()


def _watch_agent_rss(session, job_id, peak):
    """Track the learner agent's own peak RSS (VmHWM) while it lives."""
    pid_file = next(iter(session.data_dir.glob(f"storage/*/{job_id}/attempt-1/learner-0")), None)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        pid_file = pid_file or next(iter(session.data_dir.glob(f"storage/*/{job_id}/attempt-1/learner-0")), None)
        try:
            pid = int((pid_file / "agent.pid").read_text())
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError, TypeError):
            if pid_file is not None and (pid_file / "exit.json").exists():
                return
            time.sleep(0.05)
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak.append(int(line.split()[1]) / 1024)
        time.sleep(0.1)


def process_tree_rss_mb(root_pids):
    """Sum of VmRSS over the process groups the platform started (each part leads its own group)."""
    groups = set(root_pids)
    total_kb = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) not in groups:
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total_kb / 1024


def main():
    bare_run_seconds()  # untimed: the first import of torch reads it from disk
    data_dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    env_backup = {k: os.environ.pop(k) for k in ("DATABASE_URL", "REDIS_URL") if k in os.environ}
    session = start_session(data_dir)  # the embedded defaults: SQLite + embedded Redis
    os.environ.update(env_backup)
    try:
        time.sleep(3)  # let the worker and beat settle before measuring idle memory
        idle_rss = process_tree_rss_mb(session.platform.pids().values())
        latencies = [submit_to_processing_seconds(session) for _ in range(LATENCY_JOBS)]
        peak, stamps, through, unlimited = [], [], [], []
        bare = [bare_run_seconds(EXAMPLE_CPUS)]
        for _ in range(RUNS):  # each platform run between two bare ones (bench.baseline.overhead)
            through.append(platform_run_seconds(session, peak, stamps))
            unlimited.append(bare_run_seconds())
            bare.append(bare_run_seconds(EXAMPLE_CPUS))
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    measured = overhead(through, bare)
    figures = {
        "overhead_ratio": round(measured.ratio, 4),
        "overhead_ratio_ci95": [round(measured.low, 4), round(measured.high, 4)],
        "overhead_ratio_of_medians": round(measured.ratio_of_medians, 4),
        "bare_wall_s_median": round(median(bare), 3),
        "bare_cpus": EXAMPLE_CPUS,
        "overhead_ratio_vs_unlimited": round(median(through) / median(unlimited), 4),
        "bare_unlimited_wall_s_median": round(median(unlimited), 3),
        "platform_wall_s_median": round(median(through), 3),
        "submit_to_processing_p50_s": round(percentile(latencies, 0.5), 4),
        "submit_to_processing_p95_s": round(percentile(latencies, 0.95), 4),
        "agent_rss_mb": round(max(peak), 1) if peak else None,
        "platform_idle_rss_mb": round(idle_rss, 1),
        "runs": RUNS,
        "latency_jobs": LATENCY_JOBS,
        "phases_s": timeline.summarise(stamps),
        "runs_s": {"bare": _rounded(bare), "platform": _rounded(through), "bare_unlimited": _rounded(unlimited)},
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    publish("overhead", [
        (f"bare training wall time at {EXAMPLE_CPUS:g} CPU (median, s)", figures["bare_wall_s_median"], ""),
        ("bare, no CPU limit (median, s)", figures["bare_unlimited_wall_s_median"], ""),
        ("through Trainyard, submit→COMPLETED (median, s)", figures["platform_wall_s_median"], ""),
        ("overhead ratio (median of each platform run ÷ the bare runs around it)", figures["overhead_ratio"],
         "target ≤ 1.02"),
        ("  95% interval of that median (bootstrap)", "{:.3f}–{:.3f}".format(*figures["overhead_ratio_ci95"]), ""),
        ("  median through Trainyard ÷ median bare", figures["overhead_ratio_of_medians"], ""),
        ("  ÷ the bare run without a CPU limit", figures["overhead_ratio_vs_unlimited"], ""),
        ("submit→PROCESSING p50 (s)", figures["submit_to_processing_p50_s"], "target ≤ 1 s"),
        ("submit→PROCESSING p95 (s)", figures["submit_to_processing_p95_s"], ""),
        ("learner agent peak RSS (MB)", figures["agent_rss_mb"], ""),
        ("platform idle RSS: web+worker+beat+Redis (MB)", figures["platform_idle_rss_mb"], ""),
        *timeline.rows(figures["phases_s"]),
    ], figures)


def _rounded(values):
    return [round(v, 3) for v in values]
