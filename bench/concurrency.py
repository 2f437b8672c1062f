"""concurrency: how job completion time grows with the number of jobs running at once (FfDL's Table 1).

Light jobs whose learner mostly waits (prints a line, sleeps BENCH_CONCURRENCY_SLEEP seconds, prints
another), so this machine's two cores measure the platform rather than training. They are submitted
1, 10, 40 and 100 at a time (BENCH_CONCURRENCY_LEVELS) to one freshly started platform on the
embedded defaults — web, Celery worker, beat, Redis and one learner agent per job, as `make demo`
runs them — on the local backend with a virtual GPU per job. Each level starts once the previous
one has finished. A job's completion time (JCT) is from the client's clock just before its submit
to the job's `finished_at`; the single-job level runs BENCH_CONCURRENCY_SINGLE times (median).

Beside the JCTs: what the platform's own processes (web + worker + beat + Redis, with the children
they reaped) and the learner agents used per job — CPU seconds from /proc, peak RSS sampled — and
the per-phase timeline (bench.timeline) of each level's median job.
"""
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from bench import timeline
from bench.report import median, percentile, publish
from bench.targets import shown
from tests.support.harness import start_session

LEVELS = tuple(int(n) for n in os.environ.get("BENCH_CONCURRENCY_LEVELS", "1,10,40,100").split(","))
SLEEP_S = float(os.environ.get("BENCH_CONCURRENCY_SLEEP", 30))
SINGLE_RUNS = int(os.environ.get("BENCH_CONCURRENCY_SINGLE", 3))
SUBMIT_THREADS = 16
ACTIVE = ("QUEUED", "PENDING", "DOWNLOADING", "PROCESSING", "STORING", "HALTING")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
MANIFEST = """
name: light-{n}
learners: 1
gpus: 1
cpus: 0.25
memory: 64MiB
framework:
  name: custom
  command: "echo started; sleep {sleep}; echo done"
"""


# --- what the processes used -----------------------------------------------------------------------
def proc_stat(pid):
    """(process group, CPU seconds incl. reaped children, RSS MB) of a process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    cpu = sum(int(v) for v in fields[11:15]) / CLOCK_TICK  # utime stime cutime cstime
    return int(fields[2]), cpu, int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Usage:
    """Samples the platform's process groups and the learner agents under data_dir until stopped."""

    def __init__(self, platform_pids, data_dir, every_s=0.25):
        """platform_pids: {part: pid} of the platform's processes, each the leader of its group."""
        self.parts = {pid: part for part, pid in platform_pids.items()}
        self.marker, self.every_s = str(data_dir).encode(), every_s
        self.platform_cpu = {}  # (part, pid) -> last CPU seconds seen (a process that exits keeps its last)
        self.agent_cpu = {}
        self.platform_peak_mb = 0.0
        self.agents_peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._sample()
        self.start_platform_cpu = dict(self.platform_cpu)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def platform_cpu_s(self):
        return sum(self.platform_cpu_by_part.values())

    @property
    def platform_cpu_by_part(self):
        used = {}
        for (part, pid), cpu in self.platform_cpu.items():
            used[part] = used.get(part, 0.0) + cpu - self.start_platform_cpu.get((part, pid), 0.0)
        return used

    @property
    def agent_cpu_s(self):
        return sum(self.agent_cpu.values())

    def _run(self):
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self):
        platform_mb = agents_mb = 0.0
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            stat = proc_stat(proc.name)
            if stat is None:
                continue
            group, cpu, rss = stat
            if group in self.parts:
                self.platform_cpu[(self.parts[group], proc.name)] = cpu
                platform_mb += rss
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"learner_agent" in cmdline and self.marker in cmdline:
                self.agent_cpu[proc.name] = cpu
                agents_mb += rss
        self.platform_peak_mb = max(self.platform_peak_mb, platform_mb)
        self.agents_peak_mb = max(self.agents_peak_mb, agents_mb)


# --- one level -------------------------------------------------------------------------------------
def run_level(session, count):
    """Submit `count` jobs at once, wait for all; [(job id, submitted_at, JCT s)] and the usage."""
    def submit(n):
        submitted_at = time.time()
        job = session.submit("custom-shell", manifest_text=MANIFEST.format(n=n, sleep=SLEEP_S))
        return job["id"], submitted_at

    with Usage(session.platform.pids(), session.data_dir) as usage:
        with ThreadPoolExecutor(min(count, SUBMIT_THREADS)) as pool:
            submitted = list(pool.map(submit, range(count)))
        finished = wait_all(session, [job_id for job_id, _ in submitted], timeout=SLEEP_S * 4 + 60 + count * 3)
    results = []
    for job_id, submitted_at in submitted:
        job = finished[job_id]
        if job["status"] != "COMPLETED":
            raise RuntimeError(f"{job_id} ended {job['status']}: {job['status_reason']}")
        results.append((job_id, submitted_at, datetime.fromisoformat(job["finished_at"]).timestamp() - submitted_at))
    return results, usage


