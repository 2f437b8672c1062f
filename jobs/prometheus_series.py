"""Trainyard's own Prometheus series (docs/operating.md, "Operating Trainyard", lists them): the one place that
names them. Counters and histograms of work done in any process are shared through Redis
(jobs.prometheus explains why); gauges of what the database holds are computed when scraped.

Tenant slugs appear as a label: /metrics is for the operator only (jobs.prometheus.metrics_view).
"""
import os
import socket
import threading
import time

from django.conf import settings
from django.db import transaction
from datetime import timedelta

from django.db.models import Count, Max, Min
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from jobs import prometheus as shared
from jobs.models import ACTIVE, Job, ResourceSample, Status
from trainyard.manifest import PRIORITIES

BACKEND_OPERATIONS = ("deploy", "status", "halt", "delete", "capacity")
SOCKET_STREAMS = ("job", "list")
# Seconds: from a cycle of a few milliseconds to one stuck behind a slow backend.
CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Seconds a job waited in the queue: from an idle cluster to a day's backlog.
WAIT_BUCKETS = (1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600)
# Seconds from a learner printing a line to the platform storing it (the agent sends its lines in batches).
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

SCHEDULING_CYCLE = shared.SharedHistogram(
    "trainyard_scheduling_cycle_seconds", "Duration of scheduling cycles that had queued jobs to consider.",
    CYCLE_BUCKETS)
QUEUE_WAIT = shared.SharedHistogram(
    "trainyard_queue_wait_seconds", "Time admitted jobs spent queued, from entering the queue to admission.",
    WAIT_BUCKETS, labels=("tenant",))
ADMISSIONS = shared.SharedCounter("trainyard_admissions", "Jobs admitted by the scheduler.", labels=("tenant",))
PREEMPTIONS = shared.SharedCounter("trainyard_preemptions", "Running jobs preempted by the scheduler.",
                                   labels=("tenant",))
INGEST_LINES = shared.SharedCounter("trainyard_ingest_lines", "Log lines stored from learner agents.",
                                    labels=("tenant",))
INGEST_LAG = shared.SharedHistogram(
    "trainyard_ingest_lag_seconds", "Age of the oldest record of each stored ingest batch when it was stored.",
    LAG_BUCKETS)
BACKEND_ERRORS = shared.SharedCounter(
    "trainyard_backend_errors", "Learner backend calls that raised an error.", labels=("backend", "operation"),
    initial=lambda: [(settings.BACKEND, operation) for operation in BACKEND_OPERATIONS])

SHARED_SERIES = (SCHEDULING_CYCLE, QUEUE_WAIT, ADMISSIONS, PREEMPTIONS, INGEST_LINES, INGEST_LAG, BACKEND_ERRORS)


# --- recording (called where the work happens) -----------------------------------------------------
def admitted(tenant, queued_since):
    """In the admitting transaction: counted once it commits (a rolled-back admission did not happen)."""
    waited = max(0.0, (timezone.now() - queued_since).total_seconds())

    def record():
        ADMISSIONS.inc(tenant)
        QUEUE_WAIT.observe(waited, tenant)
    transaction.on_commit(record)


def preempted(tenant):
    transaction.on_commit(lambda: PREEMPTIONS.inc(tenant))


# Written on every ingest post: added up in the process and sent once a second (jobs.prometheus.Accumulated).
INGEST_WRITES = shared.Accumulated("ingest")


def ingested(tenant, *, lines, oldest_time):
    """After a batch committed: its log lines, and how long ago its oldest record was made (Unix time)."""
    if lines:
        INGEST_LINES.inc(tenant, amount=lines, trip=INGEST_WRITES)
    if oldest_time is not None:
        INGEST_LAG.observe(max(0.0, time.time() - oldest_time), trip=INGEST_WRITES)


class CountingBackend:
    """A learner backend whose calls that raise are counted by operation (jobs.backends.get_backend
    wraps the configured one); everything else passes through."""

    def __init__(self, backend):
        self._backend = backend
        self._name = settings.BACKEND

    def __getattr__(self, attribute):
        value = getattr(self._backend, attribute)
        if attribute not in BACKEND_OPERATIONS:
            return value

        def counted(*args, **kwargs):
            try:
                return value(*args, **kwargs)
            except Exception:
                BACKEND_ERRORS.inc(self._name, attribute)
                raise
        return counted


