"""recovery: how fast learners' output reaches the platform with nothing lost, and how quickly a
restarted platform settles jobs whose learners finished while it was down.

Ingest: one learner prints N lines as fast as it can. The sustained rate is the slope of lines stored
(sampled through the API) between 10% and 90% of N; the end-to-end rate is N over the time from the
job's PROCESSING event to its STORING event (the agent's exit record travels behind every line), which
also counts the learner's start-up and the job's end. The baseline is the same program writing the
same lines to a local file on this machine.
Restart: jobs keep running while web, worker and beat are stopped; they finish meanwhile; the
platform starts again and we time how long until every job is final.
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

from bench.report import publish
from bench.targets import shown
from tests.support.harness import start_session

LINES = int(os.environ.get("BENCH_INGEST_LINES", 200_000))
PRINTER = "import sys\nw = sys.stdout.write\nfor i in range(1, {n} + 1):\n    w(f'line {{i}} ' + 'x' * 60 + '\\n')\n"
RESTART_JOBS = int(os.environ.get("BENCH_RESTART_JOBS", 4))


def manifest(name, command, memory="1GiB"):
    block = "".join(f"    {line}\n" for line in command.splitlines())
    return f"name: {name}\ncpus: 1\nmemory: {memory}\nframework:\n  name: custom\n  command: |\n{block}"


def file_baseline_lines_per_s(n):
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "printer.py"
        program.write_text(PRINTER.format(n=n))
        with open(Path(tmp) / "out.log", "w") as out:
            started = time.monotonic()
            subprocess.run([sys.executable, str(program)], stdout=out, check=True)
            return n / (time.monotonic() - started)


def event_times(session, job_id):
    events = session.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    return {e["to_status"]: datetime.fromisoformat(e["time"]) for e in events}


def measure_ingest(session):
    command = "cat > printer.py <<'EOF'\n" + PRINTER.format(n=LINES) + "EOF\npython3 printer.py"
    job = session.submit("custom-shell", manifest_text=manifest("ingest", command))
    samples, sampler = sample_stored_lines(session, job["id"])
    done = session.wait_for(job["id"], timeout=900, poll=0.5)
    sampler.join(timeout=30)
    if done["status"] != "COMPLETED":
        raise RuntimeError(f"ingest job ended {done['status']}: {done['status_reason']}")
    times = event_times(session, job["id"])
    seconds = (times["STORING"] - times["PROCESSING"]).total_seconds()
    stored = session.all_logs(job["id"])
    texts = [line["line"] for line in stored]
    expected = {f"line {i} " + "x" * 60 for i in range(1, LINES + 1)}
    return {"seconds": seconds, "lines_per_s": LINES / seconds, "sustained_lines_per_s": sustained_rate(samples),
            "lost": len(expected - set(texts)), "duplicates": len(texts) - len(set(texts))}


def sample_stored_lines(session, job_id, every_s=0.2):
    """(time, lines stored) every `every_s` until the job is final, from a background thread.
    Light enough (5 requests/s) not to slow the web server it measures."""
    samples = []

    def run():
        while True:
            job = session.job(job_id)
            samples.append((time.monotonic(), job.get("log_lines", 0)))
            if job["status"] in ("COMPLETED", "FAILED", "TERMINATED"):
                return
            time.sleep(every_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return samples, thread


def sustained_rate(samples):
    """Lines per second while the stream flowed: the slope between 10% and 90% of the lines stored,
    which leaves out the learner's start-up and the end of the job (exit report, storing)."""
    low, high = 0.1 * LINES, 0.9 * LINES
    start = next((t, n) for t, n in samples if n >= low)
    end = next((t, n) for t, n in samples if n >= high)
    return (end[1] - start[1]) / (end[0] - start[0]) if end[0] > start[0] else float("nan")


def measure_restart(session):
    jobs = [session.submit("custom-shell", manifest_text=manifest(f"outlive-{i}", f"echo start; sleep {3 + i}; echo end"))
            for i in range(RESTART_JOBS)]
    for job in jobs:
        session.wait_for(job["id"], {"PROCESSING"}, timeout=60)
    for part in ("beat", "worker", "web"):
        session.platform.stop_process(part)
    time.sleep(4 + RESTART_JOBS)  # every learner finishes while nobody listens
    started = time.monotonic()
    session.platform.start_web()
    session.platform.start_worker()
    session.platform.start_beat()
    session.platform.wait_ready(60)
    for job in jobs:
        session.wait_for(job["id"], timeout=120, poll=0.1)
    return time.monotonic() - started, [session.job(j["id"])["status"] for j in jobs]


def main():
    baseline = file_baseline_lines_per_s(LINES)
    data_dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    backing = "postgresql+redis" if os.environ.get("DATABASE_URL", "").startswith("postgres") else "embedded"
    session = start_session(data_dir, TRAINYARD_RECONCILE_INTERVAL="1")
    try:
        ingest = measure_ingest(session)
        reconcile_s, statuses = measure_restart(session)
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    figures = {
        "ingest_lines_per_s": round(ingest["sustained_lines_per_s"]),
        "ingest_end_to_end_lines_per_s": round(ingest["lines_per_s"]),
        "file_lines_per_s": round(baseline),
        "ingest_vs_file_ratio": round(ingest["sustained_lines_per_s"] / baseline, 4),
        "lost_lines": ingest["lost"],
        "duplicate_lines": ingest["duplicates"],
        "reconcile_after_restart_s": round(reconcile_s, 2),
        "restart_job_statuses": statuses,
        "lines": LINES,
        "backing": backing,
    }
    target = shown("recovery" if backing == "embedded" else "recovery.postgresql", "ingest_lines_per_s")
    publish("recovery", [
        (f"ingest, one learner ({backing}), sustained lines/s", figures["ingest_lines_per_s"], target),
        ("  the same, PROCESSING → STORING incl. start and finish", figures["ingest_end_to_end_lines_per_s"], ""),
        ("baseline: same lines to a local file, lines/s", figures["file_lines_per_s"], ""),
        ("ingest ÷ file", figures["ingest_vs_file_ratio"], ""),
        ("lost lines", figures["lost_lines"], "0"),
        ("duplicate lines", figures["duplicate_lines"], "0"),
        ("restart → every job reconciled (s)", figures["reconcile_after_restart_s"], ""),
    ], figures)
