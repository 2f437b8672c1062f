"""controlplane: the platform under many jobs at once, on the Kubernetes backend, PostgreSQL and Redis.

The platform runs as deploy/kubernetes runs it (uvicorn for the users, a web process of its own for the
agents' ingest posts, a Celery worker and beat; TRAINYARD_BACKEND=kubernetes; BENCH_CP_INGEST_WEB=0
puts the agents on the users' web process instead) against the emulated API server its Kubernetes tests
use (kmock's KubernetesEmulator, in a process of its own, reached through a kubeconfig by the
official client). This process plays the rest of the
cluster: a kubelet that runs each learner pod the backend creates and ends it (Succeeded) JOB_S
seconds later, and each pod's agent, posting through the real ingest endpoint with the credential
from the attempt's Secret: its status records and 10 log lines a second, one batch per second per
learner (lines pile up into the next batch while the server is slow, as learner_agent's shipper
does). Jobs: 1 learner, 1 GPU.

1. Small: nodes for SMALL_JOBS GPUs, QUEUED jobs seeded straight into the database (ready to deploy:
   code archive on the storage, runtime fields, QUEUED event); once SMALL_JOBS run, a reconcile
   pass is timed and its queries counted (in a process of its own, as a worker's, with the same
   settings and a pod cache of its own).
2. Large: nodes added up to CONCURRENT GPUs; admissions per second while the queue fills them, then
   the same reconcile measurement at CONCURRENT running and QUEUED waiting.
3. Under that load for STEADY_S seconds: jobs submitted through the REST API (latency), the agents'
   ingest requests (latency), and WS_CLIENTS websocket clients (the `websockets` library) on
   /ws/jobs/ timing each status change from its publication (at the change's commit) to its arrival,
   and from the change itself (updated_at; adds the rest of the transaction that made it).

Needs PostgreSQL (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/postgres: a database of
its own is created there and dropped after), reached through PgBouncer as deploy/ reaches it (Debian's
pgbouncer with deploy/pgbouncer/pgbouncer.ini; BENCH_CP_PGBOUNCER=0 connects directly) and Redis
(REDIS_URL, default redis://127.0.0.1:6379/0: a database number no client uses). Where the
server's autovacuum is off (a test server's may be), a stand-in does its work on the bench's database
(bench.autovacuum), as a deployment's PostgreSQL would. Everything shares this machine's cores, so every figure is under
that contention; the sizes can be lowered with BENCH_CP_* variables.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

import requests

from bench.autovacuum import Autovacuum
from bench.concurrency import Usage, proc_stat
from bench.report import median, percentile, publish
from bench.targets import shown
from tests.support import pgbouncer
from tests.support.harness import start_session

CONCURRENT = int(os.environ.get("BENCH_CP_CONCURRENT", 1000))
QUEUED = int(os.environ.get("BENCH_CP_QUEUED", 10_000))
SMALL_JOBS = int(os.environ.get("BENCH_CP_SMALL", 100))
JOB_S = float(os.environ.get("BENCH_CP_JOB_S", 150))
STEADY_S = float(os.environ.get("BENCH_CP_STEADY_S", 120))
SUBMITS = int(os.environ.get("BENCH_CP_SUBMITS", 100))
WS_CLIENTS = int(os.environ.get("BENCH_CP_WS_CLIENTS", 100))
AGENT_CONNECTIONS = int(os.environ.get("BENCH_CP_AGENT_CONNECTIONS", 8))
# Agents post to an ingest process of their own, as deploy/kubernetes runs the platform (the
# trainyard-ingest Deployment, TRAINYARD_K8S_INGEST_URL); BENCH_CP_INGEST_WEB=0: to the one web
# process that also serves the users (make demo's layout).
INGEST_WEB = os.environ.get("BENCH_CP_INGEST_WEB", "1") not in ("", "0")
# The platform's connections go through PgBouncer, as deploy/ runs it (a Django connection per request,
# CONN_MAX_AGE 0, is a server process forked without it); BENCH_CP_PGBOUNCER=0: straight to PostgreSQL.
PGBOUNCER = os.environ.get("BENCH_CP_PGBOUNCER", "1") not in ("", "0")
# The phases wait at most this long, so the bench ends within 15 minutes whatever this machine
# manages; what was reached is reported (`*_reached`) and every figure is measured at that.
SMALL_TIMEOUT_S = float(os.environ.get("BENCH_CP_SMALL_TIMEOUT_S", 180))
FILL_TIMEOUT_S = float(os.environ.get("BENCH_CP_FILL_TIMEOUT_S", 420))
LINES_PER_S = 10
CLIENTS_NICE = -10  # the clients' scheduling priority (see _raised_priority)
GPUS_PER_NODE = 4
TENANT = "team-a"
NAMESPACE = f"trainyard-{TENANT}"
MANIFEST = ("name: cp-{i}\nlearners: 1\ngpus: 1\ncpus: 1\nmemory: 1GiB\n"
            "framework: {{name: custom, command: python train.py}}\n")
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


# --- backing services ----------------------------------------------------------------------------
def require_services():
    """PostgreSQL and Redis, or a clear refusal (this bench is about them, SQLite would not say much)."""
    database = os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL
    if not database.startswith("postgres"):
        raise SystemExit(f"bench controlplane runs on PostgreSQL; DATABASE_URL={database!r} is not a postgres:// URL")
    import psycopg2
    import redis
    try:
        psycopg2.connect(database, connect_timeout=5).close()
    except psycopg2.OperationalError as exc:
        raise SystemExit(f"bench controlplane needs PostgreSQL at {database} (set DATABASE_URL): {exc}".strip())
    if PGBOUNCER and pgbouncer.executable() is None:
        raise SystemExit("bench controlplane runs the platform through PgBouncer as deploy/ does: install "
                         "pgbouncer, or set BENCH_CP_PGBOUNCER=0 to connect to PostgreSQL directly")
    url = os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    try:
        redis.Redis.from_url(url, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        raise SystemExit(f"bench controlplane needs Redis at {url} (set REDIS_URL): {exc}")
    return database, url


# --- the emulated API server, in a process of its own --------------------------------------------
def serve_cluster(url_file):
    """Entry point of the API server's process: run until SIGTERM."""
    from tests.support.k8s_fake import FakeCluster
    cluster = FakeCluster().start()
    Path(url_file).write_text(cluster.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    cluster.stop()


class Cluster:
    def __init__(self, work_dir):
        url_file = work_dir / "cluster-url"
        self.process = subprocess.Popen([sys.executable, "-c", f"from bench.controlplane import serve_cluster; "
                                         f"serve_cluster({str(url_file)!r})"], cwd=Path(__file__).parent.parent,
                                        start_new_session=True)  # a group of its own: its CPU is counted apart
        deadline = time.monotonic() + 30
        while not url_file.exists() or not url_file.read_text():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("the emulated Kubernetes API server did not start")
            time.sleep(0.1)
        self.url = url_file.read_text()
        self.kubeconfig = work_dir / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "bench",
            "clusters": [{"name": "bench", "cluster": {"server": self.url}}],
            "users": [{"name": "bench", "user": {}}],
            "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}]}))
        self.nodes = 0

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def add_nodes(self, count):
        http = requests.Session()
        for _ in range(count):
            self.nodes += 1
            http.post(f"{self.url}/api/v1/nodes", json={
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": f"node-{self.nodes}"},
                "spec": {"unschedulable": False},
                "status": {"allocatable": {"cpu": "64", "memory": "256Gi", "nvidia.com/gpu": str(GPUS_PER_NODE)},
                           "conditions": [{"type": "Ready", "status": "True"}]}}).raise_for_status()


# --- the kubelet and the agents ------------------------------------------------------------------
class Pod:
    def __init__(self, job_id, attempt, token):
        self.job_id, self.attempt, self.token = job_id, attempt, token
        self.seq = 0
        self.records = []  # status records waiting for the next batch
        self.last_post = time.monotonic()
        self.exit_at = None
        self.exit_sent = False
        self.done = False


class Fleet:
    """A kubelet for every learner pod the backend creates, and an agent in each."""

    def __init__(self, cluster, platform_url, tenant):
        from jobs.backends.k8s import objects
        self.objects = objects
        self.cluster, self.platform_url, self.tenant = cluster, platform_url, tenant
        self.pods = {}  # (job id, attempt) -> Pod
        self.due = deque()  # pods in the order they are due to post
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ingest_ms = []  # (monotonic time, latency ms)
        self.errors = []
        self.threads = [threading.Thread(target=self._kubelet, name="kubelet", daemon=True)]
        self.threads += [threading.Thread(target=self._agent, name=f"agent-{i}", daemon=True)
                         for i in range(AGENT_CONNECTIONS)]

    def start(self):
        for thread in self.threads:
            thread.start()
        return self

    def halt(self):
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def running(self):
        with self.lock:
            return sum(1 for pod in self.pods.values() if not pod.done)

    # The kubelet: pods of attempts that have learner rows (deploy made them) start running.
    def _kubelet(self):
        from django.db import connection
        from jobs.models import ACTIVE, Learner
        http = requests.Session()
        while not self.stop.wait(0.5):
            try:
                rows = (Learner.objects.filter(state=Learner.State.DEPLOYING, job__status__in=ACTIVE)
                        .values_list("job_id", "attempt"))
                for job_id, attempt in rows:
                    if (job_id, attempt) not in self.pods and not self.stop.is_set():
                        self._run_pod(http, job_id, attempt)
            except Exception as exc:  # noqa: BLE001 - recorded and reported; the bench goes on
                self.errors.append(f"kubelet: {exc}")
            finally:
                connection.close()

    def _run_pod(self, http, job_id, attempt):
        name = self.objects.pod_name(job_id, attempt, 0)
        base = f"{self.cluster.url}/api/v1/namespaces/{NAMESPACE}"
        secret = http.get(f"{base}/secrets/{self.objects.secret_name(job_id, attempt)}")
        if secret.status_code == 404:
            return
        secret.raise_for_status()
        secret = secret.json()
        key = self.objects.credential_key(0)
        token = (secret.get("stringData") or {}).get(key)
        if token is None:
            import base64
            token = base64.b64decode(secret["data"][key]).decode()
        merge = {"Content-Type": "application/merge-patch+json"}
        http.patch(f"{base}/pods/{name}", data=json.dumps({"spec": {"nodeName": "node-1"}}), headers=merge)
        started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        http.patch(f"{base}/pods/{name}/status", headers=merge, data=json.dumps({"status": {
            "phase": "Running", "containerStatuses": [{"name": "learner", "ready": True, "restartCount": 0,
                                                       "image": "img", "imageID": "",
                                                       "state": {"running": {"startedAt": started}}}]}}))
        pod = Pod(job_id, attempt, token)
        pod.records = [{"kind": "status", "state": "preparing"}, {"kind": "status", "state": "running"}]
        pod.exit_at = time.monotonic() + JOB_S
        with self.lock:
            self.pods[(job_id, attempt)] = pod
            self.due.append(pod)

    def _terminate(self, http, pod):
        name = self.objects.pod_name(pod.job_id, pod.attempt, 0)
        finished = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        http.patch(f"{self.cluster.url}/api/v1/namespaces/{NAMESPACE}/pods/{name}/status",
                   headers={"Content-Type": "application/merge-patch+json"}, data=json.dumps({"status": {
                       "phase": "Succeeded", "containerStatuses": [{
                           "name": "learner", "ready": False, "restartCount": 0, "image": "img", "imageID": "",
                           "state": {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": finished}}}]}}))

    # An agent connection: takes the pod that posted longest ago, posts what it owes, puts it back.
    def _agent(self):
        from jobs import storage
        http = requests.Session()
        while not self.stop.is_set():
            with self.lock:
                pod = self.due.popleft() if self.due else None
            if pod is None:
                time.sleep(0.05)
                continue
            wait = pod.last_post + 1.0 - time.monotonic()
            if wait > 0 and self.stop.wait(wait):
                return
            now = time.monotonic()
            lines = int((now - pod.last_post) * LINES_PER_S)
            records = [{"kind": "log", "stream": "stdout", "line": f"step {pod.seq + i} loss 0.{pod.seq + i:06d} "
                        "lr 0.001 throughput 1234.5 samples/s"} for i in range(lines)]
            if pod.exit_at <= now and not pod.exit_sent:
                folder = storage.learner_dir(self.tenant, pod.job_id, pod.attempt, 0)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "exit.json").write_text(json.dumps({"exit_code": 0, "reason": ""}))
                pod.records.append({"kind": "status", "state": "exited", "exit_code": 0})
            batch = pod.records + records
            stamp = time.time()
            for offset, record in enumerate(batch, start=1):
                record.update(seq=pod.seq + offset, time=stamp)
            started = time.monotonic()
            try:
                response = http.post(f"{self.platform_url}/api/v1/ingest/{pod.job_id}/", timeout=60,
                                     data=json.dumps({"attempt": pod.attempt, "learner": 0, "records": batch}),
                                     headers={"Authorization": f"Ingest {pod.token}",
                                              "Content-Type": "application/json"})
            except requests.RequestException as exc:
                self.errors.append(f"ingest: {exc}")
                response = None
            ok = response is not None and response.status_code == 200
            self.ingest_ms.append((started, (time.monotonic() - started) * 1000, len(records) if ok else 0))
            if ok:
                pod.seq += len(batch)
                pod.last_post = now
                pod.exit_sent = pod.exit_sent or any(r.get("state") == "exited" for r in pod.records)
                pod.records = []
                if pod.exit_sent:
                    self._terminate(http, pod)
                    pod.done = True
            elif response is not None and response.status_code == 410:
                pod.done = True  # the attempt is over
            elif response is not None:
                self.errors.append(f"ingest {response.status_code}: {response.text[:200]}")
            if not pod.done:
                with self.lock:
                    self.due.append(pod)


# --- websocket clients, in a process of their own ------------------------------------------------
def ws_clients(url, token, count, seconds, out_file):
    """Entry point of the clients' process: `count` sockets on /ws/jobs/ for `seconds`; writes, for
    every status message, its fan-out delay (arrival - when it was published, at the change's commit),
    its delay from the change itself (arrival - the change's updated_at), in ms, and the status."""
    import asyncio

    import websockets

    async def client(delays, ready):
        async with websockets.connect(f"{url}/ws/jobs/?token={token}", max_size=None, open_timeout=60) as socket:
            ready.append(1)
            while True:
                message = json.loads(await socket.recv())
                now = time.time()
                # The list stream sends changes within a moment of each other together (jobs.consumers).
                changes = message["changes"] if message.get("type") == "statuses" else [message]
                for change in changes:
                    if change.get("type") == "status":
                        changed = datetime.fromisoformat(change["time"]).timestamp()
                        published = datetime.fromisoformat(change["published"]).timestamp()
                        delays.append((now, (now - published) * 1000, (now - changed) * 1000, change["status"]))

    priority = _raised_priority()

    async def run():
        delays, ready = [], []
        tasks = [asyncio.create_task(client(delays, ready)) for _ in range(count)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        Path(out_file).write_text(json.dumps({"connected": len(ready), "delays": delays, "priority": priority}))

    asyncio.run(run())


# --- the database --------------------------------------------------------------------------------
def seed_queued(count, start_index):
    """`count` QUEUED jobs as submission leaves them (code archive on the storage, runtime fields,
    the QUEUED event), inserted in bulk: submitting 11,000 through the API would take this machine
    longer than the whole bench may."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from jobs import runtime, storage
    from trainyard.manifest import parse_manifest
    from jobs.models import Job, JobEvent
    from tests.support.builders import tar_gz
    from tenants.models import Tenant
    tenant = Tenant.objects.get(slug=TENANT)
    owner = get_user_model().objects.get(username="alice")
    code = tar_gz({"train.py": b"print('hi')\n"})
    now = timezone.now()
    for first in range(start_index, start_index + count, 2000):
        jobs = []
        for i in range(first, min(first + 2000, start_index + count)):
            text = MANIFEST.format(i=i)
            manifest = parse_manifest(text.encode())
            job = Job(tenant=tenant, owner=owner, name=manifest.name, framework=manifest.framework,
                      manifest=manifest.raw, manifest_yaml=text, learners=1, gpus=1, cpus=1.0,
                      memory_bytes=manifest.memory_bytes, code_sha256="0" * 64, code_bytes=len(code),
                      runtime=runtime.from_manifest(manifest), created_at=now, updated_at=now)
            (storage.create_job_dir(TENANT, job.id) / "code.tar.gz").write_bytes(code)
            jobs.append(job)
        Job.objects.bulk_create(jobs)
        JobEvent.objects.bulk_create([JobEvent(job=job, time=now, to_status="QUEUED", attempt=1, actor="alice",
                                               reason="submitted") for job in jobs])


def counts():
    from django.db import connection
    from django.db.models import Count

    from jobs.models import Job
    try:
        return dict(Job.objects.values_list("status").annotate(n=Count("id")))
    finally:
        connection.close()


def measure_reconcile(passes=3, profile=None):
    """(median seconds, queries, active jobs, split) of `passes` reconcile passes run here. The
    queries are the fewest any pass made: what a pass reads, plus the writes of the fewest changes
    (jobs that ended meanwhile cost their own). With `profile` (a path), the passes run under
    cProfile and its statistics are written there."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from jobs import reconcile
    from jobs.models import ACTIVE, Job
    seconds, queries, parts = [], [], {"backend_status": [], "outbox_sweep": [], "queries": []}
    backend, sweep = reconcile.get_backend(), reconcile.outbox.sweep
    status, spent = backend.status, {}

    def timed(name, call):
        def wrapper(*args, **kwargs):
            started = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.monotonic() - started
        return wrapper
    backend.status = timed("backend_status", status)
    reconcile.outbox.sweep = timed("outbox_sweep", sweep)
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
    try:
        for _ in range(passes):
            spent.clear()
            with CaptureQueriesContext(connection) as captured:
                started = time.monotonic()
                if profiler:
                    profiler.enable()
                reconcile.reconcile()
                if profiler:
                    profiler.disable()
                seconds.append(time.monotonic() - started)
            queries.append(len(captured))
            for name in ("backend_status", "outbox_sweep"):
                parts[name].append(spent.get(name, 0.0))
            parts["queries"].append(sum(float(q["time"]) for q in captured.captured_queries))
    finally:
        backend.status, reconcile.outbox.sweep = status, sweep
        if profiler:
            profiler.dump_stats(profile)
    active = Job.objects.filter(status__in=ACTIVE).count()
    connection.close()
    return median(seconds), min(queries), active, {name: round(median(v), 3) for name, v in parts.items()}


def reconcile_apart(out_file, profile=None):
    """Entry point of the process reconcile passes are timed in (measure_reconcile_apart). A worker's
    process runs a pass on its own; in this bench's process it shared the interpreter with the
    simulated fleet's threads, and at 1,000 jobs a pass took 5.2 s of which its queries were 0.16 s and
    the backend's reads 0.54 s."""
    import django
    django.setup()
    from jobs.backends import get_backend
    wait_until("the pod cache", lambda: get_backend().watcher.fresh(), 60)
    Path(out_file).write_text(json.dumps(measure_reconcile(profile=profile)))


def measure_reconcile_apart(work_dir, profile=None):
    """measure_reconcile in a process of its own, with this one's settings (the environment)."""
    out_file = work_dir / "reconcile.json"
    process = _client_process("reconcile_apart", str(out_file), profile)
    if process.wait(600) != 0:
        raise RuntimeError(f"the reconcile passes' process exited with {process.returncode}")
    return tuple(json.loads(out_file.read_text()))


def machine_cpu():
    """(busy, total) jiffies of all cores so far (/proc/stat): everything, PostgreSQL and Redis too."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


SERVICES = {"postgresql": "postgres", "redis": "redis-server"}  # part -> process name (comm)


def services_cpu():
    """{part: CPU seconds so far} of the backing services (SERVICES): every process of that name,
    reaped children included (a PostgreSQL backend that exits leaves its time with the postmaster).
    They are not in a process group of the platform's (each backend starts a session of its own)."""
    used = dict.fromkeys(SERVICES, 0.0)
    parts = {name: part for part, name in SERVICES.items()}
    for proc in Path("/proc").iterdir():
        try:
            part = parts.get((proc / "comm").read_text().strip()) if proc.name.isdigit() else None
        except OSError:
            continue
        stat = proc_stat(proc.name) if part else None
        if stat is not None:
            used[part] += stat[1]
    return used


def sessions_opened():
    """PostgreSQL sessions opened so far, in every database (pg_stat_database.sessions, PostgreSQL 14
    on; None before): each is a server process forked and set up for a client."""
    import psycopg2
    connection = psycopg2.connect(os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT sum(sessions) FROM pg_stat_database")
            return int(cursor.fetchone()[0] or 0)
    except psycopg2.Error:
        return None
    finally:
        connection.close()


def wait_until(what, predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not reached within {timeout:.0f}s ({counts()})")
        time.sleep(1)


def reached(figures, phase, predicate, timeout):
    """Wait for a phase like wait_until, but go on when it times out: the figures are then measured
    at what this machine did reach, and `<phase>_reached` says what that was."""
    try:
        wait_until(phase, predicate, timeout)
    except RuntimeError:
        pass
    figures[f"{phase}_reached"] = counts()


def processing():
    return counts().get("PROCESSING", 0)


def admitted_since(moment):
    from django.db import connection

    from jobs.models import Job
    try:
        times = sorted(Job.objects.filter(admitted_at__gte=moment).values_list("admitted_at", flat=True))
    finally:
        connection.close()
    return times


# --- the run -------------------------------------------------------------------------------------
def setup_django(session, cluster):
    os.environ.update({key: session.env[key] for key in ("DATABASE_URL", "REDIS_URL", "TRAINYARD_DATA_DIR",
                                                         "TRAINYARD_PUBLIC_URL")})
    os.environ.update(DJANGO_SETTINGS_MODULE="portal.settings", **backend_env(cluster))
    import django
    django.setup()
    from jobs.backends import get_backend
    backend = get_backend()
    wait_until("the pod cache", lambda: backend.watcher.fresh(), 60)


def backend_env(cluster):
    # The bench's one tenant stands for many users: it measures the control plane, not a tenant's intake limits.
    return {"TRAINYARD_BACKEND": "kubernetes", "KUBECONFIG": str(cluster.kubeconfig),
            "TRAINYARD_K8S_STORAGE_VOLUME": json.dumps({"persistentVolumeClaim": {"claimName": "trainyard-storage"}}),
            "TRAINYARD_SUBMITS_PER_MINUTE": "100000", "TRAINYARD_MAX_QUEUED_JOBS": "100000"}


def submit_clients(url, token, seconds, out_file):
    """Entry point of the submitting user's process (a CLI on a machine of its own, like the browsers):
    a job through the REST API about once a second for `seconds`; writes each one's latency in ms and
    status code to `out_file`. In the bench's own process it shared the interpreter with the fleet's
    threads and a timed reconcile pass, whose turns it waited for."""
    from trainyard.packing import code_upload
    priority = _raised_priority()
    folder = Path(tempfile.mkdtemp(prefix="cp-code-"))
    (folder / "train.py").write_text("print('hi')\n")
    code = code_upload(str(folder))
    with code.fileobj:
        archive = code.fileobj.read()
    http = requests.Session()
    http.headers["Authorization"] = f"Token {token}"
    submits, deadline = [], time.monotonic() + seconds
    for i in range(SUBMITS):
        time.sleep(1.0)
        if time.monotonic() >= deadline:
            break
        started = time.monotonic()
        response = http.post(f"{url}/api/v1/jobs/", timeout=60, files={
            "manifest": ("manifest.yml", MANIFEST.format(i=f"s{i}")), "code": (code.filename, archive)})
        submits.append(((time.monotonic() - started) * 1000, response.status_code))
    shutil.rmtree(folder, ignore_errors=True)
    Path(out_file).write_text(json.dumps({"submits": submits, "priority": priority}))


def _raised_priority():
    """The bench's clients stand for users on machines of their own. Sharing this one's busy cores,
    the process reading 100 sockets got ~0.04 of a core and fell behind, and its lag was counted as
    the platform's: the clients run ahead of everyone else where they may (root). Returns what they got."""
    try:
        os.nice(CLIENTS_NICE)
        return f"nice {CLIENTS_NICE}"
    except OSError:
        return "default priority (raising it needs root)"


def _client_process(entry, *args):
    """A client of the platform in a process (and session) of its own: `entry(*args)` of this module."""
    call = f"from bench.controlplane import {entry}; {entry}({', '.join(repr(a) for a in args)})"
    return subprocess.Popen([sys.executable, "-c", call], cwd=Path(__file__).parent.parent, start_new_session=True)


def main():
    # A run stopped from outside (timeout, Ctrl-C's cousin) still stops the platform and the
    # emulated cluster and drops its database: the finally blocks run on SIGTERM too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    database, redis_url = require_services()
    with contextlib.ExitStack() as stack:
        bouncer = stack.enter_context(pgbouncer.running(database)) if PGBOUNCER else None
        if bouncer is not None:
            database = bouncer.url(database.rsplit("/", 1)[1])
        os.environ["DATABASE_URL"], os.environ["REDIS_URL"] = database, redis_url
        figures = measure(logins=bouncer.logins if bouncer is not None else lambda: None)
    figures["database_via"] = "PgBouncer (deploy/pgbouncer/pgbouncer.ini)" if PGBOUNCER else "PostgreSQL directly"
    report(figures)


def measure(logins):
    """The figures; `logins()`: clients logged in to PgBouncer so far (None without it)."""
    work_dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-cp-"))
    cluster = Cluster(work_dir)
    session = None
    try:
        session = start_session(work_dir / "platform", **backend_env(cluster))
        setup_django(session, cluster)
        from jobs import dispatch
        with Autovacuum(session.env["DATABASE_URL"]) as autovacuum:
            figures = run(session, cluster, dispatch.wake_scheduler, work_dir, logins)
        figures["autovacuum"] = autovacuum.describe()
    finally:
        if session is not None:
            session.stop()
        cluster.stop()
        if os.environ.get("BENCH_CP_KEEP"):
            print(f"kept {work_dir} (platform logs under platform/logs)")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    return figures


def ingest_url(session):
    """Where the agents post: the platform's web server, or with INGEST_WEB an ingest server of its own
    (portal.asgi:ingest_application; a deployment points its agents there with TRAINYARD_K8S_INGEST_URL),
    so browsers and users are served by a process that parses no log batches."""
    if not INGEST_WEB:
        return session.url
    from portal.runner import free_port, web_server_command
    port = free_port()
    session.platform.spawn("ingest-web", web_server_command("--host", "127.0.0.1", "--port", str(port),
                                                                application="portal.asgi:ingest_application"))
    url = f"http://127.0.0.1:{port}"
    wait_until("the ingest web process", lambda: _answers(url), 60)
    return url


def _answers(url):
    try:
        return requests.get(f"{url}/login/", timeout=2).status_code == 404  # it serves ingest posts alone
    except requests.RequestException:
        return False


def progress(started, text):
    """A line per phase, so a run that is slow shows where (the phases are bounded, setup is not)."""
    print(f"[{time.monotonic() - started:7.1f} s] {text}", flush=True)


def reference_loop_s():
    """A fixed piece of pure-Python work timed on the still idle machine (best of three): every figure
    here is under CPU contention, so runs on machines of different speeds compare by this."""
    def loop():
        started, total = time.perf_counter(), 0
        for i in range(5_000_000):
            total += i * i
        return time.perf_counter() - started
    return round(min(loop() for _ in range(3)), 3)


def run(session, cluster, schedule, work_dir, logins):
    figures = {"concurrent_target": CONCURRENT, "queued_target": QUEUED, "job_s": JOB_S,
               "reference_loop_s": reference_loop_s()}
    started = time.monotonic()
    progress(started, f"seeding {CONCURRENT + QUEUED} queued jobs")
    cluster.add_nodes(-(-SMALL_JOBS // GPUS_PER_NODE))
    seed_queued(CONCURRENT + QUEUED, 0)
    figures["seed_s"] = round(time.monotonic() - started, 1)
    fleet = Fleet(cluster, ingest_url(session), TENANT).start()
    try:
        progress(started, f"seeded in {figures['seed_s']} s; running the first {SMALL_JOBS}")
        schedule()
        reached(figures, "small", lambda: processing() >= SMALL_JOBS, SMALL_TIMEOUT_S)
        progress(started, f"small: {figures['small_reached']}; timing reconcile passes")
        small_s, small_queries, small_active, small_parts = measure_reconcile_apart(work_dir)
        progress(started, f"small reconcile pass {small_s:.2f} s, {small_queries} queries; filling to {CONCURRENT}")

        moment = datetime.now().astimezone()
        cluster.add_nodes(-(-CONCURRENT // GPUS_PER_NODE) - cluster.nodes)
        fill_started = time.monotonic()
        schedule()
        reached(figures, "admitted", lambda: len(admitted_since(moment)) >= CONCURRENT - SMALL_JOBS, FILL_TIMEOUT_S)
        admitted = admitted_since(moment)
        admission_s = (admitted[-1] - moment).total_seconds() if admitted else 0.0
        reached(figures, "running", lambda: processing() >= CONCURRENT * 0.9,
                max(10.0, FILL_TIMEOUT_S - (time.monotonic() - fill_started)))
        running_s = time.monotonic() - fill_started
        progress(started, f"filled in {running_s:.0f} s: {figures['running_reached']}; steady load for {STEADY_S:.0f} s")

        ws_file, submits_file = work_dir / "ws.json", work_dir / "submits.json"
        ws = _client_process("ws_clients", session.url.replace("http", "ws", 1), session.token, WS_CLIENTS,
                             STEADY_S + 10, str(ws_file))
        time.sleep(10)  # the sockets connect
        submitter = _client_process("submit_clients", session.url, session.token, STEADY_S, str(submits_file))
        # Where this machine's cores go under the load: the platform's parts, and this bench's own
        # stand-ins for the cluster (the API server, the kubelet and agents) and its users.
        usage = Usage(dict(session.platform.pids(), apiserver=cluster.process.pid, fleet=os.getpgid(0),
                           browsers=ws.pid, submitter=submitter.pid), work_dir).__enter__()
        machine_before, services_before, sessions_before = machine_cpu(), services_cpu(), sessions_opened()
        logins_before = logins()
        steady_started = time.monotonic()
        large_s, large_queries, large_active, large_parts = measure_reconcile_apart(
            work_dir, profile=os.environ.get("BENCH_CP_PROFILE"))
        progress(started, f"large reconcile pass {large_s:.2f} s, {large_queries} queries")
        during = counts()
        submitter.wait(STEADY_S + 120)
        usage.__exit__(None, None, None)
        services = {part: cpu - services_before[part] for part, cpu in services_cpu().items()}
        steady_cpu = {part: round(cpu / (time.monotonic() - steady_started), 2)
                      for part, cpu in sorted({**usage.platform_cpu_by_part, **services}.items())}
        busy, total = (after - before for after, before in zip(machine_cpu(), machine_before))
        steady_cpu["whole machine"] = round(busy / total * (os.cpu_count() or 1), 2)
        sessions_per_s = _per_s(sessions_before, sessions_opened(), steady_started)
        logins_per_s = _per_s(logins_before, logins(), steady_started)
        ws.wait(STEADY_S + 60)
        sockets = json.loads(ws_file.read_text())
        sampled = json.loads(submits_file.read_text())
        submits = sampled["submits"]
    finally:
        fleet.halt()
    steady_ingest = [ms for at, ms, _ in fleet.ingest_ms if at >= steady_started]
    steady_lines = sum(lines for at, _, lines in fleet.ingest_ms if at >= steady_started)
    submit_ms = [ms for ms, status in submits if status == 201]
    fanout = [published_ms for _, published_ms, _, _ in sockets["delays"]]
    from_change = [changed_ms for _, _, changed_ms, _ in sockets["delays"]]
    figures.update({
        "submit_p50_ms": round(median(submit_ms), 1) if submit_ms else None,
        "submit_p95_ms": round(percentile(submit_ms, 0.95), 1) if submit_ms else None,
        "submits": len(submits), "submit_errors": len(submits) - len(submit_ms),
        "submit_client_priority": sampled["priority"],
        "admissions_per_s": round((len(admitted) - 1) / admission_s, 1) if admission_s > 0 else None,
        "admitted_in_fill": len(admitted),
        "fill_to_running_s": round(running_s, 1),
        "reconcile_pass_s": round(large_s, 3), "reconcile_queries": large_queries, "reconcile_active_jobs": large_active,
        "reconcile_pass_s_small": round(small_s, 3), "reconcile_queries_small": small_queries,
        "reconcile_active_jobs_small": small_active,
        "reconcile_split_s": large_parts, "reconcile_split_s_small": small_parts,
        "statuses_during_steady": during,
        "ingest_p50_ms": round(median(steady_ingest), 1) if steady_ingest else None,
        "ingest_p95_ms": round(percentile(steady_ingest, 0.95), 1) if steady_ingest else None,
        "ingest_requests_per_s": round(len(steady_ingest) / STEADY_S, 1),
        "ingest_lines_per_s": round(steady_lines / STEADY_S, 1),
        "ingest_lines_per_s_demanded": LINES_PER_S * during.get("PROCESSING", 0),
        "agent_connections": AGENT_CONNECTIONS,
        "ingest_served_by": "an ingest process of its own" if INGEST_WEB else "the web process",
        "ws_clients_connected": sockets["connected"], "ws_clients_priority": sockets["priority"],
        "ws_messages": len(fanout),
        "ws_fanout_p50_ms": round(median(fanout), 1) if fanout else None,
        "ws_fanout_p95_ms": round(percentile(fanout, 0.95), 1) if fanout else None,
        # From the change's updated_at instead: adds how long its transaction went on after it.
        "ws_change_to_socket_p50_ms": round(median(from_change), 1) if from_change else None,
        "ws_change_to_socket_p95_ms": round(percentile(from_change, 0.95), 1) if from_change else None,
        "ws_change_to_socket_p95_ms_by_status": _p95_by_status(sockets["delays"]),
        "cores_used_during_steady": steady_cpu,
        "db_sessions_opened_per_s": sessions_per_s,
        "pgbouncer_logins_per_s": logins_per_s,
        "errors": fleet.errors[:20], "error_count": len(fleet.errors),
        "total_s": round(time.monotonic() - started, 1),
    })
    return figures


def _per_s(before, after, since):
    """A count's growth per second since the monotonic time `since` (None where it was not counted)."""
    return round((after - before) / (time.monotonic() - since), 1) if None not in (before, after) else None


def _p95_by_status(delays):
    """{new status: (messages, p95 ms from the change)}: which transitions' transactions run long."""
    by_status = {}
    for _, _, changed_ms, status in delays:
        by_status.setdefault(status, []).append(changed_ms)
    return {status: (len(values), round(percentile(values, 0.95), 1)) for status, values in sorted(by_status.items())}


def report(figures):
    f = figures
    publish("controlplane", [
        (f"submit p50 / p95 ms ({f['submits']} jobs via the API, under load)",
         f"{f['submit_p50_ms']} / {f['submit_p95_ms']}", shown("controlplane", "submit_p95_ms")),
        ("jobs running / queued under the load", f"{f['statuses_during_steady'].get('PROCESSING', 0)} / "
         f"{f['statuses_during_steady'].get('QUEUED', 0)}", f"target {CONCURRENT} / {QUEUED}"),
        ("admissions/s (nodes added for the queue's head)", f["admissions_per_s"], ""),
        ("  admission → running, s", f["fill_to_running_s"], ""),
        (f"reconcile pass s, queries ({f['reconcile_active_jobs']} active)",
         f"{f['reconcile_pass_s']}, {f['reconcile_queries']}", shown("controlplane", "reconcile_pass_s")),
        (f"reconcile pass s, queries ({f['reconcile_active_jobs_small']} active)",
         f"{f['reconcile_pass_s_small']}, {f['reconcile_queries_small']}", "queries: no more per job"),
        (f"ingest p50 / p95 ms ({f['agent_connections']} agent connections to {f['ingest_served_by']})",
         f"{f['ingest_p50_ms']} / {f['ingest_p95_ms']}", shown("controlplane", "ingest_p95_ms")),
        ("ingest requests/s", f["ingest_requests_per_s"], ""),
        (f"websocket fan-out p50 / p95 ms ({f['ws_clients_connected']} clients, {f['ws_clients_priority']})",
         f"{f['ws_fanout_p50_ms']} / {f['ws_fanout_p95_ms']}", shown("controlplane", "ws_fanout_p95_ms")),
        ("  from the change (its transaction's rest included)",
         f"{f['ws_change_to_socket_p50_ms']} / {f['ws_change_to_socket_p95_ms']}", ""),
        ("cores used under the load (of this machine's)", ", ".join(
            f"{part} {cores}" for part, cores in f["cores_used_during_steady"].items()), str(os.cpu_count())),
        ("PostgreSQL sessions opened per second under the load", f["db_sessions_opened_per_s"], ""),
        ("logins to PgBouncer per second under the load (each a SCRAM exchange)",
         f.get("pgbouncer_logins_per_s"), ""),
        ("PostgreSQL's autovacuum", f.get("autovacuum", "not recorded"), ""),
        ("this machine's speed: a fixed Python loop on it idle, s", f["reference_loop_s"], "lower is faster"),
        ("errors", f["error_count"], "0"),
    ], figures)


if __name__ == "__main__":
    main()
