"""The Kubernetes backend's pure parts: every object it builds validates against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict), pod statuses map to learner states with clear reasons,
node inventory, API error classification, settings checks, and the deploy/ manifests."""
import dataclasses
from datetime import datetime, timedelta, timezone
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from jobs.backends.base import BackendError, DeploySpec, LearnerSpec, LearnerState
from jobs.backends.k8s import objects
from jobs.backends.k8s.api import AlreadyExists, Gone, NotFound, QuotaExceeded, _classify, parse_quantity
from jobs.backends.k8s.backend import node_capacity, parse_ingest_url, parse_storage_volume
from jobs.backends.k8s.podstatus import learner_status

K8S_VERSION = "1.34.0"
ROOT = Path(__file__).resolve().parents[2]
STORAGE = "/var/lib/trainyard/storage"
PLATFORM = objects.Platform(namespace="trainyard", ingest_port=8000)
PODS = objects.PodSettings(image="pytorch/pytorch:2.5", agent_image="ghcr.io/trainyard/learner-agent:1.0",
                           storage_root=STORAGE,
                           storage_volume={"persistentVolumeClaim": {"claimName": "trainyard-storage"}})
ROOT_OBJECT = {"metadata": {"name": "training-abc12345-a1", "uid": "0b1c2d3e-0000-4000-8000-000000000001"}}


def assert_valid(obj):
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def spec(learners=2, gpus=1, job_id="training-abc12345", attempt=1):
    job_dir = f"{STORAGE}/team-a/{job_id}"
    env = {"TRAINYARD_JOB_ID": job_id, "CHECKPOINT_DIR": f"{job_dir}/checkpoints/attempt-{attempt}"}
    return DeploySpec(
        job_id=job_id, attempt=attempt, tenant="team-a", command="python train.py",
        code_archive=f"{job_dir}/code.tar.gz", job_dir=job_dir,
        learners=tuple(LearnerSpec(i, {"LEARNER_ID": str(i)}, ingest_token=f"credential-{i}") for i in range(learners)),
        cpus=2.5, memory_bytes=4 * 2**30, gpus=gpus, env=env, metric_regexes={}, checkpoint_signal="SIGTERM",
        grace_seconds=60, ingest_url=f"http://web/api/v1/ingest/{job_id}/")


def every_object(job=None):
    job = job or spec()
    owners = objects.owner_references(ROOT_OBJECT)
    yield objects.namespace("trainyard-team-a", "team-a", PLATFORM)
    yield objects.resource_quota("trainyard-team-a", {"gpus": 8, "cpus": 32, "memory_bytes": 128 * 2**30, "jobs": 4})
    yield objects.limit_range("trainyard-team-a")
    yield objects.learners_default_policy("trainyard-team-a", PLATFORM)
    yield objects.attempt_root(job, "trainyard-team-a", {0: {"job_id": job.job_id}, 1: {"job_id": job.job_id}})
    yield objects.ingest_secret(job, "trainyard-team-a", owners)
    yield objects.headless_service(job, "trainyard-team-a", owners)
    yield objects.attempt_peers_policy(job, "trainyard-team-a", owners)
    for learner in job.learners:
        yield objects.learner_pod(job, learner, "trainyard-team-a", owners, PODS)


@pytest.mark.parametrize("gpus", [0, 2])
def test_it_builds_only_objects_the_kubernetes_schemas_accept(gpus):
    built = list(every_object(spec(gpus=gpus)))
    assert {o["kind"] for o in built} == {"Namespace", "ResourceQuota", "LimitRange", "NetworkPolicy", "ConfigMap",
                                          "Secret", "Service", "Pod"}
    for obj in built:
        assert_valid(obj)


def test_a_learner_is_pinned_to_the_node_the_scheduler_chose():
    job = spec()
    placed = LearnerSpec(0, {"LEARNER_ID": "0"}, gpu_ids=(2, 3), node="gpu-node-7")
    pod = objects.learner_pod(job, placed, "ns", [], PODS)
    assert_valid(pod)
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-node-7"]
    assert "affinity" not in objects.learner_pod(job, job.learners[0], "ns", [], PODS)["spec"]


