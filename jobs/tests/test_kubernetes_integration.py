"""The Kubernetes backend driving real job lifecycles against a stateful fake API server over HTTP
(kmock's KubernetesEmulator, see tests/support/k8s_fake.py) through the official client.

The lifecycle is the real one (jobs.lifecycle, with the outbox's work run in-process by `worker`); the
kubelet is simulated by PATCHing pod status, and each learner agent by sending the ingest batches it
would send (reading its token from the attempt's Secret and writing its exit.json): the harness is
tests/support/k8s_lifecycle.py. What only a real cluster shows (scheduling, the garbage collector,
NetworkPolicy enforcement, the agent in a real pod) is listed in docs/kubernetes.md.
"""
import json
import os
import time
from datetime import timedelta

import pytest
import yaml
from django.utils import timezone

from jobs import admission, lifecycle, reconcile, storage
from jobs.backends.base import BackendError
from jobs.backends.k8s import objects
from jobs.backends.k8s import backend as k8s_backend
from jobs.backends.k8s.api import Gone, KubeApi, NotFound, api_client_for
from jobs.backends.k8s.watcher import PodWatcher
from jobs.models import Job, Learner, Status
from tests.support.builders import job as make_job, member, tar_gz
from tests.support.k8s_fake import FakeCluster, Kubelet
from tests.support.k8s_lifecycle import (CONFIG, NS, Agent, assert_schema_valid, backend, cluster, history,  # noqa: F401
                                         new_backend, use, worker)

pytestmark = pytest.mark.django_db
MANIFEST = """
name: k8s-job
learners: {learners}
gpus: 1
cpus: 2
memory: 1GiB
framework: {{name: pytorch, version: "2.5", command: python train.py}}
checkpoint: {{signal: SIGUSR1, grace_seconds: 30}}
"""


def submitted(learners=2):
    target = make_job(member(), learners=learners, gpus=1, cpus=2.0, framework="pytorch",
                      manifest_yaml=MANIFEST.format(learners=learners))
    folder = storage.create_job_dir(target.tenant.slug, target.id)
    (folder / "code.tar.gz").write_bytes(tar_gz({"train.py": b"print('hi')\n"}))
    return target


def status_of(target):
    return Job.objects.get(pk=target.id).status


def deployed(cluster, target, worker, learners):
    """Submit → admitted → deployed → both pods running and reported (PROCESSING)."""
    admission.run_cycle()
    worker.run()
    kubelet = Kubelet(cluster)
    agents = [Agent(cluster, target, i) for i in range(learners)]
    for i, agent in enumerate(agents):
        kubelet.schedule(NS, objects.pod_name(target.id, 1, i), node=f"node-{i % 2 + 1}")
        kubelet.run(NS, objects.pod_name(target.id, 1, i))
        agent.send(kind="status", state="preparing")
        agent.send(kind="status", state="running")
    return kubelet, agents


# --- the lifecycle -------------------------------------------------------------------------------
def test_a_two_learner_job_goes_from_queued_to_completed(cluster, backend, worker):
    target = submitted(learners=2)
    assert status_of(target) == Status.QUEUED
    admission.run_cycle()
    assert status_of(target) == Status.PENDING
    worker.run()  # deploy_job

    pods = [objects.pod_name(target.id, 1, i) for i in range(2)]
    assert cluster.names("pods", NS) == pods
    assert cluster.names("services", NS) == [objects.attempt_name(target.id, 1)]
    assert cluster.names("secrets", NS) == [objects.secret_name(target.id, 1)]
    assert Learner.objects.filter(job=target, attempt=1).count() == 2
    root = cluster.get(f"/api/v1/namespaces/{NS}/configmaps/{objects.attempt_name(target.id, 1)}")
    for path in [f"/api/v1/namespaces/{NS}/pods/{pods[1]}",
                 f"/api/v1/namespaces/{NS}/services/{objects.attempt_name(target.id, 1)}",
                 f"/api/v1/namespaces/{NS}/secrets/{objects.secret_name(target.id, 1)}",
                 f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/"
                 f"{objects.peers_policy_name(target.id, 1)}"]:
        child = cluster.get(path)
        assert_schema_valid(child)
        assert child["metadata"]["ownerReferences"][0]["uid"] == root["metadata"]["uid"]
        assert child["metadata"]["labels"][objects.LABEL_JOB] == target.id
    config = json.loads(root["data"]["learner-1.json"])
    assert config["env"]["MASTER_ADDR"] == f"{pods[0]}.{objects.attempt_name(target.id, 1)}.{NS}.svc"
    assert config["env"]["RANK"] == "1" and config["env"]["WORLD_SIZE"] == "2"
    assert config["ingest_url"] == f"http://trainyard-web.trainyard.svc:8000/api/v1/ingest/{target.id}/"
    assert "ingest_token" not in config
    assert config["resource_sample_s"] == CONFIG.resource_sample_s > 0  # resource samples, as on local
    pod = cluster.get(f"/api/v1/namespaces/{NS}/pods/{pods[0]}")
    assert pod["spec"]["containers"][0]["image"] == "pytorch/pytorch:2.5"  # from the framework registry
    assert pod["spec"]["initContainers"][0]["image"] == "registry.example/learner-agent:1.0"

    kubelet, agents = deployed(cluster, target, worker, learners=2)
    reconcile.reconcile()  # running pods change nothing
    assert status_of(target) == Status.PROCESSING
    for agent in agents:
        agent.send(kind="log", stream="stdout", line="epoch 1 loss 0.3")
        agent.exit(0)
    for name in pods:
        kubelet.terminate(NS, name, exit_code=0)
    worker.run()  # finish_attempt
    assert status_of(target) == Status.COMPLETED
    assert history(target) == [Status.PENDING, Status.DOWNLOADING, Status.PROCESSING, Status.STORING,
                               Status.COMPLETED]


