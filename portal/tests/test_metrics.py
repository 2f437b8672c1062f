"""/metrics: who may scrape it, and the Redis-shared series (jobs.prometheus, jobs.prometheus_series)
against a real Redis server (the embedded one `make demo` runs). The end-to-end scrape after real activity is
tests/e2e/test_metrics.py."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jobs import prometheus_series
from jobs import prometheus as shared
from jobs.backends.base import BackendError
from portal import runner
from tests.support.redis_server import RedisServer

TOKEN = "s3cret-scrape-token"


@pytest.fixture
def redis_url(settings, tmp_path):
    server = RedisServer(tmp_path).start()
    settings.REDIS_URL = server.url
    settings.METRICS_TOKEN = TOKEN
    try:
        yield server.url
    finally:
        server.stop()


def scrape(client, token=TOKEN):
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    return {f.name: f for f in text_string_to_metric_families(response.content.decode())}


def samples(family, suffix=""):
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == family.name + suffix}


@pytest.mark.django_db
def test_it_does_not_exist_without_a_token_configured(client, settings):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 404


@pytest.mark.django_db
def test_it_refuses_a_missing_or_wrong_token(client, settings):
    settings.METRICS_TOKEN = TOKEN
    for header in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": TOKEN},
                   {"HTTP_AUTHORIZATION": f"Token {TOKEN}"}):
        response = client.get("/metrics", **header)
        assert response.status_code == 401 and b"trainyard_" not in response.content
        assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.django_db
def test_it_counts_failing_backend_calls_by_operation(client, redis_url, settings):
    class Failing:
        name = "local"

        def deploy(self, spec):
            raise BackendError("node gone")

        def status(self, **kwargs):
            return []

    backend = prometheus_series.CountingBackend(Failing())
    for _ in range(2):
        with pytest.raises(BackendError):
            backend.deploy(None)
    assert backend.status() == [] and backend.name == "local"
    errors = samples(scrape(client)["trainyard_backend_errors"], "_total")
    assert errors[(("backend", settings.BACKEND), ("operation", "deploy"))] == 2
    # The other operations are shown at 0, so an alert on them has a series before the first error.
    assert errors[(("backend", settings.BACKEND), ("operation", "status"))] == 0
    assert len(errors) == len(prometheus_series.BACKEND_OPERATIONS)


@pytest.mark.django_db
def test_its_histograms_are_cumulative_with_sum_and_count(client, redis_url):
    for seconds in (0.5, 2, 2, 7200, 10 ** 6):
        prometheus_series.QUEUE_WAIT.observe(seconds, "team-a")
    family = scrape(client)["trainyard_queue_wait_seconds"]
    buckets = {dict(s.labels)["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets["1.0"] == 1 and buckets["5.0"] == 3 and buckets["14400.0"] == 4 and buckets["+Inf"] == 5
    assert samples(family, "_count") == {(("tenant", "team-a"),): 5}
    assert samples(family, "_sum") == {(("tenant", "team-a"),): pytest.approx(0.5 + 4 + 7200 + 10 ** 6)}


@pytest.mark.django_db
def test_ingest_posts_record_their_lines_and_lag_added_up_in_one_round_trip(client, redis_url, monkeypatch):
    sent = []
    execute = shared.redis.client.Pipeline.execute
    monkeypatch.setattr(shared.redis.client.Pipeline, "execute",
                        lambda pipe, *a, **kw: sent.append(len(pipe.command_stack)) or execute(pipe, *a, **kw))
    monkeypatch.setattr(prometheus_series, "INGEST_WRITES", shared.Accumulated("ingest"))
    monkeypatch.setattr(shared.Accumulated, "FLUSH_S", 0.2)
    prometheus_series.ingested("team-a", lines=7, oldest_time=time.time() - 0.3)
    prometheus_series.ingested("team-a", lines=5, oldest_time=time.time() - 0.4)
    prometheus_series.ingested("team-a", lines=0, oldest_time=None)  # nothing to record
    assert sent == []  # not on the post's time
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sent == [3]  # the counter, the histogram's bucket and its sum, each added up
    families = scrape(client)
    assert samples(families["trainyard_ingest_lines"], "_total") == {(("tenant", "team-a"),): 12}
    assert sum(samples(families["trainyard_ingest_lag_seconds"], "_count").values()) == 2


@pytest.mark.django_db
def test_a_process_sends_its_added_up_writes_when_it_exits(client, redis_url):
    # Well within the flush interval: only the exit can have sent them.
    code = ("import django; django.setup(); from jobs import prometheus_series; "
            "prometheus_series.ingested('team-b', lines=3, oldest_time=None)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2],
                   env={**os.environ, "REDIS_URL": redis_url, "DJANGO_SETTINGS_MODULE": "portal.settings"})
    assert samples(scrape(client)["trainyard_ingest_lines"], "_total")[(("tenant", "team-b"),)] == 3


@pytest.mark.django_db
def test_it_counts_the_sockets_of_live_processes_only(client, redis_url):
    gauge = prometheus_series.SocketGauge()
    gauge.opened("job")
    gauge.opened("job")
    gauge.opened("list")
    gauge.closed("job")
    gauge.publish()
    dead = shared.redis_client()
    dead.hset(prometheus_series.SocketGauge.KEY, mapping={"gone:1|job": 40})
    dead.hset(prometheus_series.SocketGauge.SEEN_KEY, "gone:1",
              time.time() - prometheus_series.SocketGauge.STALE_S - 1)
    sockets = samples(scrape(client)["trainyard_websocket_connections"])
    assert sockets == {(("stream", "job"),): 1, (("stream", "list"),): 1}


@pytest.mark.django_db
def test_recording_without_redis_neither_fails_nor_blocks(settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{runner.free_port()}/0"
    started = time.monotonic()
    prometheus_series.ADMISSIONS.inc("team-a")
    prometheus_series.INGEST_LAG.observe(1.0)
    assert time.monotonic() - started < 2 * shared.REDIS_TIMEOUT_S + 0.5


@pytest.mark.django_db
def test_it_keeps_methods_the_platform_does_not_serve_out_of_its_labels(client):
    # uvicorn's parser takes some forty methods (PROPFIND, MKCALENDAR, ...): anyone, signed in or not,
    # could otherwise add a latency histogram per view for each of them to every web process.
    for method in ("PROPFIND", "MKCALENDAR", "SEARCH"):
        client.generic(method, "/api/v1/jobs/")
    exposition = generate_latest(REGISTRY).decode()
    assert not [line for line in exposition.splitlines()
                if any(f'method="{method}"' in line for method in ("PROPFIND", "MKCALENDAR", "SEARCH"))]
    assert 'django_http_requests_latency_seconds_by_view_method_count{method="<invalid method>",view="job-list"}' \
        in exposition