def wait_all(session, job_ids, *, timeout):
    """Wait until every job is final; their JSON by id. Asks for the active jobs only, every other
    second, so the bench's own requests cost the web server little (JCTs come from the server's
    `finished_at`, not from when this loop notices)."""
    ours = set(job_ids)
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(2.0)
        active = {job["id"] for job in session.api("GET", "/api/v1/jobs/", params={
            "limit": 200, "status": ",".join(ACTIVE)}).json()["results"]}
        if not active & ours:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(active & ours)} of {len(ours)} jobs not final after {timeout:.0f}s")
    return {job_id: session.job(job_id) for job_id in job_ids}


def level_figures(session, count, runs):
    jcts = [jct for results, _ in runs for _, _, jct in results]
    jobs = sum(len(results) for results, _ in runs)
    ordered = sorted((jct, job_id, submitted_at) for results, _ in runs for job_id, submitted_at, jct in results)
    _, median_id, median_submitted = ordered[len(ordered) // 2]
    stamps = timeline.job_timeline(session.data_dir, session.tenant, median_id, submitted_at=median_submitted)
    return {
        "jobs": count,
        "jct_mean_s": round(sum(jcts) / len(jcts), 3),
        "jct_median_s": round(median(jcts), 3),
        "jct_p95_s": round(percentile(jcts, 0.95), 3),
        "platform_cpu_s_per_job": round(sum(u.platform_cpu_s for _, u in runs) / jobs, 4),
        "platform_cpu_s_per_job_by_part": {part: round(sum(u.platform_cpu_by_part.get(part, 0.0) for _, u in runs)
                                                       / jobs, 4) for part in runs[0][1].platform_cpu_by_part},
        "agent_cpu_s_per_job": round(sum(u.agent_cpu_s for _, u in runs) / jobs, 4),
        "platform_peak_rss_mb": round(max(u.platform_peak_mb for _, u in runs), 1),
        "agents_peak_rss_mb_per_job": round(max(u.agents_peak_mb for _, u in runs) / count, 1),
        "median_job_phases_s": {name: round(s, 3) for name, s in timeline.phases(stamps) if s is not None},
    }


def main():
    data_dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    env_backup = {k: os.environ.pop(k) for k in ("DATABASE_URL", "REDIS_URL") if k in os.environ}
    most = max(LEVELS)
    # Up to 100 jobs submitted at once: the bench measures the platform, not a tenant's intake limits.
    session = start_session(data_dir, TRAINYARD_LOCAL_GPUS=str(most), TRAINYARD_LOCAL_CPUS=str(most),
                            TRAINYARD_LOCAL_MEMORY_MB=str(most * 128), TRAINYARD_SUBMITS_PER_MINUTE="100000",
                            TRAINYARD_MAX_QUEUED_JOBS="100000")
    os.environ.update(env_backup)
    load_before = os.getloadavg()[0]
    levels = {}
    try:
        time.sleep(3)  # let the worker and beat settle
        for count in LEVELS:
            runs = [run_level(session, count) for _ in range(SINGLE_RUNS if count == 1 else 1)]
            levels[count] = level_figures(session, count, runs)
            print(f"{count:>4} at once: mean JCT {levels[count]['jct_mean_s']:.2f} s, "
                  f"p95 {levels[count]['jct_p95_s']:.2f} s", flush=True)
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    base = levels[min(LEVELS)]["jct_mean_s"]
    figures = {f"jct_ratio_{n}_vs_1": round(levels[n]["jct_mean_s"] / base, 4) for n in LEVELS if n != min(LEVELS)}
    figures.update(sleep_s=SLEEP_S, levels={str(n): f for n, f in levels.items()}, cpus=os.cpu_count(),
                   load_average_1m_before=round(load_before, 2), load_average_1m_after=round(os.getloadavg()[0], 2))
    rows = []
    for n, f in levels.items():
        rows += [(f"{n} at once: JCT mean / p95 (s)", f"{f['jct_mean_s']:.2f} / {f['jct_p95_s']:.2f}",
                  f"ratio {figures.get(f'jct_ratio_{n}_vs_1', 1.0):.3f}"),
                 (f"{n} at once: CPU s per job, platform / agent", f"{f['platform_cpu_s_per_job']:.3f} / "
                  f"{f['agent_cpu_s_per_job']:.3f}", ""),
                 (f"{n} at once: peak RSS MB, platform / agents per job", f"{f['platform_peak_rss_mb']:.0f} / "
                  f"{f['agents_peak_rss_mb_per_job']:.1f}", "")]
    rows += [(key, figures[key], target) for key, target in (("jct_ratio_40_vs_1", shown("concurrency", "jct_ratio_40_vs_1")),
                                                             ("jct_ratio_100_vs_1", shown("concurrency", "jct_ratio_100_vs_1"))) if key in figures]
    for n, f in levels.items():
        print(f"\nmedian job's phases at {n} at once (s):")
        for name, seconds in f["median_job_phases_s"].items():
            print(f"  {name:<52} {seconds:8.3f}")
    publish("concurrency", rows, figures)