def test_the_schema_check_catches_a_broken_object():
    pod = objects.learner_pod(spec(), spec().learners[0], "ns", [], PODS)
    pod["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_it_locks_down_learner_pods():
    pod = objects.learner_pod(spec(), spec().learners[1], "ns", objects.owner_references(ROOT_OBJECT), PODS)
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                            "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert container["resources"]["requests"] == container["resources"]["limits"] == {
        "cpu": "2500m", "memory": str(4 * 2**30), "nvidia.com/gpu": "1"}
    assert pod["metadata"]["ownerReferences"][0]["uid"] == ROOT_OBJECT["metadata"]["uid"]
    assert pod["metadata"]["labels"]["trainyard.io/tenant"] == "team-a"
    assert pod["metadata"]["labels"]["trainyard.io/attempt"] == "1"
    # No platform setting reaches the pod: the learner's variables come from the agent's config.
    assert [e["name"] for e in container["env"]] == ["PYTHONUNBUFFERED", "TMPDIR", "PYTHONPATH"]
    assert pod["spec"]["initContainers"][0]["securityContext"] == container["securityContext"]
    assert pod["spec"]["enableServiceLinks"] is False



def test_a_learner_that_asks_for_no_gpus_is_given_none_of_its_nodes():
    # NVIDIA's images (pytorch/pytorch, nvidia/cuda) set NVIDIA_VISIBLE_DEVICES=all, and the NVIDIA
    # container runtime then hands a container that requested no GPU every GPU of its node: the GPUs
    # the device plugin gave other tenants' learners there. The device plugin sets the variable only
    # for a container that requests GPUs; one that requests none must say "void" itself.
    cpu_only = spec(gpus=0)
    pod = objects.learner_pod(cpu_only, cpu_only.learners[0], "ns", [], PODS)
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert_valid(pod)
    with_gpus = objects.learner_pod(spec(gpus=2), spec(gpus=2).learners[0], "ns", [], PODS)
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in with_gpus["spec"]["containers"][0]["env"]}


def test_a_learners_image_is_pulled_each_time_and_its_tmp_is_its_jobs_cap():
    # A researcher's image named again by another tenant must not run from what the node kept of it.
    owners = objects.owner_references(ROOT_OBJECT)
    pod = objects.learner_pod(spec(), spec().learners[0], "ns", owners, PODS)["spec"]
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    tmp = {v["name"]: v for v in pod["volumes"]}["tmp"]["emptyDir"]
    assert tmp["sizeLimit"] == objects.TMP_SIZE  # no cap asked
    capped = dataclasses.replace(spec(), disk={"tmp": 2**30})
    pod = objects.learner_pod(capped, capped.learners[0], "ns", owners, PODS)["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["tmp"]["emptyDir"]["sizeLimit"] == str(2**30)
    assert_valid(objects.learner_pod(capped, capped.learners[0], "ns", owners, PODS))


def test_a_learner_pod_mounts_nothing_of_its_node():
    """What a learner pod sees besides its image: the job's folder of the shared storage, the agent's
    code, config and credential, its downward-API annotations, /tmp and /dev/shm. No host path, no
    host namespace, no service account token."""
    pod = objects.learner_pod(spec(), spec().learners[0], "ns", [], PODS)["spec"]
    assert {v["name"]: next(k for k in v if k != "name") for v in pod["volumes"]} == {
        "agent": "emptyDir", "storage": "persistentVolumeClaim", "agent-config": "configMap",
        "ingest-secret": "secret", "ingest-token": "emptyDir", "podinfo": "downwardAPI", "tmp": "emptyDir",
        "shm": "emptyDir"}
    assert not {"hostNetwork", "hostPID", "hostIPC", "hostUsers", "serviceAccountName"} & set(pod)
    assert pod["automountServiceAccountToken"] is False


def test_a_learner_writes_only_its_own_folders_of_its_own_job():
    pod = objects.learner_pod(spec(), spec().learners[1], "ns", [], PODS)
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "storage"}
    job = f"{STORAGE}/team-a/training-abc12345"
    assert mounts[job] == {"name": "storage", "mountPath": job, "subPath": "team-a/training-abc12345",
                           "readOnly": True}
    writable = sorted(p for p, m in mounts.items() if not m.get("readOnly"))
    assert writable == [f"{job}/attempt-1/learner-1", f"{job}/checkpoints/attempt-1", f"{job}/results"]


