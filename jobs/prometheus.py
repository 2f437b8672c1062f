"""Prometheus `/metrics` for operators: django-prometheus's generic series plus Trainyard's own
(jobs.prometheus_series defines them), behind a bearer token.

Trainyard's counters and histograms are incremented in several processes — Celery workers (scheduling
cycles, admissions, preemptions, backend calls) and every web server (ingest, websockets) — while only
the web servers answer HTTP, often in other containers or pods. So they live in Redis, which every
process already reaches, rather than in prometheus_client's multiprocess mode (files in one directory
of one host, which a worker pod cannot share with a web pod). Any web replica then reports the
platform-wide totals: aggregate them across replicas with `max`, not `sum` (docs/operating.md, "Operating
Trainyard"). Gauges of what the database holds are read at scrape time instead (jobs.prometheus_series).

Recording never fails the caller: with Redis unreachable the increment is dropped and logged once a
minute (Redis down also stops Celery, so little is lost that anything else would have counted).
"""
import atexit
import collections
import contextlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings
from django.http import HttpResponse
from django_prometheus.middleware import PrometheusAfterMiddleware
from prometheus_client import REGISTRY, CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)
KEY_PREFIX = "trainyard:metrics:"
# A metric write must not stall ingest or a scheduling cycle behind a hanging Redis.
REDIS_TIMEOUT_S = 0.5
_clients = {}
_last_warning = [0.0]


def redis_client():
    url = settings.REDIS_URL
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                                                      socket_connect_timeout=REDIS_TIMEOUT_S)
    return client


def dropped(what):
    now = time.monotonic()
    if now - _last_warning[0] > 60:
        _last_warning[0] = now
        log.warning("metrics: could not record %s (Redis unreachable); dropped", what, exc_info=True)


@contextlib.contextmanager
def one_trip(what):
    """A pipeline for several metric writes, sent in one round trip when the block ends (ingest
    records two series on every post); with Redis unreachable they are dropped as one."""
    pipe = redis_client().pipeline(transaction=False)
    yield pipe
    try:
        pipe.execute()
    except redis.RedisError:
        dropped(what)
    finally:
        pipe.reset()


class Accumulated:
    """Metric writes of one process added up in memory and sent to Redis together every FLUSH_S by a
    thread, for series written on a hot path: ingest records two on every post, and a round trip to
    Redis per post is felt when the cores are saturated. Duck-types a one_trip() pipeline
    (SharedCounter.inc and SharedHistogram.observe take it as `trip`). A scrape sees the writes up
    to FLUSH_S late; a process that exits normally sends what it holds; one killed loses at most
    FLUSH_S of them, as it would lose the requests it was serving."""
    FLUSH_S = 1.0

    def __init__(self, what):
        self.what = what
        self._pending = collections.Counter()  # (key, field) -> amount
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()
        atexit.register(self.close)

    def hincrbyfloat(self, key, field, amount):
        with self._lock:
            self._pending[(key, field)] += amount
            if self._thread is None or self._thread.pid != os.getpid():  # started again in a forked child
                self._thread = threading.Thread(target=self._flush_forever, name=f"{self.what} metrics",
                                                daemon=True)
                self._thread.pid = os.getpid()
                self._thread.start()

    def flush(self):
        with self._lock:
            pending, self._pending = self._pending, collections.Counter()
        if not pending:
            return
        with one_trip(self.what) as pipe:
            for (key, field), amount in pending.items():
                pipe.hincrbyfloat(key, field, amount)

    def close(self):
        """Stop the thread, then send what is left (at exit). The thread ends first: a daemon thread
        still running at shutdown is frozen wherever it is, maybe holding the Redis pool's lock, which
        the interpreter's clean-up of the client then waits for forever (seen in the test suite)."""
        self._stop.set()
        if self._thread is not None and self._thread.pid == os.getpid():
            self._thread.join(timeout=5)
        self.flush()

    def _flush_forever(self):
        while not self._stop.wait(self.FLUSH_S):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad flush
                log.exception("metrics: could not send %s's writes", self.what)


def _field(labels):
    return json.dumps(list(labels))


