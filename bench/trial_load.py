"""trial_load: what one tenant's hyperparameter search costs the others, as their submit latency.

A freshly started platform (embedded defaults) with two tenants. Tenant team-b submits a small job
every PROBE_INTERVAL_S and times each POST /api/v1/jobs/ (upload included, as a script sees it), in
phases that alternate: quiet (nothing else), then with team-a's experiment running, a random search
whose trials (`sleep`) start at about 20 a minute, three at a time; each loaded phase has its own
experiment, killed at its end. The figure is the p95 over the loaded phases ÷ the p95 over the quiet
ones; the trials started per minute during the loaded phases are measured, not assumed. Alternating
phases spreads the machine's drift over both sides.
"""
import io
import os
import tarfile
import tempfile
import time

import requests

from bench.report import median, percentile, publish
from bench.targets import shown
from tests.support.harness import start_session

PHASES = ("quiet", "loaded", "quiet", "loaded")
PROBES = int(os.environ.get("BENCH_TRIAL_LOAD_PROBES", 60))  # submits per phase
PROBE_INTERVAL_S = 1.25  # 48 a minute: inside a tenant's default 60
TRIAL_SECONDS = 9  # with 3 at once and a trial's start and end, about 20 trials a minute
PROBE = b"name: probe\ncpus: 0.25\nmemory: 128MiB\nframework: {name: custom, command: \"echo ok\"}\n"
EXPERIMENT = f"""
name: load-sweep
cpus: 0.25
memory: 128MiB
framework: {{name: custom, command: "sleep {TRIAL_SECONDS}; echo lr {{{{hparams.lr}}}}"}}
hyperparameters: {{lr: {{type: log, minval: 0.0001, maxval: 0.1}}}}
searcher: {{name: random, metric: lr, max_trials: 1000, max_concurrent_trials: 3}}
""".encode()


def code_tar():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        data = b"echo ok\n"
        info = tarfile.TarInfo("run.sh")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def probe_phase(session, token):
    """PROBES timed submits, one every PROBE_INTERVAL_S; their latencies in ms."""
    code, latencies = code_tar(), []
    for _ in range(PROBES):
        started = time.monotonic()
        response = session.api("POST", "/api/v1/jobs/", token=token,
                               files={"manifest": ("m.yml", PROBE), "code": ("code.tar.gz", code)})
        elapsed = time.monotonic() - started
        if response.status_code != 201:
            raise RuntimeError(f"a probe submit answered {response.status_code}: {response.text[:300]}")
        latencies.append(elapsed * 1000)
        time.sleep(max(0.0, PROBE_INTERVAL_S - elapsed))
    return latencies


def trials_started(session, experiment_id):
    return session.api("GET", f"/api/v1/experiments/{experiment_id}/").json()["trials_started"]


def run():
    with tempfile.TemporaryDirectory(prefix="bench-trial-load-") as data_dir:
        session = start_session(data_dir, TRAINYARD_LOCAL_CPUS="8")
        try:
            other = session.add_member("team-b", "bob")
            by_phase, rates = [], []
            for phase in PHASES:
                experiment_id = None
                if phase == "loaded":
                    response = session.api("POST", "/api/v1/experiments/",
                                           files={"manifest": ("e.yml", EXPERIMENT), "code": ("c.tar.gz", code_tar())})
                    response.raise_for_status()
                    experiment_id = response.json()["id"]
                    time.sleep(TRIAL_SECONDS)  # its first trials under way before the probes begin
                    before, started = trials_started(session, experiment_id), time.monotonic()
                latencies = probe_phase(session, other)
                if experiment_id:
                    rates.append((trials_started(session, experiment_id) - before) / (time.monotonic() - started) * 60)
                    requests.post(f"{session.url}/api/v1/experiments/{experiment_id}/kill/",
                                  headers={"Authorization": f"Token {session.token}"}, timeout=60)
                    time.sleep(3)  # its trials torn down before the next quiet phase
                by_phase.append((phase, latencies))
        finally:
            session.stop()
    return by_phase, rates


def main():
    by_phase, rates = run()
    quiet = [ms for phase, latencies in by_phase if phase == "quiet" for ms in latencies]
    loaded = [ms for phase, latencies in by_phase if phase == "loaded" for ms in latencies]
    quiet_p95, loaded_p95 = percentile(quiet, 0.95), percentile(loaded, 0.95)
    figures = {
        "submit_p95_ms_quiet": round(quiet_p95, 1),
        "submit_p95_ms_with_trials": round(loaded_p95, 1),
        "submit_p95_ratio_with_trials": round(loaded_p95 / quiet_p95, 3),
        "submit_p50_ms_quiet": round(median(quiet), 1),
        "submit_p50_ms_with_trials": round(median(loaded), 1),
        "trials_per_minute": round(sum(rates) / len(rates), 1),
        "phases": [{"phase": phase, "p50_ms": round(median(latencies), 1), "p95_ms": round(percentile(latencies, 0.95), 1)}
                   for phase, latencies in by_phase],
        "probes_per_phase": PROBES,
    }
    publish("trial_load", [
        ("other tenant's submit p95, quiet (ms)", figures["submit_p95_ms_quiet"], ""),
        ("other tenant's submit p95, with trials (ms)", figures["submit_p95_ms_with_trials"], ""),
        ("p95 with trials ÷ quiet", figures["submit_p95_ratio_with_trials"],
         shown("trial_load", "submit_p95_ratio_with_trials")),
        ("trials started per minute", figures["trials_per_minute"], ""),
    ], figures)


if __name__ == "__main__":
    main()
