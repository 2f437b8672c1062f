"""/metrics after real activity: a platform with 2 virtual GPUs runs two low-priority jobs, a
high-priority one preempts one of them, websockets are open, learners' lines are ingested; a scrape
then has every series docs/operating.md's table documents, with exactly its labels, and
values that match what happened."""
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from tests.support.harness import start_session
from tests.support.operating import documented_series

pytestmark = pytest.mark.e2e

RESUMABLE = Path(__file__).parent / "jobs" / "resumable"
TOKEN = "metrics-e2e-token"


def manifest(name, priority, steps):
    return (f"name: {name}\ngpus: 1\ncpus: 0.5\nmemory: 128MiB\npriority: {priority}\n"
            f"framework: {{name: custom, command: bash run.sh {steps}}}\n"
            f"checkpoint: {{signal: SIGTERM, grace_seconds: 10}}\n")


def scrape(session):
    response = requests.get(session.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(dict(sample.labels))
            samples[sample.name][-1]["__value__"] = sample.value
    return samples


def value(samples, name, **labels):
    matching = [s["__value__"] for s in samples.get(name, ()) if all(s.get(k) == v for k, v in labels.items())]
    assert matching, f"{name}{labels} not in the scrape"
    return sum(matching)


@pytest.fixture
def platform(tmp_path):
    # alice is a researcher: priority high is for tenant admins unless the platform says otherwise
    session = start_session(tmp_path, TRAINYARD_LOCAL_GPUS="2", TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_METRICS_TOKEN=TOKEN,
                            TRAINYARD_HIGH_PRIORITY="everyone")
    try:
        yield session
    finally:
        session.stop()


def test_it_reports_every_documented_series_after_real_activity(platform):
    session = platform
    assert requests.get(session.url + "/metrics", timeout=30).status_code == 401
    low = [session.submit(str(RESUMABLE), manifest_text=manifest(f"low-{i}", "low", 40))["id"] for i in range(2)]
    for job_id in low:
        session.wait_for(job_id, {"PROCESSING"}, timeout=90)
    ws = session.url.replace("http://", "ws://")
    with connect(f"{ws}/ws/jobs/?token={session.token}") as listing, \
            connect(f"{ws}/ws/jobs/{low[0]}/?token={session.token}") as page:
        page.recv(timeout=30)  # the job's snapshot: the socket is open and counted
        high = session.submit(str(RESUMABLE), manifest_text=manifest("urgent", "high", 30))["id"]
        # While the urgent job runs, the preempted one waits in the queue.
        deadline = time.monotonic() + 90
        while True:
            during = scrape(session)
            if value(during, "trainyard_queue_length", tenant="team-a", priority="low") >= 1:
                break
            assert time.monotonic() < deadline, "the preempted job was never seen queued"
            time.sleep(0.5)
        assert value(during, "trainyard_websocket_connections", stream="job") == 1
        assert value(during, "trainyard_websocket_connections", stream="list") == 1
        assert value(during, "trainyard_queue_oldest_wait_seconds", tenant="team-a") >= 0
        listing.recv(timeout=30)

    assert session.wait_for(high, timeout=120)["status"] == "COMPLETED"
    for job_id in low:
        assert session.wait_for(job_id, timeout=180)["status"] == "COMPLETED"
    lines = sum(len(session.all_logs(job_id)) for job_id in [*low, high])
    time.sleep(3)  # a socket's close is published by its server's gauge thread
    after = scrape(session)

    # Every documented series is there, with exactly the documented labels.
    for name, (kind, labels) in documented_series().items():
        exposed = {"counter": [name], "gauge": [name],
                   "histogram": [f"{name}_bucket", f"{name}_sum", f"{name}_count"]}[kind]
        for sample_name in exposed:
            assert after.get(sample_name), f"{sample_name} is documented but not exposed"
            for sample in after[sample_name]:
                got = set(sample) - {"__value__", "le"}
                assert got == labels, (sample_name, got, labels)

    # ...and the values are what happened: 3 jobs completed, 4 admissions (the preempted one twice).
    assert value(after, "trainyard_jobs", tenant="team-a", status="COMPLETED") == 3
    assert value(after, "trainyard_jobs", tenant="team-a", status="FAILED") == 0
    assert value(after, "trainyard_admissions_total", tenant="team-a") == 4
    assert value(after, "trainyard_preemptions_total", tenant="team-a") == 1
    assert value(after, "trainyard_queue_wait_seconds_count", tenant="team-a") == 4
    assert value(after, "trainyard_queue_length", tenant="team-a") == 0
    assert value(after, "trainyard_scheduling_cycle_seconds_count") >= 4
    # Lines include the agent's own notices, which the ingest counts too.
    assert value(after, "trainyard_ingest_lines_total", tenant="team-a") == lines
    assert value(after, "trainyard_ingest_lag_seconds_count") >= 3
    assert value(after, "trainyard_websocket_connections") == 0
    assert value(after, "trainyard_backend_errors_total", backend="local") == 0
    assert value(after, "django_http_responses_total_by_status_view_method_total", status="201", method="POST") >= 3