# --- websocket connections ---------------------------------------------------------------------
class SocketGauge:
    """Open websockets of this process, published to Redis as one hash field per (process, stream)
    with a heartbeat, so a web server that was killed stops being counted within STALE_S instead of
    leaving its sockets counted forever."""
    KEY = shared.KEY_PREFIX + "websockets"
    SEEN_KEY = shared.KEY_PREFIX + "websockets:seen"
    HEARTBEAT_S = 15.0
    STALE_S = 60.0

    def __init__(self):
        self.process = f"{socket.gethostname()}:{os.getpid()}"
        self.counts = {stream: 0 for stream in SOCKET_STREAMS}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread = None

    def opened(self, stream):
        self._change(stream, 1)

    def closed(self, stream):
        self._change(stream, -1)

    def _change(self, stream, delta):
        with self.lock:
            self.counts[stream] = max(0, self.counts[stream] + delta)
            if self.thread is None or self.thread.pid != os.getpid():
                self.thread = threading.Thread(target=self._publish_forever, name="websocket gauge", daemon=True)
                self.thread.pid = os.getpid()
                self.thread.start()
        self.wake.set()  # published by the thread: the event loop never waits on Redis

    def _publish_forever(self):
        while True:
            self.wake.wait(self.HEARTBEAT_S)
            self.wake.clear()
            self.publish()

    def publish(self):
        with self.lock:
            counts = dict(self.counts)
        try:
            with shared.redis_client().pipeline(transaction=False) as pipe:
                pipe.hset(self.KEY, mapping={f"{self.process}|{s}": n for s, n in counts.items()})
                pipe.hset(self.SEEN_KEY, self.process, time.time())
                pipe.execute()
        except shared.redis.RedisError:
            shared.dropped("websocket connections")

    @classmethod
    def collect(cls, client):
        family = GaugeMetricFamily("trainyard_websocket_connections",
                                   "Open websockets of live web servers, by stream (job page or job list).",
                                   labels=["stream"])
        now = time.time()
        seen = {p.decode(): float(t) for p, t in client.hgetall(cls.SEEN_KEY).items()}
        totals = {stream: 0 for stream in SOCKET_STREAMS}
        for raw, count in client.hgetall(cls.KEY).items():
            process, _, stream = raw.decode().rpartition("|")
            if now - seen.get(process, 0.0) <= cls.STALE_S and stream in totals:
                totals[stream] += int(count)
        for stream, count in totals.items():
            family.add_metric([stream], count)
        return family


SOCKETS = SocketGauge()


# --- gauges from the database, computed when scraped -----------------------------------------------
def database_gauges():
    """Every tenant that has jobs gets each of its series, 0 included (a queue that empties shows 0
    rather than vanishing)."""
    counts = {(row["tenant__slug"], row["status"]): row["n"]
              for row in Job.objects.values("tenant__slug", "status").annotate(n=Count("id"))}
    tenants = sorted({tenant for tenant, _ in counts})
    jobs = GaugeMetricFamily("trainyard_jobs", "Jobs by status and tenant.", labels=["tenant", "status"])
    for tenant in tenants:
        for status in Status.values:
            jobs.add_metric([tenant, status], counts.get((tenant, status), 0))
    yield jobs

    queued = {(row["tenant__slug"], row["priority"]): (row["n"], row["since"])
              for row in Job.objects.filter(status=Status.QUEUED).values("tenant__slug", "priority")
              # A queued job's updated_at is when it was queued (wait-reason updates leave it alone).
              .annotate(n=Count("id"), since=Min("updated_at"))}
    queue = GaugeMetricFamily("trainyard_queue_length", "Queued jobs by tenant and priority.",
                              labels=["tenant", "priority"])
    oldest = GaugeMetricFamily("trainyard_queue_oldest_wait_seconds",
                               "How long the longest-waiting queued job of each tenant has waited (0: none queued).",
                               labels=["tenant"])
    now = timezone.now()
    for tenant in tenants:
        for priority in PRIORITIES:
            queue.add_metric([tenant, priority], queued.get((tenant, priority), (0, None))[0])
        since = [s for (t, _), (_, s) in queued.items() if t == tenant]
        oldest.add_metric([tenant], max(0.0, (now - min(since)).total_seconds()) if since else 0.0)
    yield queue
    yield oldest