def test_an_oom_killed_learner_fails_the_job_with_that_reason(cluster, backend, worker):
    target = submitted(learners=1)
    kubelet, _ = deployed(cluster, target, worker, learners=1)
    # The container was killed by the kernel: the agent died with it and reported nothing.
    kubelet.terminate(NS, objects.pod_name(target.id, 1, 0), exit_code=137, reason="OOMKilled")
    reconcile.reconcile()
    worker.run()
    failed = Job.objects.get(pk=target.id)
    assert failed.status == Status.FAILED
    assert "learner 0 exited with code 137 (OOMKilled: memory limit 1.0GiB exceeded)" in failed.status_reason


def test_halt_checkpoints_then_the_pods_are_deleted(cluster, backend, worker):
    target = submitted(learners=2)
    kubelet, agents = deployed(cluster, target, worker, learners=2)
    lifecycle.halt(Job.objects.get(pk=target.id), actor="alice")
    worker.run()  # halt_learners
    pods = [objects.pod_name(target.id, 1, i) for i in range(2)]
    for name in pods:  # what the agent reads through its downward-API file
        annotations = cluster.get(f"/api/v1/namespaces/{NS}/pods/{name}")["metadata"]["annotations"]
        assert objects.HALT_ANNOTATION in annotations
    # Each agent signals its learner, which writes a checkpoint; then the agent reports and exits.
    checkpoint = storage.job_dir("team-a", target.id) / "checkpoints" / "attempt-1" / "model.pt"
    checkpoint.write_bytes(b"weights")
    for agent in agents:
        agent.exit(0, "halted")
    for name in pods:
        kubelet.terminate(NS, name, exit_code=0)
    worker.run()  # finish_attempt
    halted = Job.objects.get(pk=target.id)
    assert halted.status == Status.HALTED
    assert "resume continues from checkpoint model.pt" in halted.status_reason
    assert checkpoint.read_bytes() == b"weights"
    # The attempt's pods stay until teardown; see the report: finish_attempt should enqueue it.
    lifecycle.teardown(target.id, 1)
    assert cluster.names("pods", NS) == []
    assert cluster.names("configmaps", NS) == [] and cluster.names("secrets", NS) == []
    assert cluster.names("services", NS) == []


def test_a_halt_the_learners_ignore_is_ended_by_deleting_them_once_its_grace_is_over(cluster, backend, worker):
    # The agent runs on the job's own image, which may do nothing when asked to halt.
    target = submitted(learners=2)
    deployed(cluster, target, worker, learners=2)
    lifecycle.halt(Job.objects.get(pk=target.id), actor="alice")
    worker.run()  # halt_learners: the annotation, which nothing reads
    reconcile.reconcile()
    worker.run()
    assert status_of(target) == Status.HALTING and len(cluster.names("pods", NS)) == 2  # within its grace
    grace = 30 + reconcile.HALT_SLACK_S  # the manifest's grace_seconds, and the slack
    Job.objects.get(pk=target.id).events.filter(to_status=Status.HALTING).update(
        time=timezone.now() - timedelta(seconds=grace + 1))
    reconcile.reconcile()
    worker.run()
    assert cluster.names("pods", NS) == []
    assert status_of(target) == Status.HALTED
    assert set(Learner.objects.filter(job=target).values_list("state", "reason")) == {
        ("lost", "did not stop within its halt grace; it was deleted")}


def test_a_restarted_worker_reconciles_from_a_fresh_list(cluster, backend, worker, monkeypatch):
    target = submitted(learners=2)
    kubelet, agents = deployed(cluster, target, worker, learners=2)
    # The worker dies; meanwhile both learners finish, but their `exited` reports never arrive.
    for index, agent in enumerate(agents):
        agent.write_exit_record(0)
        kubelet.terminate(NS, objects.pod_name(target.id, 1, index), exit_code=0)
    restarted = new_backend(cluster, watcher=True)
    restarted.watcher.sync()
    assert restarted.watcher.fresh()
    use(monkeypatch, restarted)
    reconcile.reconcile()
    worker.run()
    assert status_of(target) == Status.COMPLETED
    assert sorted(Learner.objects.filter(job=target).values_list("exit_code", flat=True)) == [0, 0]