@dataclass(frozen=True)
class SharedCounter:
    """A counter kept in Redis, one hash field per combination of label values."""
    name: str  # without `_total`, which the exposition adds
    help: str
    labels: tuple = ()
    # Label values shown at 0 before anything happened (a known, finite set; or a function giving
    # them), so dashboards and alerts see the series exist.
    initial: object = ()

    @property
    def key(self):
        return KEY_PREFIX + self.name

    def inc(self, *label_values, amount=1.0, trip=None):
        """`trip`: a one_trip() pipeline to add the write to, instead of a round trip of its own."""
        assert len(label_values) == len(self.labels), (self.name, label_values)
        with one_trip(self.name) if trip is None else contextlib.nullcontext(trip) as pipe:
            pipe.hincrbyfloat(self.key, _field(label_values), amount)

    def collect(self, client):
        family = CounterMetricFamily(self.name, self.help, labels=list(self.labels))
        values = {tuple(json.loads(f)): float(v) for f, v in client.hgetall(self.key).items()}
        for label_values in self.initial() if callable(self.initial) else self.initial:
            values.setdefault(tuple(label_values), 0.0)
        for label_values, value in sorted(values.items()):
            family.add_metric(list(label_values), value)
        return family


@dataclass(frozen=True)
class SharedHistogram:
    """A histogram kept in Redis: per combination of label values, one field per bucket (not
    cumulative; the exposition sums them), one for the sum of observations and one for their count."""
    name: str
    help: str
    buckets: tuple
    labels: tuple = ()

    @property
    def key(self):
        return KEY_PREFIX + self.name

    def observe(self, value, *label_values, trip=None):
        """`trip`: as for SharedCounter.inc."""
        assert len(label_values) == len(self.labels), (self.name, label_values)
        bucket = next((floatToGoString(b) for b in self.buckets if value <= b), "+Inf")
        with one_trip(self.name) if trip is None else contextlib.nullcontext(trip) as pipe:
            pipe.hincrbyfloat(self.key, _field([*label_values, "bucket", bucket]), 1)
            pipe.hincrbyfloat(self.key, _field([*label_values, "sum"]), value)

    def collect(self, client):
        family = HistogramMetricFamily(self.name, self.help, labels=list(self.labels))
        series = {}
        for raw, value in client.hgetall(self.key).items():
            parts = json.loads(raw)
            labels, rest = tuple(parts[:len(self.labels)]), parts[len(self.labels):]
            entry = series.setdefault(labels, {"buckets": {}, "sum": 0.0})
            if rest[0] == "sum":
                entry["sum"] = float(value)
            else:
                entry["buckets"][rest[1]] = float(value)
        for labels, entry in sorted(series.items()):
            cumulative, buckets = 0.0, []
            for bound in [*(floatToGoString(b) for b in self.buckets), "+Inf"]:
                cumulative += entry["buckets"].get(bound, 0.0)
                buckets.append((bound, cumulative))
            family.add_metric(list(labels), buckets, entry["sum"])
        return family


class SharedCollector:
    """Exposes shared series (and whatever `extra()` yields, read at scrape time) to prometheus_client."""

    def __init__(self, series, extra=None):
        self.series, self.extra = tuple(series), extra

    def describe(self):
        return []  # collected afresh every scrape; nothing to check at registration

    def collect(self):
        client = redis_client()
        for one in self.series:
            try:
                yield one.collect(client)
            except redis.RedisError:
                dropped(f"the scrape of {one.name}")
        if self.extra is not None:
            yield from self.extra()


def register(collector):
    """Add `collector` to the registry /metrics exposes (once, whatever reloads the app)."""
    if collector not in _registered:
        REGISTRY.register(collector)
        _registered.append(collector)


_registered = []


# The methods django-prometheus names in its labels; it counts any other as "<invalid method>".
HTTP_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "TRACE", "OPTIONS", "CONNECT", "PATCH"))


class RequestMetricsMiddleware(PrometheusAfterMiddleware):
    """django-prometheus's last middleware, with every `method` label one of HTTP_METHODS: its latency
    histogram takes the request's method as it came, and uvicorn's parser passes some forty (PROPFIND,
    MKCALENDAR, ...), so anyone could add a histogram per view for each to every web process and scrape.
    `label_metric` is the library's documented hook for labels."""

    def label_metric(self, metric, request, response=None, **labels):
        if labels.get("method", "GET") not in HTTP_METHODS:
            labels["method"] = "<invalid method>"
        return super().label_metric(metric, request, response, **labels)


def metrics_view(request):
    """The exposition, for whoever holds TRAINYARD_METRICS_TOKEN (`Authorization: Bearer …`).

    It names tenants and their load, which only the operator may see: without a token configured the
    endpoint does not exist (404), and a missing or wrong token is refused (401)."""
    token = settings.METRICS_TOKEN
    if not token:
        return HttpResponse("not found\n", status=404, content_type="text/plain")
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        response = HttpResponse("a bearer token is required (TRAINYARD_METRICS_TOKEN)\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
