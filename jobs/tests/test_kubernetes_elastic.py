"""Elastic jobs on the Kubernetes backend, against the same stateful fake API server (kmock's
KubernetesEmulator through the official client) as test_kubernetes_integration.py, on its cluster
(tests/support/k8s_lifecycle.py): node-1 and node-2 with 2 GPUs each (node-3 is cordoned), 4 GPUs in all.

- a grow: the autoscaler grows a job onto idle GPUs, its learners checkpoint on the signal, and its
  next attempt's pods are created with the new count and the new batch while the old attempt's are
  deleted;
- the whole flow of tests/e2e/test_elastic.py: started at 2 learners while another tenant holds 2
  GPUs, grown to 4 when they free (twice the largest shape it measured), shrunk to 2 for a
  high-priority job of its own tenant, completed;
- a learner that ignores the resize signal is killed by its agent and named.

Every object the backend wrote validates against the Kubernetes schema. The kubelet and the learner
agents are simulated as in test_kubernetes_integration.py: the kubelet PATCHes pod status (running
each pod on the node the backend pinned it to), and each agent sends what learner_agent sends.
"""
import contextlib
import io
import json
import time

import pytest
from django.utils import timezone

import learner_agent
from jobs import admission, autoscaler, lifecycle, reconcile, storage
from jobs.backends.k8s import objects
from jobs.models import Allocation, Artifact, Job, Learner, Status
from learner_agent.metrics import MetricExtractor
from tests.support.builders import client_for, job as make_job, member, tar_gz
from tests.support.k8s_fake import Kubelet
from tests.support.k8s_lifecycle import (CONFIG, NS, Agent, assert_schema_valid, backend, cluster,  # noqa: F401
                                         history, use, worker)
from trainyard import elasticity

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
ELASTIC_FOUR = MANIFEST.replace("learners: 2", "learners: 4")
FIXED = """
name: {name}
learners: {learners}
gpus: {gpus}
cpus: 2
memory: 1GiB
priority: {priority}
framework: {{name: pytorch, version: "2.5", command: python train.py}}
checkpoint: {{signal: SIGUSR1, grace_seconds: 30}}
"""
NETWORKING = "apis/networking.k8s.io/v1"
# What the backend writes: each tenant's namespace with its quota, limits and policy, and per attempt
# a root ConfigMap owning the ingest Secret, the headless Service, the peers policy and the pods.
EVERY_KIND = {"Namespace", "ResourceQuota", "LimitRange", "NetworkPolicy", "ConfigMap", "Secret", "Service", "Pod"}


@pytest.fixture
def autoscaling(backend, monkeypatch, settings):
    """The autoscaler on the Kubernetes backend, with a horizon long enough that doubling pays a restart."""
    use(monkeypatch, backend)
    monkeypatch.setattr(autoscaler, "get_backend", lambda: backend)
    settings.ELASTIC_HORIZON_S, settings.ELASTIC_MIN_INTERVAL_S, settings.ELASTIC_RESIZE_COST_S = 600.0, 300.0, 20.0
    settings.ELASTIC_GROW_SETTLE_S = 0.0  # the settle window has its own tests
    return autoscaler


def submitted(membership=None, manifest=MANIFEST, *, learners=2, gpus=1, **fields):
    target = make_job(membership or member(), learners=learners, gpus=gpus, cpus=2.0, framework="pytorch",
                      manifest_yaml=manifest, **fields)
    folder = storage.create_job_dir(target.tenant.slug, target.id)
    (folder / "code.tar.gz").write_bytes(tar_gz({"train.py": b"print('hi')\n"}))
    return target


def attempt_config(cluster, target, attempt, index):
    """What the learner's agent reads at start: its env (WORLD_SIZE, RANK, the batch sizes...)."""
    root = cluster.get(f"/api/v1/namespaces/{NS}/configmaps/{objects.attempt_name(target.id, attempt)}")
    return json.loads(root["data"][f"learner-{index}.json"])


def fixed(membership, name, *, learners, gpus=1, priority="normal"):
    manifest = FIXED.format(name=name, learners=learners, gpus=gpus, priority=priority)
    return submitted(membership, manifest, learners=learners, gpus=gpus, priority=priority)


def namespace_of(target):
    return objects.namespace_name(CONFIG.namespace_prefix, target.tenant.slug)


def pod_of(cluster, target, attempt, index):
    return cluster.get(f"/api/v1/namespaces/{namespace_of(target)}/pods/{objects.pod_name(target.id, attempt, index)}")


