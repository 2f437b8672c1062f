"""The Kubernetes backend's test lifecycle, shared by the Kubernetes integration and elastic tests: a
fake cluster (tests.support.k8s_fake), the backend on it made the lifecycle's, the outbox's work run
in-process, and each learner agent played by sending the ingest records it would send.

Its fixtures (`cluster`, `backend`, `worker`) are imported by the modules that use them rather than
registered for every test: `cluster` means other things elsewhere (tenants' tests have their own).
"""
import base64
import json
import time

import kubernetes_validate
import pytest

from jobs import admission, lifecycle, outbox, reconcile, storage, tasks
from jobs.backends.k8s import objects
from jobs.backends.k8s.api import KubeApi, api_client_for
from jobs.backends.k8s.backend import K8sConfig, KubernetesBackend
from jobs.backends.k8s.watcher import PodWatcher
from jobs.ingest import authenticate, ingest
from jobs.models import Job
from tests.support.k8s_fake import FakeCluster

NS = "trainyard-team-a"


CONFIG = K8sConfig(namespace_prefix="trainyard-", image_prefix="registry.example/learner-", image_tag="1.0",
                   agent_image="registry.example/learner-agent:1.0",
                   storage_volume={"persistentVolumeClaim": {"claimName": "trainyard-storage"}},
                   platform=objects.Platform(namespace="trainyard", ingest_port=8000),
                   ingest_url="http://trainyard-web.trainyard.svc:8000", resource_sample_s=5.0)


@pytest.fixture
def cluster():
    fake = FakeCluster().start()
    fake.add_node("node-1", gpus=2)
    fake.add_node("node-2", gpus=2)
    fake.add_node("node-3", gpus=8, cordoned=True)
    yield fake
    fake.stop()


def new_backend(cluster, *, watcher=False, quota=None):
    api = KubeApi(api_client_for(cluster.url), retries=1, backoff_s=0.01)
    return KubernetesBackend(api, CONFIG, quota_for=lambda slug: quota,
                             watcher=PodWatcher(api) if watcher else None)


def use(monkeypatch, chosen):
    """Make `chosen` the backend of the lifecycle (what get_backend() returns with TRAINYARD_BACKEND=kubernetes)."""
    for module in (lifecycle, reconcile, admission):
        monkeypatch.setattr(module, "get_backend", lambda: chosen)
    return chosen


@pytest.fixture
def backend(cluster, monkeypatch):
    return use(monkeypatch, new_backend(cluster, quota={"gpus": 4, "cpus": 16, "memory_bytes": 64 * 2**30, "jobs": 2}))


class Worker:
    """Runs the lifecycle's Celery tasks in-process, in the order they were sent, and a scheduling
    cycle where the scheduling loop was woken (as "schedule")."""
    TASKS = {"schedule": lambda: admission.run_cycle(),
             "follow_up": lambda row_id: outbox.run(row_id, tasks.HANDLERS)}

    def __init__(self):
        self.sent = []

    def run(self):
        while self.sent:
            name, args = self.sent.pop(0)
            self.TASKS[name](*args)


@pytest.fixture
def worker(monkeypatch):
    running = Worker()
    monkeypatch.setattr("jobs.dispatch.send", lambda name, *args, countdown=None: running.sent.append((name, args)))
    monkeypatch.setattr("jobs.dispatch.send_on_commit", lambda name, *args: running.sent.append((name, args)))
    monkeypatch.setattr("jobs.dispatch.wake_scheduler", lambda: running.sent.append(("schedule", ())))
    monkeypatch.setattr("jobs.dispatch.wake_scheduler_on_commit", lambda: running.sent.append(("schedule", ())))
    return running


class Agent:
    """What one learner agent sends and writes, as learner_agent does it inside the pod."""

    def __init__(self, cluster, target, index, attempt=1):
        self.job, self.index, self.attempt, self.seq = target, index, attempt, 0
        namespace = objects.namespace_name(CONFIG.namespace_prefix, target.tenant.slug)
        secret = cluster.get(f"/api/v1/namespaces/{namespace}/secrets/{objects.secret_name(target.id, attempt)}")
        key = objects.credential_key(index)
        self.token = secret.get("stringData", {}).get(key) or base64.b64decode(secret["data"][key]).decode()

    def send(self, **record):
        self.seq += 1
        ingest(authenticate(self.job.id, self.token), {"attempt": self.attempt, "learner": self.index,
                                                       "records": [{"seq": self.seq, "time": time.time(), **record}]})

    def exit(self, exit_code, reason=""):
        self.write_exit_record(exit_code, reason)
        self.send(kind="status", state="exited", exit_code=exit_code, reason=reason)

    def write_exit_record(self, exit_code, reason=""):
        folder = storage.learner_dir(self.job.tenant.slug, self.job.id, self.attempt, self.index)
        (folder / "exit.json").write_text(json.dumps({"exit_code": exit_code, "reason": reason}))


def history(target):
    return list(Job.objects.get(pk=target.id).events.order_by("id").values_list("to_status", flat=True))


def assert_schema_valid(obj):
    try:
        kubernetes_validate.validate(obj, "1.34.0", strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj.get('kind')} {obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
