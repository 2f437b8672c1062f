"""An elastic job resized on the Kubernetes backend, against the same stateful fake API server (kmock's
KubernetesEmulator through the official client) as test_kubernetes_integration.py: the autoscaler grows
it onto idle GPUs, its learners checkpoint on the signal, and its next attempt's pods are created with
the new count and the new batch while the old attempt's are deleted; every object the backend wrote
validates against the Kubernetes schema.

The kubelet and the learner agents are simulated as in test_kubernetes_integration.py.
"""
import json

import pytest
from django.utils import timezone

from jobs import admission, autoscaler, elasticity, reconcile, storage
from jobs.backends.k8s import objects
from jobs.models import Allocation, Job, Status
from jobs.tests.builders import client_for, job as make_job, member, tar_gz
from jobs.tests.k8s_fake import Kubelet
from jobs.tests.test_kubernetes_integration import (NS, Agent, assert_schema_valid, backend, cluster,  # noqa: F401
                                                    history, use, worker)

pytestmark = pytest.mark.django_db
MANIFEST = """
name: k8s-elastic
learners: 2
gpus: 1
cpus: 2
memory: 1GiB
framework: {name: pytorch, version: "2.5", command: python train.py}
checkpoint: {signal: SIGUSR1, grace_seconds: 30}
elastic: {min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256}, lr_scaling: sqrt}
"""
NETWORKING = "apis/networking.k8s.io/v1"


@pytest.fixture
def autoscaling(backend, monkeypatch, settings):
    """The autoscaler on the Kubernetes backend, with a horizon long enough that doubling pays a restart."""
    use(monkeypatch, backend)
    monkeypatch.setattr(autoscaler, "get_backend", lambda: backend)
    settings.ELASTIC_HORIZON_S, settings.ELASTIC_MIN_INTERVAL_S, settings.ELASTIC_RESIZE_COST_S = 600.0, 300.0, 20.0
    return autoscaler


def submitted():
    target = make_job(member(), learners=2, gpus=1, cpus=2.0, framework="pytorch", manifest_yaml=MANIFEST)
    folder = storage.create_job_dir(target.tenant.slug, target.id)
    (folder / "code.tar.gz").write_bytes(tar_gz({"train.py": b"print('hi')\n"}))
    return target


def run_attempt(cluster, target, attempt, learners):
    """Schedule and run the attempt's pods on node-1/node-2 and have every agent report running."""
    kubelet = Kubelet(cluster)
    agents = [Agent(cluster, target, i, attempt=attempt) for i in range(learners)]
    for i, agent in enumerate(agents):
        name = objects.pod_name(target.id, attempt, i)
        kubelet.schedule(NS, name, node=f"node-{i % 2 + 1}")
        kubelet.run(NS, name)
        agent.send(kind="status", state="preparing")
        agent.send(kind="status", state="running")
    return kubelet, agents


def attempt_config(cluster, target, attempt, index):
    """What the learner's agent reads at start: its env (WORLD_SIZE, RANK, the batch sizes...)."""
    root = cluster.get(f"/api/v1/namespaces/{NS}/configmaps/{objects.attempt_name(target.id, attempt)}")
    return json.loads(root["data"][f"learner-{index}.json"])


def everything_in_the_namespace(cluster):
    """Every object the backend created in the tenant's namespace, as the API server stores it."""
    found = []
    for plural, group in [("pods", "api/v1"), ("services", "api/v1"), ("secrets", "api/v1"),
                          ("configmaps", "api/v1"), ("networkpolicies", NETWORKING)]:
        for name in cluster.names(plural, NS, **({"group": group} if group != "api/v1" else {})):
            found.append(cluster.get(f"/{group}/namespaces/{NS}/{plural}/{name}"))
    return found