def gpus_of(placement):
    return {(p["node"], gpu) for p in placement for gpu in p["gpu_ids"]}


def pinned_node(pod):
    """The node the backend pinned the pod to (what kube-scheduler must honour)."""
    required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return required["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]


def start_pods(cluster, target, attempt):
    """The kubelet runs each pod of the attempt on the node it is pinned to, and every agent reports
    running. Returns (kubelet, agents)."""
    job = Job.objects.get(pk=target.id)
    kubelet, agents = Kubelet(cluster), []
    for index in range(job.learners):
        pod = pod_of(cluster, target, attempt, index)
        assert pinned_node(pod) == job.placement[index]["node"]
        kubelet.schedule(namespace_of(target), pod["metadata"]["name"], node=pinned_node(pod))
        kubelet.run(namespace_of(target), pod["metadata"]["name"])
        agent = Agent(cluster, target, index, attempt=attempt)
        agent.send(kind="status", state="preparing")
        agent.send(kind="status", state="running")
        agents.append(agent)
    return kubelet, agents


def stop_pods(cluster, target, kubelet, agents, reason=""):
    """Every learner of the attempt exits 0 (saying `reason`); its agent reports and its pod succeeds."""
    for agent in agents:
        agent.exit(0, reason)
        name = objects.pod_name(target.id, agent.attempt, agent.index)
        kubelet.terminate(namespace_of(target), name, exit_code=0)


def report_noise_scale(agent, value, *, step, at):
    """Rank 0's `noise_scale` report (learner_agent.goodput): a large one, so a bigger batch pays."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        learner_agent.report(noise_scale=value, step=step)
    for point in MetricExtractor().extract(printed.getvalue().strip()):
        agent.send(kind="metric", **point, time=at)


def report_samples(agent, samples, *, step, at):
    """What rank 0's agent sends when its learner calls learner_agent.report(samples=N): the printed
    line as a log record, and the metric point the agent's extractor finds in it (learner_agent.agent)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        learner_agent.report(samples=samples, step=step)
    for line in printed.getvalue().splitlines():
        agent.send(kind="log", stream="stdout", line=line, time=at)
        for point in MetricExtractor().extract(line):
            agent.send(kind="metric", **point, time=at)


def gpus_requested_per_node(cluster):
    """{node: GPUs requested by its pods that have not ended}, over every tenant's namespace: what
    kube-scheduler would have to fit into the node's allocatable GPUs."""
    requested = {}
    for namespace in tenant_namespaces(cluster):
        for name in cluster.names("pods", namespace):
            pod = cluster.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            gpus = sum(int(c["resources"]["requests"].get(objects.GPU_RESOURCE, 0)) for c in pod["spec"]["containers"])
            requested[pinned_node(pod)] = requested.get(pinned_node(pod), 0) + gpus
    return requested


def tenant_namespaces(cluster):
    listing = cluster.get("/api/v1/namespaces") or {}
    return sorted(item["metadata"]["name"] for item in listing.get("items", [])
                  if item["metadata"]["name"].startswith(CONFIG.namespace_prefix))


def assert_fits_the_nodes(cluster):
    allocatable = {n["metadata"]["name"]: int(n["status"]["allocatable"][objects.GPU_RESOURCE])
                   for n in cluster.get("/api/v1/nodes")["items"]}
    for node, gpus in gpus_requested_per_node(cluster).items():
        assert gpus <= allocatable[node], f"{node}: {gpus} GPUs requested, {allocatable[node]} allocatable"


def everything_the_backend_wrote(cluster):
    """Every object in every tenant namespace, and the namespaces themselves, as the API server stores them."""
    found = []
    for namespace in tenant_namespaces(cluster):
        found.append(cluster.get(f"/api/v1/namespaces/{namespace}"))
        for plural, group in [("pods", "api/v1"), ("services", "api/v1"), ("secrets", "api/v1"),
                              ("configmaps", "api/v1"), ("resourcequotas", "api/v1"), ("limitranges", "api/v1"),
                              ("networkpolicies", NETWORKING)]:
            for name in cluster.names(plural, namespace, group=group):
                found.append(cluster.get(f"/{group}/namespaces/{namespace}/{plural}/{name}"))
    return found


def assert_all_schema_valid(cluster):
    """Every object the backend wrote validates; returns the kinds there were."""
    written = everything_the_backend_wrote(cluster)
    for obj in written:
        assert_schema_valid(obj)
    return {obj["kind"] for obj in written}


def test_an_elastic_jobs_next_attempt_runs_with_the_new_count_and_batch(cluster, autoscaling, worker):
    target = submitted()
    admission.run_cycle()
    worker.run()  # deploy attempt 1
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 1, i) for i in range(2)]
    first = elasticity.shape(elasticity.of(target), 2, None)
    assert attempt_config(cluster, target, 1, 1)["env"]["TRAINYARD_GLOBAL_BATCH_SIZE"] == str(first.global_batch)
    kubelet, agents = start_pods(cluster, target, 1)
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING
    # Rank 0 reports its progress: 2,000 samples in 20 s at two learners.
    started = timezone.now().timestamp()
    report_samples(agents[0], 0, step=0, at=started - 20)
    report_samples(agents[0], 2000, step=31, at=started)
    report_noise_scale(agents[0], 100_000.0, step=31, at=started)

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
    # (the optimizer chose the batch; the one rule of trainyard.elasticity makes the rest of the shape)
    after = elasticity.shape(elasticity.of(job), 4, resized.global_batch)
    assert after.global_batch == resized.global_batch != first.global_batch
    assert (resized.local_batch, resized.lr_scale) == (after.local_batch, pytest.approx(after.lr_scale))
    for i in range(4):
        env = attempt_config(cluster, target, 2, i)["env"]
        assert (env["WORLD_SIZE"], env["RANK"]) == ("4", str(i))
        assert env["TRAINYARD_GLOBAL_BATCH_SIZE"] == str(after.global_batch)
        assert env["TRAINYARD_LOCAL_BATCH_SIZE"] == str(after.global_batch // 4)
        assert float(env["TRAINYARD_LR_SCALE"]) == pytest.approx(after.lr_scale)
    assert assert_all_schema_valid(cluster) == EVERY_KIND

    # The new attempt runs: its allocation row starts, and the resize's cost is measured.
    start_pods(cluster, target, 2)
    reconcile.reconcile()
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING
    old, new = Allocation.objects.filter(job=target).order_by("attempt")
    assert (old.learners, old.samples_end, old.ended_at is not None) == (2, 2000, True)
    assert (new.learners, new.samples_start, new.resize_cost_s is not None) == (4, 2000, True)
    timeline = client_for(target.tenant.memberships.get()).get(f"/api/v1/jobs/{target.id}/allocations/").json()
    assert [(r["attempt"], r["learners"], r["global_batch"]) for r in timeline["results"]] == [
        (1, 2, first.global_batch), (2, 4, after.global_batch)]


# --- the whole flow: start small, grow, shrink for the tenant, complete ----------------------------
def test_an_elastic_job_starts_small_grows_shrinks_for_its_tenant_and_completes(cluster, autoscaling, worker):
    """The flow of tests/e2e/test_elastic.py on the Kubernetes backend: node-1 and node-2 have 2 GPUs
    each (node-3 is cordoned), so the cluster has 4."""
    alice = member()
    # Another tenant's fixed job holds 2 of the 4 GPUs.
    busy = fixed(member("team-b", "bob"), "busy", learners=2)
    admission.run_cycle()
    worker.run()
    busy_kubelet, busy_agents = start_pods(cluster, busy, 1)
    assert Job.objects.get(pk=busy.id).status == Status.PROCESSING

    # The elastic job asks for 4 learners; two GPUs are free: it starts with 2.
    target = submitted(alice, ELASTIC_FOUR, learners=4)
    admission.run_cycle()
    job = Job.objects.get(pk=target.id)
    assert (job.status, job.learners) == (Status.PENDING, 2)
    assert job.status_reason.startswith("admitted with 2 of its 4 learners")
    worker.run()  # deploy attempt 1
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 1, i) for i in range(2)]
    env = attempt_config(cluster, target, 1, 0)["env"]
    assert (env["TRAINYARD_GLOBAL_BATCH_SIZE"], env["TRAINYARD_LOCAL_BATCH_SIZE"], env["NUM_LEARNERS"]) == (
        "64", "32", "2")
    assert env["WORLD_SIZE"] == "2"
    assert assert_all_schema_valid(cluster) == EVERY_KIND
    assert_fits_the_nodes(cluster)
    kubelet, agents = start_pods(cluster, target, 1)
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING
    now = time.time()
    report_samples(agents[0], 0, step=0, at=now - 20)
    report_samples(agents[0], 2000, step=31, at=now)  # 100 samples/s at two learners
    report_noise_scale(agents[0], 100_000.0, step=31, at=now)

    # The busy job completes: its GPUs are idle, and the autoscaler grows the elastic job onto them.
    stop_pods(cluster, busy, busy_kubelet, busy_agents)
    worker.run()  # finish, teardown
    assert Job.objects.get(pk=busy.id).status == Status.COMPLETED
    assert cluster.names("pods", namespace_of(busy)) == []
    grow, = autoscaling.run()
    assert (grow.attempt, grow.learners) == (2, 4)
    assert grow.reason.startswith("resized 2→4 learners, batch 64→") and grow.reason.endswith(": idle GPUs")
    worker.run()  # halt_learners: the checkpoint signal, through the pod's annotation
    for i in range(2):
        assert objects.HALT_ANNOTATION in pod_of(cluster, target, 1, i)["metadata"]["annotations"]
    assert_all_schema_valid(cluster)  # the annotated pod too
    checkpoints = storage.job_dir("team-a", target.id) / "checkpoints"
    (checkpoints / "attempt-1" / "model.pt").write_bytes(b"weights at sample 2000")
    stop_pods(cluster, target, kubelet, agents, "halted")
    worker.run()  # finish_attempt → attempt 2 at once (PENDING) → its deploy, and attempt 1's teardown

    job = Job.objects.get(pk=target.id)
    assert (job.status, job.attempt, job.learners) == (Status.PENDING, 2, 4)
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 2, i) for i in range(4)]
    assert cluster.names("configmaps", NS) == [objects.attempt_name(target.id, 2)]
    assert cluster.names("secrets", NS) == [objects.secret_name(target.id, 2)]
    assert cluster.names("services", NS) == [objects.attempt_name(target.id, 2)]
    policies = cluster.names("networkpolicies", NS, group=NETWORKING)
    assert objects.peers_policy_name(target.id, 2) in policies
    assert objects.peers_policy_name(target.id, 1) not in policies
    grown = elasticity.shape(elasticity.of(job), 4, grow.global_batch)
    assert grown.global_batch != 64
    for i in range(4):
        env = attempt_config(cluster, target, 2, i)["env"]
        assert (env["WORLD_SIZE"], env["RANK"]) == ("4", str(i))
        assert env["TRAINYARD_GLOBAL_BATCH_SIZE"] == str(grown.global_batch)
        assert env["TRAINYARD_LOCAL_BATCH_SIZE"] == str(grown.local_batch)
        assert env["RESUME_FROM"].endswith("attempt-1/model.pt")
    assert_all_schema_valid(cluster)
    assert_fits_the_nodes(cluster)
    kubelet, agents = start_pods(cluster, target, 2)
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING
    now = time.time()
    report_samples(agents[0], 2000, step=31, at=now)  # restored from the checkpoint, then counting on
    report_samples(agents[0], 10000, step=62, at=now + 1)

    # A high-priority job of the same tenant needs 2 GPUs: the elastic job shrinks to make room.
    urgent = fixed(alice, "urgent", learners=1, gpus=2, priority="high")
    admission.run_cycle()
    job = Job.objects.get(pk=target.id)
    assert job.status == Status.HALTING and not job.preempted_reason  # a shrink, not a preemption
    shrink = Allocation.objects.get(job=target, attempt=3)
    assert shrink.learners == 2
    assert shrink.reason == f"resized 4→2 learners, batch {grown.global_batch}→{shrink.global_batch}: " \
                            f"making room for job {urgent.id}"
    waiting = Job.objects.get(pk=urgent.id)
    assert waiting.status == Status.QUEUED and f"for elastic job {target.id} to shrink" in waiting.wait_reason
    kept = list(shrink.placement)
    freed = [p for p in job.placement if p not in kept]
    worker.run()  # halt_learners
    for i in range(4):
        assert objects.HALT_ANNOTATION in pod_of(cluster, target, 2, i)["metadata"]["annotations"]
    (checkpoints / "attempt-2" / "model.pt").write_bytes(b"weights at sample 10000")
    stop_pods(cluster, target, kubelet, agents, "halted")
    worker.run()  # attempt 3 at once, its deploy, attempt 2's teardown

    job = Job.objects.get(pk=target.id)
    assert (job.status, job.attempt, job.learners, job.placement) == (Status.PENDING, 3, 2, kept)
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 3, i) for i in range(2)]
    for i in range(2):
        env = attempt_config(cluster, target, 3, i)["env"]
        assert (env["WORLD_SIZE"], env["RANK"]) == ("2", str(i))
        assert env["TRAINYARD_GLOBAL_BATCH_SIZE"] == str(shrink.global_batch)
        assert env["RESUME_FROM"].endswith("attempt-2/model.pt")
    admission.run_cycle()  # the urgent job on the GPUs the elastic job gave back
    admitted = Job.objects.get(pk=urgent.id)
    assert admitted.status == Status.PENDING and gpus_of(admitted.placement) == gpus_of(freed)
    worker.run()  # deploy the urgent job
    assert {pinned_node(pod_of(cluster, urgent, 1, 0))} == {node for node, _ in gpus_of(freed)}
    assert_all_schema_valid(cluster)
    assert_fits_the_nodes(cluster)
    kubelet, agents = start_pods(cluster, target, 3)
    now = time.time()
    report_samples(agents[0], 10000, step=62, at=now)
    report_samples(agents[0], 16000, step=109, at=now + 1)

    # Every learner exits 0: the job completes, its results stored.
    (storage.job_dir("team-a", target.id) / "results" / "accuracy.txt").write_text("0.97\n")
    stop_pods(cluster, target, kubelet, agents)
    worker.run()  # finish_attempt, teardown
    done = Job.objects.get(pk=target.id)
    assert (done.status, done.attempt, done.exit_code) == (Status.COMPLETED, 3, 0), done.status_reason
    assert Artifact.objects.filter(job=target, name="results/accuracy.txt").exists()
    assert cluster.names("pods", NS) == [objects.pod_name(urgent.id, 1, 0)]

    events = list(done.events.order_by("id").values_list("to_status", "actor", "reason"))
    # The resizes went on as the next attempt each: never through the queue, never halted or preempted.
    assert not {Status.QUEUED, Status.HALTED} & {status for status, _, _ in events}
    assert (Status.HALTING, "autoscaler", f"resizing: {grow.reason}") in events
    assert (Status.HALTING, "scheduler", f"resizing: {shrink.reason}") in events
    resumed = [reason for status, _, reason in events if status == Status.PENDING][1:]
    assert resumed == [f"{grow.reason} (resumes from model.pt)", f"{shrink.reason} (resumes from model.pt)"]
    timeline = client_for(alice).get(f"/api/v1/jobs/{target.id}/allocations/").json()["results"]
    assert [(r["attempt"], r["learners"]) for r in timeline] == [(1, 2), (2, 4), (3, 2)]
    assert [(r["samples_start"], r["samples_end"]) for r in timeline] == [(0, 2000), (2000, 10000), (10000, 16000)]
    assert all(r["resize_cost_s"] is not None for r in timeline[1:])