# --- what running jobs use, by tenant and node (their learners' latest resource samples) -------------
UTILISATION = (
    ("trainyard_gpus_allocated", "GPUs held by active jobs' learners, by tenant and node."),
    ("trainyard_gpus_busy", "GPUs' utilisation summed as GPUs (two at 50%: 1), from each learner's latest sample."),
    ("trainyard_cpus_allocated", "CPUs held by active jobs' learners, by tenant and node."),
    ("trainyard_cpus_used", "CPU cores used, from each learner's latest sample."),
    ("trainyard_memory_used_bytes", "Memory used, from each learner's latest sample."),
)
# The cluster's node names, set by JobsConfig.ready (the backend's capacity): every node gets each
# series, 0 included. (Not imported here: the backends import this module to count their errors.)
cluster_nodes = None
_nodes_cache = (0.0, ())
NODES_CACHE_S = 60.0


def sample_freshness():
    """A learner's latest sample counts while it is at most this old: three sampling periods, at least 30 s."""
    return timedelta(seconds=max(30.0, 3 * settings.RESOURCE_SAMPLE_S))


def _nodes():
    global _nodes_cache
    fetched, names = _nodes_cache
    if cluster_nodes is not None and time.monotonic() - fetched > NODES_CACHE_S:
        try:
            names = tuple(cluster_nodes())
        except Exception:  # a backend that does not answer: the nodes jobs run on still appear
            names = ()
        _nodes_cache = (time.monotonic(), names)
    return names


def utilisation_gauges():
    """Allocated and used GPUs, CPUs and memory by (tenant, node), for every tenant with jobs and every
    node of the cluster (0 included): three queries, whatever the number of jobs and samples."""
    jobs = {job.id: job for job in Job.objects.filter(status__in=ACTIVE).select_related("tenant").only(
        "id", "attempt", "placement", "cpus", "gpus_idle_since", "gpus_idle_attempt", "status", "tenant__slug")}
    latest_ids = [row["last"] for row in ResourceSample.objects.filter(
        job_id__in=list(jobs), time__gte=timezone.now() - sample_freshness())
        .values("job_id", "attempt", "learner").annotate(last=Max("id"))
        if jobs and row["attempt"] == jobs[row["job_id"]].attempt]
    samples = {(row["job_id"], row["learner"]): row for row in ResourceSample.objects.filter(id__in=latest_ids)
               .values("job_id", "learner", "gpus_busy", "cpu_cores", "memory_bytes")} if latest_ids else {}
    tenants = sorted(Job.objects.values_list("tenant__slug", flat=True).distinct().order_by())
    nodes = set(_nodes())
    totals = {}  # (tenant, node) -> [gpus, busy, cpus, used, memory]
    idle = dict.fromkeys(tenants, 0)
    for job in jobs.values():
        if job.status == Status.PROCESSING and job.gpus_idle is not None:
            idle[job.tenant.slug] = idle.get(job.tenant.slug, 0) + 1
        for index, learner in enumerate(job.placement or []):
            nodes.add(learner["node"])
            row = totals.setdefault((job.tenant.slug, learner["node"]), [0, 0.0, 0.0, 0.0, 0])
            row[0] += len(learner["gpu_ids"])
            row[2] += job.cpus
            sample = samples.get((job.id, index))
            if sample is not None:
                row[1] += sample["gpus_busy"] or 0.0
                row[3] += sample["cpu_cores"]
                row[4] += sample["memory_bytes"]
    families = [GaugeMetricFamily(name, text, labels=["tenant", "node"]) for name, text in UTILISATION]
    for tenant in sorted(set(tenants) | {t for t, _ in totals}):
        for node in sorted(nodes):
            for family, value in zip(families, totals.get((tenant, node), [0, 0.0, 0.0, 0.0, 0])):
                family.add_metric([tenant, node], value)
    yield from families
    flagged = GaugeMetricFamily("trainyard_idle_gpu_jobs",
                                "Running jobs flagged by their tenant's idle-GPU policy (jobs.idle).", labels=["tenant"])
    for tenant, count in sorted(idle.items()):
        flagged.add_metric([tenant], count)
    yield flagged


def scrape_time_series():
    yield from database_gauges()
    yield from utilisation_gauges()
    try:
        yield SocketGauge.collect(shared.redis_client())
    except shared.redis.RedisError:
        shared.dropped("the scrape of trainyard_websocket_connections")


# Registered for /metrics by JobsConfig.ready.
COLLECTOR = shared.SharedCollector(SHARED_SERIES, extra=scrape_time_series)