def test_the_secret_holds_only_the_learners_credentials():
    secret = objects.ingest_secret(spec(), "ns", [])
    assert secret["stringData"] == {"learner-0": "credential-0", "learner-1": "credential-1"}
    assert "credential-" not in str(objects.attempt_root(spec(), "ns", {0: {"a": 1}}))


def test_each_pod_gets_only_its_own_credential_and_only_its_init_container_the_secret():
    pod = objects.learner_pod(spec(), spec().learners[1], "ns", [], PODS)["spec"]
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    assert secret_volume["secret"]["items"] == [{"key": "learner-1", "path": "token"}]
    mounting = [c["name"] for c in pod["initContainers"] + pod["containers"]
                if any(m["name"] == secret_volume["name"] for m in c["volumeMounts"])]
    assert mounting == ["credential"]
    # The learner container gets the copy in a memory-backed folder the agent can delete it from.
    token_volume = next(v for v in pod["volumes"] if v["name"] == "ingest-token")
    assert token_volume["emptyDir"]["medium"] == "Memory"
    learner_mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "ingest-token")
    assert learner_mount["mountPath"] == objects.TOKEN_DIR and not learner_mount.get("readOnly")


def test_only_the_attempts_own_learners_are_peers():
    policy = objects.attempt_peers_policy(spec(), "ns", [])
    selector = {"trainyard.io/job": "training-abc12345", "trainyard.io/attempt": "1", "trainyard.io/role": "learner"}
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    assert policy["spec"]["egress"] == [{"to": [{"podSelector": {"matchLabels": selector}}]}]
    default = objects.learners_default_policy("ns", PLATFORM)
    assert default["spec"]["policyTypes"] == ["Ingress", "Egress"] and default["spec"]["ingress"] == []
    assert [rule["ports"][-1]["port"] for rule in default["spec"]["egress"]] == [53, 8000]


def test_names_are_deterministic_valid_dns_labels():
    long_id = "training-" + "x" * 70
    for name in (objects.pod_name(long_id, 12, 3), objects.attempt_name(long_id, 1),
                 objects.namespace_name("trainyard-", "Team_A")):
        assert len(name) <= 63 and objects._DNS_LABEL.match(name), name
    assert objects.pod_name(long_id, 12, 3) == objects.pod_name(long_id, 12, 3)
    assert objects.pod_name(long_id, 12, 3) != objects.pod_name(long_id, 12, 4)
    host = objects.learner_host("training-abc12345", 2, 0, "ns")
    assert host == "training-abc12345-a2-l0.training-abc12345-a2.ns.svc"


def test_the_quota_mirrors_only_the_limits_that_are_set():
    quota = objects.resource_quota("ns", {"gpus": 2, "cpus": None, "memory_bytes": None, "jobs": 3})
    assert quota["spec"]["hard"] == {"requests.nvidia.com/gpu": "2"}
    assert objects.resource_quota("ns", {})["spec"]["hard"] == {}