def test_a_learner_that_ignores_the_resize_signal_is_killed_by_its_agent_and_named(cluster, backend, worker):
    """On Kubernetes the signal of a resize is the halt annotation, as for a halt, and the agent in the
    pod enforces the grace period the same way (learner_agent/tests/test_kubernetes_mode.py): it kills
    the learner and ends with 137 and its reason, and the pod succeeds. Here learner 1's `exited`
    report never arrives, so reconcile learns it from the pod and the exit record on shared storage."""
    target = submitted()
    admission.run_cycle()
    worker.run()
    kubelet, agents = start_pods(cluster, target, 1)
    job = Job.objects.get(pk=target.id)
    lifecycle.resize(job, learners=1, placement=job.placement[:1], why="GPUs for other elastic jobs",
                     actor="autoscaler")
    worker.run()  # halt_learners
    for i in range(2):
        assert objects.HALT_ANNOTATION in pod_of(cluster, target, 1, i)["metadata"]["annotations"]
    agents[0].exit(0, "halted")
    agents[1].write_exit_record(137, "halted: grace period expired, killed")  # what the agent writes then
    for i in range(2):
        kubelet.terminate(NS, objects.pod_name(target.id, 1, i), exit_code=0)  # the agent itself ends well
    reconcile.reconcile()
    worker.run()  # finish_attempt → attempt 2 at once, its deploy, attempt 1's teardown

    job = Job.objects.get(pk=target.id)
    assert (job.status, job.attempt, job.learners) == (Status.PENDING, 2, 1)
    assert "learner 1 ignored the signal and was killed after the grace period" in job.status_reason
    ignored = Learner.objects.get(job=target, attempt=1, index=1)
    assert (ignored.state, ignored.exit_code, ignored.reason) == (
        Learner.State.EXITED, 137, "halted: grace period expired, killed")
    assert cluster.names("pods", NS) == [objects.pod_name(target.id, 2, 0)]