def test_an_image_that_cannot_be_pulled_fails_the_job(cluster, backend, worker):
    target = submitted(learners=1)
    admission.run_cycle()
    worker.run()
    Kubelet(cluster).image_pull_backoff(NS, objects.pod_name(target.id, 1, 0), "pull access denied")
    reconcile.reconcile()
    worker.run()
    failed = Job.objects.get(pk=target.id)
    assert failed.status == Status.FAILED
    reason = "learner 0 did not start: image pull failed: registry.example/nope:1: pull access denied"
    assert reason in failed.status_reason


def test_a_pod_that_stays_unschedulable_fails_the_job_with_the_schedulers_reason(cluster, backend, worker):
    target = submitted(learners=1)
    admission.run_cycle()
    worker.run()
    message = "0/3 nodes are available: 2 Insufficient nvidia.com/gpu, 1 node(s) were unschedulable."
    kubelet = Kubelet(cluster)
    kubelet.unschedulable(NS, objects.pod_name(target.id, 1, 0), message, since="2020-01-01T00:00:00Z")
    reconcile.reconcile()
    worker.run()
    assert status_of(target) == Status.FAILED
    assert message in Job.objects.get(pk=target.id).status_reason


def test_a_learner_whose_pod_vanished_is_lost(cluster, backend, worker):
    target = submitted(learners=2)
    deployed(cluster, target, worker, learners=2)
    cluster.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{objects.pod_name(target.id, 1, 1)}")
    reconcile.reconcile()
    assert dict(Learner.objects.filter(job=target).values_list("index", "state")) == {0: "running", 1: "lost"}


def test_terminate_removes_everything_the_attempt_created(cluster, backend, worker):
    target = submitted(learners=2)
    deployed(cluster, target, worker, learners=2)
    lifecycle.terminate(Job.objects.get(pk=target.id), actor="alice")
    worker.run()  # teardown
    for plural in ("pods", "services", "secrets", "configmaps"):
        assert cluster.names(plural, NS) == [], plural
    assert cluster.names("networkpolicies", NS, group="apis/networking.k8s.io/v1") == ["learners-default-deny"]


def two_jobs_running(cluster, worker):
    """Two tenants' one-learner jobs, deployed and running; [(job, kubelet, agent, namespace, pod)]."""
    jobs = []
    for tenant in ("team-a", "team-b"):
        target = make_job(member(tenant, f"user-{tenant}"), learners=1, gpus=1, cpus=2.0, framework="pytorch",
                          manifest_yaml=MANIFEST.format(learners=1))
        folder = storage.create_job_dir(target.tenant.slug, target.id)
        (folder / "code.tar.gz").write_bytes(tar_gz({"train.py": b"print('hi')\n"}))
        jobs.append(target)
    admission.run_cycle()
    worker.run()
    running = []
    for target in jobs:
        namespace = objects.namespace_name(CONFIG.namespace_prefix, target.tenant.slug)
        kubelet, pod = Kubelet(cluster), objects.pod_name(target.id, 1, 0)
        kubelet.schedule(namespace, pod)
        kubelet.run(namespace, pod)
        agent = Agent(cluster, target, 0)
        agent.send(kind="status", state="running")
        running.append((target, kubelet, agent, namespace, pod))
    return running


def plant_exit_record(target, plant):
    """What the learner leaves as exit.json in its own folder (writable in its pod)."""
    plant(storage.learner_dir(target.tenant.slug, target.id, 1, 0) / "exit.json")


@pytest.mark.parametrize("plant", [
    lambda path: os.mkfifo(path),  # a read waits for a writer for ever
    lambda path: os.symlink("/dev/zero", path),  # a read never ends
    lambda path: path.write_text(json.dumps({"exit_code": 0, "reason": "x" * 100_000})),  # past 64 KiB
], ids=["named-pipe", "link-to-dev-zero", "oversized"])
def test_an_exit_record_that_is_no_small_file_is_passed_over(cluster, backend, worker, plant):
    [(target, kubelet, _, namespace, pod), _] = two_jobs_running(cluster, worker)
    plant_exit_record(target, plant)
    started = time.monotonic()
    assert backend.status(tenant=target.tenant.slug, job_id=target.id, attempt=1, learners=1)[0].state == "running"
    kubelet.terminate(namespace, pod, exit_code=3)
    [ended] = backend.status(tenant=target.tenant.slug, job_id=target.id, attempt=1, learners=1)
    assert time.monotonic() - started < 5
    assert (ended.exit_code, ended.reason) == (3, "learner agent ended without an exit record (Completed)")