# --- pod status ----------------------------------------------------------------------------------
def pod(phase="Pending", *, state=None, conditions=None, reason=None, memory="4Gi", deleting=False):
    status = {"phase": phase}
    if state is not None:
        status["containerStatuses"] = [{"name": "learner", "image": "img:1", "state": state}]
    if conditions:
        status["conditions"] = conditions
    if reason:
        status["reason"], status["message"] = reason, f"{reason} happened"
    meta = {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {"name": "p"}
    return {"metadata": meta, "spec": {"nodeName": "gpu-7", "containers": [
        {"name": "learner", "resources": {"limits": {"memory": memory}}}]}, "status": status}


NOW = datetime(2026, 11, 21, 12, 0, tzinfo=timezone.utc)
STALE = (NOW - timedelta(seconds=600)).strftime("%Y-%m-%dT%H:%M:%SZ")
FRESH = (NOW - timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
UNSCHEDULABLE = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


@pytest.mark.parametrize("the_pod, exit_record, expected", [
    (None, None, (LearnerState.MISSING, None, "its pod is gone")),
    (pod(), None, (LearnerState.PENDING, None, "")),
    (pod("Running", state={"running": {}}), None, (LearnerState.RUNNING, None, "")),
    (pod("Failed", state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}), None,
     (LearnerState.EXITED, 137, "OOMKilled: memory limit 4.0GiB exceeded")),
    (pod("Succeeded", state={"terminated": {"exitCode": 0, "reason": "Completed"}}),
     {"exit_code": 3, "reason": "boom"}, (LearnerState.EXITED, 3, "boom")),
    (pod("Succeeded", state={"terminated": {"exitCode": 0, "reason": "Completed"}}), None,
     (LearnerState.EXITED, 0, "learner agent ended without an exit record")),
    (pod(state={"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}), None,
     (LearnerState.EXITED, None, "image pull failed: img:1: pull access denied")),
    (dict(pod(), status={"phase": "Pending", "initContainerStatuses": [
        {"name": "agent", "image": "agent:1",
         "state": {"waiting": {"reason": "InvalidImageName", "message": "bad"}}}]}),
     None, (LearnerState.EXITED, None, "image pull failed: agent:1: bad")),
    (pod(state={"waiting": {"reason": "ErrImagePull", "message": "timeout"}}), None,
     (LearnerState.PENDING, None, "ErrImagePull")),
    (pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": UNSCHEDULABLE, "lastTransitionTime": FRESH}]), None,
     (LearnerState.PENDING, None, f"unschedulable: {UNSCHEDULABLE}")),
    (pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": UNSCHEDULABLE, "lastTransitionTime": STALE}]), None,
     (LearnerState.MISSING, None, f"unschedulable for 600s: {UNSCHEDULABLE}")),
    (pod("Unknown"), None, (LearnerState.MISSING, None, "node gpu-7 stopped reporting")),
    (pod("Failed", reason="Evicted"), None, (LearnerState.MISSING, None, "Evicted: Evicted happened")),
    (pod("Pending", deleting=True), None, (LearnerState.MISSING, None, "its pod is being deleted")),
], ids=["no-pod", "pending", "running", "oomkilled", "exit-record", "no-exit-record", "image-pull",
        "agent-image-pull", "first-pull-error", "unschedulable-fresh", "unschedulable-stale", "node-lost", "evicted",
        "deleting"])
def test_it_maps_pod_states_to_learner_states(the_pod, exit_record, expected):
    status = learner_status(0, the_pod, exit_record=exit_record, now=NOW, unschedulable_timeout_s=300)
    state, exit_code, reason = expected
    assert (status.state, status.exit_code) == (state, exit_code)
    assert status.reason.startswith(reason), status.reason


# --- nodes, errors, settings ---------------------------------------------------------------------
def node(name, *, cordoned=False, ready="True", gpus="4"):
    return {"metadata": {"name": name}, "spec": {"unschedulable": cordoned},
            "status": {"allocatable": {"cpu": "31800m", "memory": "125Gi", "nvidia.com/gpu": gpus},
                       "conditions": [{"type": "Ready", "status": ready}]}}


def test_it_reports_allocatable_resources_of_schedulable_nodes_only():
    assert node_capacity(node("a")).gpus == 4
    assert node_capacity(node("a")).cpus == pytest.approx(31.8)
    assert node_capacity(node("a")).memory_bytes == 125 * 2**30
    assert node_capacity(node("b", cordoned=True)) is None
    assert node_capacity(node("c", ready="False")) is None
    assert node_capacity(node("d", gpus="lots")) is None


# What real API servers send: the HTTP status, the Status object's reason and its message.
@pytest.mark.parametrize("status, reason, message, kind, permanent", [
    (404, "NotFound", "pods \"x\" not found", NotFound, True),
    (409, "AlreadyExists", "pods \"x\" already exists", AlreadyExists, True),
    (410, "Expired", "too old resource version", Gone, True),
    (409, "Conflict", "the object has been modified", BackendError, False),
    (403, "Forbidden", "pods \"x\" is forbidden: exceeded quota: tenant-quota, requested: nvidia.com/gpu=2",
     QuotaExceeded, False),
    (403, "Forbidden", "pods is forbidden: User cannot create", BackendError, True),
    (422, "Invalid", "Pod is invalid", BackendError, True),
    (500, "InternalError", "etcd timeout", BackendError, False),
    (503, "ServiceUnavailable", "unavailable", BackendError, False),
    (429, "TooManyRequests", "too many requests", BackendError, False),
])
def test_it_turns_api_errors_into_transient_or_permanent_errors(status, reason, message, kind, permanent):
    error = _classify(status, reason, message)
    assert isinstance(error, kind) and isinstance(error, BackendError)
    if kind in (BackendError, QuotaExceeded):
        assert error.permanent is permanent


def test_a_conflict_is_not_already_exists_whatever_its_message_says():
    error = _classify(409, "Conflict", "Operation cannot be fulfilled: the object already exists in a newer version")
    assert not isinstance(error, AlreadyExists) and not error.permanent


def test_it_reads_kubernetes_quantities_with_the_clients_parser():
    assert parse_quantity("3800m") == pytest.approx(3.8)
    assert parse_quantity("16Gi") == 16 * 2**30 and parse_quantity("1e3") == 1000 and parse_quantity(2) == 2
    with pytest.raises(BackendError, match="'lots' is not a Kubernetes quantity"):
        parse_quantity("lots")


@pytest.mark.parametrize("value, complaint", [
    ("", "is not set"), ("{nope", "not valid JSON"), ('{"emptyDir": {}}', "one volume source"),
    ('{"nfs": {}, "csi": {}}', "one volume source"), ('["nfs"]', "one volume source"),
    ('{"hostPath": {"path": "/srv/trainyard"}}', "one volume source"),  # the node's own folder: never
])
def test_it_rejects_a_bad_storage_volume_setting_with_a_clear_error(value, complaint):
    with pytest.raises(BackendError, match="TRAINYARD_K8S_STORAGE_VOLUME") as caught:
        parse_storage_volume(value)
    assert complaint in str(caught.value) and caught.value.permanent


def test_it_checks_the_ingest_url_setting():
    assert parse_ingest_url("http://trainyard-web.trainyard.svc:8000/") == "http://trainyard-web.trainyard.svc:8000"
    with pytest.raises(BackendError, match="TRAINYARD_K8S_INGEST_URL"):
        parse_ingest_url("trainyard-web:8000")


# --- deploy/ -------------------------------------------------------------------------------------
def deploy_documents():
    """Every whole object under deploy/kubernetes/ (base and overlays), without kubectl: the
    kustomizations and the partial objects their patches are made of are left out (tests/deploy
    validates the overlays as kustomize renders them)."""
    root = ROOT / "deploy" / "kubernetes"
    kustomizations = list(root.rglob("kustomization.yaml"))
    patches = {(k.parent / p["path"]).resolve() for k in kustomizations
               for p in yaml.safe_load(k.read_text()).get("patches", []) if "path" in p}
    files = sorted(p for p in root.rglob("*.yaml") if p.name != "kustomization.yaml" and p.resolve() not in patches)
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def test_the_deploy_manifests_validate():
    docs = list(deploy_documents())
    kinds = {doc["kind"] for _, doc in docs}
    assert {"Deployment", "StatefulSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service",
            "PersistentVolumeClaim", "NetworkPolicy", "Namespace"} <= kinds
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def test_the_platform_may_do_only_what_the_lifecycle_manager_needs():
    roles = [doc for _, doc in deploy_documents() if doc["kind"] == "ClusterRole"]
    granted = {(resource, verb) for role in roles for rule in role["rules"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert not any("*" in item for item in granted)
    assert ("pods/exec", "create") not in granted and not any(r == "secrets" and v in ("get", "list", "watch")
                                                              for r, v in granted)
    assert ("pods", "create") in granted and ("pods", "watch") in granted and ("nodes", "list") in granted
    # A tenant namespace made earlier is brought to today's Pod Security level, LimitRange and policy.
    assert {("namespaces", "patch"), ("limitranges", "get"), ("limitranges", "patch"), ("networkpolicies", "get"),
            ("networkpolicies", "patch")} <= granted