def test_an_elastic_jobs_next_attempt_runs_with_the_new_count_and_batch(cluster, autoscaling, worker):
    target = submitted()
    admission.run_cycle()
    worker.run()  # deploy attempt 1
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 1, i) for i in range(2)]
    first = elasticity.shape(elasticity.of(target), 2, None)
    assert attempt_config(cluster, target, 1, 1)["env"]["TRAINYARD_GLOBAL_BATCH_SIZE"] == str(first.global_batch)
    kubelet, agents = run_attempt(cluster, target, 1, 2)
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING
    # Rank 0 reports its progress: 2,000 samples in 20 s at two learners.
    started = timezone.now().timestamp()
    agents[0].send(kind="metric", name="samples", value=0, step=0, time=started - 20)
    agents[0].send(kind="metric", name="samples", value=2000, step=31, time=started)

    # The two other GPUs are idle: the autoscaler grows the job onto them.
    resized, = autoscaling.run()
    assert resized.learners == 4 and resized.attempt == 2
    assert resized.reason.startswith("resized 2→4 learners, batch 64→") and resized.reason.endswith(": idle GPUs")
    worker.run()  # halt_learners: the checkpoint signal, through the pods' annotation
    for i in range(2):
        annotations = cluster.get(f"/api/v1/namespaces/{NS}/pods/{objects.pod_name(target.id, 1, i)}")["metadata"]
        assert objects.HALT_ANNOTATION in annotations["annotations"]
    checkpoint = storage.job_dir("team-a", target.id) / "checkpoints" / "attempt-1" / "model.pt"
    checkpoint.write_bytes(b"weights at sample 2000")
    for i, agent in enumerate(agents):
        agent.exit(0, "halted")
        kubelet.terminate(NS, objects.pod_name(target.id, 1, i), exit_code=0)
    worker.run()  # finish_attempt → the next attempt at once (PENDING) → its deploy, and attempt 1's teardown
    worker.run()

    job = Job.objects.get(pk=target.id)
    assert (job.status, job.attempt, job.learners) == (Status.PENDING, 2, 4)
    assert Status.QUEUED not in history(target)[1:]  # never back through the queue
    # The new attempt's pods exist with the new count; the old attempt's pods and objects are gone.
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 2, i) for i in range(4)]
    assert cluster.names("services", NS) == [objects.attempt_name(target.id, 2)]
    assert cluster.names("secrets", NS) == [objects.secret_name(target.id, 2)]
    assert cluster.names("configmaps", NS) == [objects.attempt_name(target.id, 2)]
    # Every learner's environment carries the new world size and the new batch.
    # (the optimizer chose the batch; the one rule of jobs.elasticity makes the rest of the shape)
    after = elasticity.shape(elasticity.of(job), 4, resized.global_batch)
    assert after.global_batch == resized.global_batch != first.global_batch
    assert (resized.local_batch, resized.lr_scale) == (after.local_batch, pytest.approx(after.lr_scale))
    for i in range(4):
        env = attempt_config(cluster, target, 2, i)["env"]
        assert (env["WORLD_SIZE"], env["RANK"]) == ("4", str(i))
        assert env["TRAINYARD_GLOBAL_BATCH_SIZE"] == str(after.global_batch)
        assert env["TRAINYARD_LOCAL_BATCH_SIZE"] == str(after.global_batch // 4)
        assert float(env["TRAINYARD_LR_SCALE"]) == pytest.approx(after.lr_scale)
    written = everything_in_the_namespace(cluster)
    assert sorted({obj["kind"] for obj in written}) == ["ConfigMap", "NetworkPolicy", "Pod", "Secret", "Service"]
    for obj in written:
        assert_schema_valid(obj)

    # The new attempt runs: its allocation row starts, and the resize's cost is measured.
    run_attempt(cluster, target, 2, 4)
    reconcile.reconcile()
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING
    old, new = Allocation.objects.filter(job=target).order_by("attempt")
    assert (old.learners, old.samples_end, old.ended_at is not None) == (2, 2000, True)
    assert (new.learners, new.samples_start, new.resize_cost_s is not None) == (4, 2000, True)
    timeline = client_for(target.tenant.memberships.get()).get(f"/api/v1/jobs/{target.id}/allocations/").json()
    assert [(r["attempt"], r["learners"], r["global_batch"]) for r in timeline["results"]] == [
        (1, 2, first.global_batch), (2, 4, after.global_batch)]