@pytest.mark.parametrize("record", [{"exit_code": 2**31}, {"exit_code": "0; drop"}, {"exit_code": [1]},
                                    {"exit_code": True}, [1]])
def test_a_hostile_exit_record_costs_its_own_job_only(cluster, backend, worker, record):
    (hostile, kubelet_h, _, namespace_h, pod_h), (other, kubelet_o, agent_o, namespace_o, pod_o) = \
        two_jobs_running(cluster, worker)
    plant_exit_record(hostile, lambda path: path.write_text(json.dumps(record)))
    kubelet_h.terminate(namespace_h, pod_h, exit_code=0)
    agent_o.write_exit_record(0)  # the other learner ended too; its report was lost
    kubelet_o.terminate(namespace_o, pod_o, exit_code=0)
    reconcile.reconcile()
    worker.run()
    assert status_of(other) == Status.COMPLETED
    assert Learner.objects.get(job=hostile).exit_code == 0  # the pod's own exit code, not the record's


def test_an_exit_reason_is_kept_within_what_ingest_takes(cluster, backend, worker):
    [(target, kubelet, _, namespace, pod), _] = two_jobs_running(cluster, worker)
    record = {"exit_code": 3, "reason": "a\u0000" + "R" * 9000}
    plant_exit_record(target, lambda path: path.write_text(json.dumps(record)))
    kubelet.terminate(namespace, pod, exit_code=0)
    reconcile.reconcile()
    worker.run()
    learner = Learner.objects.get(job=target)
    assert learner.exit_code == 3 and learner.reason == "a" + "R" * 1999


def test_a_failing_job_does_not_stop_the_reconcile_pass_for_the_others(cluster, backend, worker, monkeypatch):
    (broken, *_), (other, kubelet, agent, namespace, pod) = two_jobs_running(cluster, worker)
    agent.write_exit_record(0)
    kubelet.terminate(namespace, pod, exit_code=0)
    status = backend.status

    def failing_for_one(*, job_id, **where):
        if job_id == broken.id:
            raise RuntimeError("an answer about this job that nothing expected")
        return status(job_id=job_id, **where)
    monkeypatch.setattr(backend, "status", failing_for_one)
    reconcile.reconcile()
    worker.run()
    assert status_of(other) == Status.COMPLETED and status_of(broken) == Status.PROCESSING


def test_a_namespace_of_the_tenants_name_the_platform_did_not_make_is_not_taken_over(cluster, backend, worker):
    # The prefix and a tenant's slug spell a namespace someone else runs workloads in.
    cluster.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": NS, "labels": {"team": "payments"}}})
    target = submitted(learners=1)
    admission.run_cycle()
    worker.run()  # the deploy: refused for good
    failed = Job.objects.get(pk=target.id)
    assert failed.status == Status.FAILED and f"namespace {NS} exists but was not made by Trainyard" in \
        failed.status_reason
    assert cluster.names("limitranges", NS) == [] and cluster.names("pods", NS) == []
    assert backend.ensure_namespace("team-b") == "trainyard-team-b"  # one it made is made sure of as before
    assert backend.ensure_namespace("team-b") == "trainyard-team-b"


@pytest.mark.parametrize("when", ["during-the-download", "while-the-pods-are-made"])
def test_a_job_terminated_while_it_deploys_leaves_nothing_behind(cluster, backend, worker, monkeypatch, when):
    target = submitted(learners=2)
    admission.run_cycle()

    def terminate_now():
        lifecycle.terminate(Job.objects.get(pk=target.id), actor="alice")
        worker.run()  # another worker runs the teardown meanwhile: nothing of the attempt exists yet
    if when == "during-the-download":
        monkeypatch.setattr(lifecycle.transfers, "fetch_training_data", lambda job: terminate_now() or True)
    else:
        create = backend._create_or_skip

        def terminated_before_the_first_pod(obj):
            if obj["kind"] == "Pod" and status_of(target) != Status.TERMINATED:
                terminate_now()
            return create(obj)
        monkeypatch.setattr(backend, "_create_or_skip", terminated_before_the_first_pod)
    worker.run()  # the deploy
    assert status_of(target) == Status.TERMINATED
    for plural in ("pods", "services", "secrets", "configmaps"):
        assert cluster.names(plural, NS) == [], plural


# --- the backend on its own ----------------------------------------------------------------------
def test_a_repeated_deploy_is_harmless(cluster, backend, worker):
    target = submitted(learners=2)
    admission.run_cycle()
    worker.run()
    pods = [objects.pod_name(target.id, 1, i) for i in range(2)]
    uids = [cluster.get(f"/api/v1/namespaces/{NS}/pods/{name}")["metadata"]["uid"] for name in pods]
    lifecycle.deploy(target.id, 1)  # a re-driven deploy: every create answers "already exists"
    assert cluster.names("pods", NS) == pods
    assert [cluster.get(f"/api/v1/namespaces/{NS}/pods/{name}")["metadata"]["uid"] for name in pods] == uids
    assert Learner.objects.filter(job=target).count() == 2


def test_the_namespace_quota_follows_the_tenants_quota(cluster):
    backend = new_backend(cluster)
    backend.ensure_namespace("team-b", {"gpus": 4, "cpus": 8, "memory_bytes": 2**34, "jobs": 2})
    path = "/api/v1/namespaces/trainyard-team-b/resourcequotas/tenant-quota"
    assert cluster.get(path)["spec"]["hard"]["requests.nvidia.com/gpu"] == "4"
    backend.ensure_namespace("team-b", {"gpus": 6, "cpus": None, "memory_bytes": None, "jobs": 2})
    hard = cluster.get(path)["spec"]["hard"]
    assert hard.get("requests.nvidia.com/gpu") == "6"
    assert hard.get("requests.cpu") is None  # lifted
    backend.ensure_namespace("team-b", None)
    assert cluster.get(path) is None
    namespace = cluster.get("/api/v1/namespaces/trainyard-team-b")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert_schema_valid(namespace)
    assert_schema_valid(cluster.get("/api/v1/namespaces/trainyard-team-b/limitranges/learner-limits"))


def test_a_tenant_namespace_made_before_is_brought_to_todays_policy_limits_and_pod_security(cluster, monkeypatch):
    """A namespace an earlier release (or a hand edit) left looser: its learners' policy also let them reach
    the web pods (the portal, the API and the admin console), its LimitRange let limits exceed requests,
    and its Pod Security level was baseline. Making sure of it puts back what the platform builds today."""
    backend = new_backend(cluster)
    older = objects.namespace(NS, "team-a", objects.Platform(namespace="trainyard", ingest_port=8000,
                                                             pod_security="baseline"))
    cluster.request("POST", "/api/v1/namespaces", older)
    looser = objects.learners_default_policy(NS, CONFIG.platform)
    looser["spec"]["egress"].append({"to": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "trainyard"}}, "podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "trainyard", "app.kubernetes.io/component": "web"}}}]})
    looser["spec"]["podSelector"]["matchExpressions"] = [{"key": "trainyard.io/job", "operator": "Exists"}]
    cluster.request("POST", f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies", looser)
    limits = objects.limit_range(NS)
    del limits["spec"]["limits"][0]["maxLimitRequestRatio"]
    cluster.request("POST", f"/api/v1/namespaces/{NS}/limitranges", limits)

    backend.ensure_namespace("team-a")
    policy = cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/learners-default-deny")
    assert policy["spec"] == objects.learners_default_policy(NS, CONFIG.platform)["spec"]
    assert cluster.get(f"/api/v1/namespaces/{NS}/limitranges/learner-limits")["spec"] == \
        objects.limit_range(NS)["spec"]
    namespace = cluster.get(f"/api/v1/namespaces/{NS}")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in (policy, namespace):
        assert_schema_valid(obj)
    sent = requests_of(backend, monkeypatch)
    backend.ensure_namespace("team-a")  # as it should be now: read, nothing changed
    assert kinds(sent, "patch") == []


def requests_of(backend, monkeypatch):
    """What `backend` asks the API server from now on, as the API's own descriptions ("create Pod ns/name")."""
    sent, call = [], backend.api._call
    monkeypatch.setattr(backend.api, "_call", lambda what, *args, **kwargs: sent.append(what) or call(what, *args, **kwargs))
    return sent


def kinds(sent, verb):
    return [what.split()[1] for what in sent if what.startswith(f"{verb} ")]


def test_a_deploy_makes_sure_of_the_namespace_only_when_this_process_has_not_lately(cluster, worker, monkeypatch):
    quota = {"gpus": 4, "cpus": 16, "memory_bytes": 64 * 2**30, "jobs": 3}
    chosen = use(monkeypatch, new_backend(cluster, quota=None))
    chosen.quota_for = lambda slug: dict(quota)
    sent = requests_of(chosen, monkeypatch)
    first, second, third = (submitted(learners=1) for _ in range(3))
    admission.run_cycle()

    lifecycle.deploy(first.id, 1)
    assert {"Namespace", "LimitRange", "NetworkPolicy", "ResourceQuota"} <= set(kinds(sent, "create") + kinds(sent, "read"))
    sent.clear()
    lifecycle.deploy(second.id, 1)  # the same tenant, the same quota, a moment later: its own objects only
    assert sent and all(what.startswith("create ") for what in sent)
    assert kinds(sent, "create") == ["ConfigMap", "Secret", "Service", "NetworkPolicy", "Pod"]

    quota["gpus"] = 6  # the tenant's quota changed: mirrored at the next deploy
    sent.clear()
    lifecycle.deploy(third.id, 1)
    assert "ResourceQuota" in kinds(sent, "patch")
    assert cluster.get(f"/api/v1/namespaces/{NS}/resourcequotas/tenant-quota")["spec"]["hard"]["requests.nvidia.com/gpu"] == "6"

    monkeypatch.setattr(k8s_backend, "NAMESPACE_FRESH_S", 0.0)  # a minute on: made sure of again
    sent.clear()
    lifecycle.deploy(third.id, 1)
    assert "Namespace" in kinds(sent, "create")


def test_a_namespace_gone_behind_the_platforms_back_is_made_again_when_the_deploy_is_re_driven(cluster, backend, worker, monkeypatch):
    first, second = submitted(learners=1), submitted(learners=1)
    admission.run_cycle()
    lifecycle.deploy(first.id, 1)
    create = backend.api.create

    def namespace_deleted(obj):  # what an API server answers for a create in a namespace that is gone
        raise NotFound(f"create {obj['kind']}: namespaces \"{NS}\" not found (HTTP 404)", status=404)

    monkeypatch.setattr(backend.api, "create", namespace_deleted)
    with pytest.raises(NotFound):  # transient: the outbox runs the deploy again
        lifecycle.deploy(second.id, 1)
    monkeypatch.setattr(backend.api, "create", create)
    sent = requests_of(backend, monkeypatch)
    lifecycle.deploy(second.id, 1)
    assert kinds(sent, "create")[0] == "Namespace"
    assert sorted(cluster.names("pods", NS)) == sorted(objects.pod_name(j.id, 1, 0) for j in (first, second))


def test_capacity_counts_schedulable_nodes_only(cluster):
    nodes = new_backend(cluster).capacity().nodes
    assert sorted((n.name, n.gpus) for n in nodes) == [("node-1", 2), ("node-2", 2)]


def test_the_scheduler_does_not_count_a_cordoned_node(cluster, backend, worker):
    big = make_job(member(), learners=1, gpus=3, manifest_yaml=MANIFEST.format(learners=1))
    admission.run_cycle()
    assert status_of(big) == Status.QUEUED  # only node-3 (cordoned) has 3 free GPUs


@pytest.mark.parametrize("taint", [
    {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"},
    {"key": "dedicated", "value": "inference", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/disk-pressure", "effect": "NoSchedule"},
])
def test_the_scheduler_does_not_count_a_node_whose_taint_learner_pods_do_not_tolerate(cluster, backend, worker, taint):
    # Pinned there, a learner pod would wait unschedulable until it is counted lost.
    cluster.add_node("node-4", gpus=8, taints=[taint])
    big = make_job(member(), learners=1, gpus=3, manifest_yaml=MANIFEST.format(learners=1))
    admission.run_cycle()
    assert status_of(big) == Status.QUEUED
    assert "node-4" not in {n.name for n in backend.capacity().nodes}


def test_a_node_tainted_only_for_gpus_or_softly_is_counted(cluster, backend):
    cluster.add_node("node-4", gpus=8, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                                              {"key": "spot", "effect": "PreferNoSchedule"}])
    assert "node-4" in {n.name for n in backend.capacity().nodes}


def test_it_works_with_a_server_that_assigns_no_uids(monkeypatch, worker):
    plain = FakeCluster(realistic=False).start()
    try:
        plain.add_node("node-1", gpus=2)
        use(monkeypatch, new_backend(plain))
        target = submitted(learners=1)
        admission.run_cycle()
        worker.run()
        pod = plain.get(f"/api/v1/namespaces/{NS}/pods/{objects.pod_name(target.id, 1, 0)}")
        assert "ownerReferences" not in pod["metadata"]  # nothing to refer to; delete() removes each
        lifecycle.teardown(target.id, 1)
        assert plain.names("pods", NS) == [] and plain.names("configmaps", NS) == []
    finally:
        plain.stop()


# --- the watch -----------------------------------------------------------------------------------
def test_the_pod_cache_follows_changes_through_the_watch(cluster, backend, worker):
    target = submitted(learners=1)
    admission.run_cycle()
    worker.run()
    api = KubeApi(api_client_for(cluster.url), retries=0)
    seen = []
    watcher = PodWatcher(api, watch_timeout_s=2, on_change=lambda kind, pod: seen.append(kind)).start()
    try:
        deadline = time.monotonic() + 5
        while not watcher.fresh() and time.monotonic() < deadline:
            time.sleep(0.05)
        Kubelet(cluster).run(NS, objects.pod_name(target.id, 1, 0))
        labels = objects.learner_selector(target.id, 1)
        while time.monotonic() < deadline and not any(
                (p.get("status") or {}).get("phase") == "Running" for p in watcher.pods(labels)):
            time.sleep(0.05)
        assert [(p.get("status") or {}).get("phase") for p in watcher.pods(labels)] == ["Running"]
        assert "MODIFIED" in seen
    finally:
        watcher.stop()


class ScriptedApi:
    """The project's own API wrapper, scripted: a watch that expires with 410 Gone."""

    def __init__(self):
        self.lists = 0
        self.watches = []

    def list(self, kind, **_):
        self.lists += 1
        return [{"metadata": {"namespace": "ns", "name": f"p{self.lists}", "labels": {}}}], str(100 * self.lists)

    def watch(self, kind, *, resource_version, **_):
        self.watches.append(resource_version)
        if len(self.watches) == 1:
            yield "MODIFIED", {"metadata": {"namespace": "ns", "name": "p1", "resourceVersion": "105"}}
            raise Gone("too old resource version", status=410)
        yield "BOOKMARK", {"metadata": {"resourceVersion": "250"}}


def test_a_watch_that_expires_lists_again_and_resumes_from_the_new_version():
    api = ScriptedApi()
    watcher = PodWatcher(api, resync_s=3600)
    watcher.run_once()  # list (v100), watch from 100, event (v105), then 410
    assert (api.lists, api.watches) == (1, ["100"])
    assert not watcher.fresh()
    watcher.run_once()  # must list again (v200) and watch from there, not from 105
    assert (api.lists, api.watches) == (2, ["100", "200"])
    assert watcher.resource_version == "250"  # bookmarks move it on
    watcher.run_once()  # no relist while fresh
    assert (api.lists, api.watches[-1]) == (2, "250")


def test_the_cache_is_resynced_after_the_resync_period():
    api = ScriptedApi()
    now = [0.0]
    watcher = PodWatcher(api, resync_s=60, clock=lambda: now[0])
    watcher.sync()
    assert watcher.fresh() and not watcher.due_for_resync()
    now[0] = 61.0
    assert not watcher.fresh() and watcher.due_for_resync()


class EndlessWatchApi(ScriptedApi):
    """A server that keeps one watch stream open for as long as the client reads (kmock does: it
    does not honour timeoutSeconds), with an event every `step` seconds of the watcher's clock."""

    def __init__(self, now, step):
        super().__init__()
        self.now, self.step = now, step

    def watch(self, kind, *, resource_version, **_):
        self.watches.append(resource_version)
        version = int(resource_version)
        for _ in range(20):  # "endless" for the test; bounded so a watcher that does not end it fails
            self.now[0] += self.step
            version += 1
            yield "MODIFIED", {"metadata": {"namespace": "ns", "name": "p1", "resourceVersion": str(version)}}


def test_a_followed_watch_keeps_the_cache_fresh_past_the_resync_period_and_the_watcher_ends_it_to_resync():
    now = [0.0]
    api = EndlessWatchApi(now, step=10.0)
    watcher = PodWatcher(api, resync_s=60, clock=lambda: now[0])
    fresh_while_following = []
    watcher.on_change = lambda kind, pod: fresh_while_following.append(watcher.fresh())
    watcher.run_once()  # list at 0, then follow the endless stream until the resync is due
    assert all(fresh_while_following) and len(fresh_while_following) == 6  # 10 s ... 60 s
    assert watcher.fresh()  # still following: run() goes straight on to the next pass
    watcher.run_once()
    assert api.lists == 2 and api.watches == ["100", "200"]


def test_a_stopped_or_failed_watch_no_longer_keeps_the_cache_fresh_past_the_resync_period():
    now = [0.0]
    watcher = PodWatcher(ScriptedApi(), resync_s=60, clock=lambda: now[0])
    watcher.sync()
    watcher._following = True
    now[0] = 61.0
    assert watcher.fresh()
    watcher.stop()
    assert not watcher.fresh()


def pod(name, job, attempt, phase="Pending", namespace=NS):
    return {"metadata": {"namespace": namespace, "name": name, "labels": {
        objects.LABEL_JOB: job, objects.LABEL_ATTEMPT: str(attempt), objects.LABEL_ROLE: "learner"}},
        "status": {"phase": phase}}


def test_the_cache_finds_a_jobs_pods_by_its_label_through_changes_and_deletes():
    watcher = PodWatcher(ScriptedApi())
    watcher.apply("ADDED", pod("a-1-0", "a", 1))
    watcher.apply("ADDED", pod("a-1-1", "a", 1))
    watcher.apply("ADDED", pod("a-2-0", "a", 2))
    watcher.apply("ADDED", pod("b-1-0", "b", 1))
    watcher.apply("ADDED", pod("a-1-0", "a", 1, namespace="other"))
    watcher.apply("MODIFIED", pod("a-1-0", "a", 1, phase="Running"))
    phases = lambda labels: sorted((p["metadata"]["namespace"], p["metadata"]["name"], p["status"]["phase"])
                                   for p in watcher.pods(labels))
    assert phases(objects.learner_selector("a", 1)) == [
        ("other", "a-1-0", "Pending"), (NS, "a-1-0", "Running"), (NS, "a-1-1", "Pending")]
    watcher.apply("DELETED", pod("a-1-1", "a", 1))
    watcher.apply("MODIFIED", pod("b-1-0", "c", 1))  # relabelled: found under its new job only
    assert phases(objects.learner_selector("a", 1)) == [("other", "a-1-0", "Pending"), (NS, "a-1-0", "Running")]
    assert phases(objects.learner_selector("b", 1)) == []
    assert phases(objects.learner_selector("c", 1)) == [(NS, "b-1-0", "Pending")]
    assert len(watcher.pods({objects.LABEL_ROLE: "learner"})) == 4  # no job label: every pod looked at


def test_a_quiet_watch_stream_that_outlasts_its_read_timeout_ends_without_an_error():
    """A server that sends the response's head and then nothing (a quiet cluster, on a server that
    ignores timeoutSeconds): the stream ends as a normal one does, so the cache is not thrown away."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            time.sleep(15)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = KubeApi(api_client_for(f"http://127.0.0.1:{server.server_address[1]}"), retries=0)
        started = time.monotonic()
        assert list(api.watch("Pod", labels=objects.MANAGED_BY, resource_version="7", timeout_s=0)) == []
        assert 9 < time.monotonic() - started < 14  # the read timeout (timeout_s + 10 s), not the server
    finally:
        server.shutdown()


@pytest.fixture
def scripted_api_server():
    """An API server that answers each request with the next (status, body) of a script, the last one
    for good, and counts the requests."""
    import http.server
    import threading

    served = {"script": [], "requests": 0}

    class Scripted(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            script = served["script"]
            status, body = script[min(served["requests"], len(script) - 1)]
            served["requests"] += 1
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    served["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield served
    server.shutdown()


def _status(code, reason):
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
                  "message": f"answered {code}"}


CONFIG_MAP = {"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "c", "namespace": "n"}, "data": {}}


@pytest.mark.parametrize("script, retries, requests, outcome", [
    ([_status(503, "ServiceUnavailable"), _status(503, "ServiceUnavailable"), (200, CONFIG_MAP)], 2, 3, "read"),
    ([_status(503, "ServiceUnavailable")], 2, 3, "raises"),  # every try spent
    ([_status(403, "Forbidden"), (200, CONFIG_MAP)], 2, 1, "raises"),  # permanent: not tried again
    ([_status(404, "NotFound"), (200, CONFIG_MAP)], 2, 1, "none"),  # about the object: not tried again
])
def test_transient_api_errors_are_retried_with_backoff_and_the_rest_are_not(scripted_api_server, script, retries,
                                                                            requests, outcome):
    scripted_api_server["script"] = script
    api = KubeApi(api_client_for(scripted_api_server["url"]), retries=retries, backoff_s=0.01)
    if outcome == "raises":
        with pytest.raises(BackendError, match="answered"):
            api.read("ConfigMap", "n", "c")
    else:
        assert api.read("ConfigMap", "n", "c") == (CONFIG_MAP if outcome == "read" else None)
    assert scripted_api_server["requests"] == requests


# --- wiring --------------------------------------------------------------------------------------
def test_get_backend_builds_it_from_kubeconfig_and_settings(cluster, settings, tmp_path, monkeypatch):
    from jobs.backends import get_backend
    from tenants.models import Tenant
    from tenants.quotas import set_quota

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": cluster.url}}],
        "users": [{"name": "nobody", "user": {"token": "unused"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "nobody"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    settings.BACKEND = "kubernetes"
    settings.K8S_WATCH = False
    settings.K8S_STORAGE_VOLUME = '{"persistentVolumeClaim": {"claimName": "trainyard-storage"}}'
    settings.RESOURCE_SAMPLE_S = 2.5
    set_quota(Tenant.objects.create(slug="team-c"), gpus=2, jobs=1, can_borrow=False)
    get_backend.cache_clear()
    try:
        backend = get_backend()
        assert backend.name == "kubernetes"
        assert backend.config.resource_sample_s == 2.5
        assert sorted(n.name for n in backend.capacity().nodes) == ["node-1", "node-2"]
        backend.ensure_namespace("team-c", backend.quota_for("team-c"))
        hard = cluster.get("/api/v1/namespaces/trainyard-team-c/resourcequotas/tenant-quota")["spec"]["hard"]
        assert hard == {"requests.nvidia.com/gpu": "2"}
    finally:
        get_backend.cache_clear()


def test_get_backend_names_the_setting_that_is_missing(settings):
    from jobs.backends import get_backend

    settings.BACKEND = "kubernetes"
    settings.K8S_STORAGE_VOLUME = ""
    get_backend.cache_clear()
    try:
        with pytest.raises(BackendError, match="TRAINYARD_K8S_STORAGE_VOLUME is not set"):
            get_backend()
    finally:
        get_backend.cache_clear()
