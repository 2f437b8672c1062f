"""The Kubernetes objects the backend creates, as plain manifests (dicts), built by pure functions.

Nothing here talks to the API server, so every object can be checked against the Kubernetes OpenAPI
schemas in tests (kubernetes-validate) and read as YAML by an operator. Names are deterministic
(job id + attempt + learner), so a repeated deploy asks for exactly the same objects.

Per tenant: a namespace with a ResourceQuota mirroring the tenant's quota, a LimitRange, and a
NetworkPolicy that cuts learner pods off from everything except DNS and the ingest endpoint.
Per attempt: a ConfigMap that is the attempt's root object (it also holds the agents' configs);
owned by it, a Secret with only the learners' ingest credentials (one key each), a headless Service for
the learners' stable DNS names, a NetworkPolicy letting the attempt's learners reach each other, and the
pods.
"""
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

MANAGED_BY = {"app.kubernetes.io/managed-by": "trainyard"}
LABEL_TENANT = "trainyard.io/tenant"
LABEL_JOB = "trainyard.io/job"
LABEL_ATTEMPT = "trainyard.io/attempt"
LABEL_LEARNER = "trainyard.io/learner"
LABEL_ROLE = "trainyard.io/role"
HALT_ANNOTATION = "trainyard.io/halt"
GPU_RESOURCE = "nvidia.com/gpu"

AGENT_CONFIG_DIR = "/etc/trainyard/agent"
AGENT_CODE_DIR = "/opt/trainyard"  # the learner_agent package, copied in by the init container
# The learner's credential, copied by an init container from the Secret (mounted only there, at
# CREDENTIAL_SECRET_DIR) into a memory-backed folder that the agent empties once it has read it.
TOKEN_DIR = "/var/run/trainyard/ingest"
TOKEN_KEY = "token"
CREDENTIAL_SECRET_DIR = "/var/run/trainyard/ingest-secret"
PODINFO_DIR = "/etc/trainyard/podinfo"
MASTER_PORT = 29500
TMP_SIZE = "8Gi"  # a learner's /tmp when its job has no disk cap for it
# The agent needs this long after a delete to stop its learner and deliver its last records.
AGENT_SHUTDOWN_S = 30


def _tmp_size(spec):
    """A learner's /tmp: the job's `tmp` disk cap (jobs.disk), which the kubelet enforces by eviction."""
    return str(spec.disk["tmp"]) if spec.disk.get("tmp") else TMP_SIZE


# Learner pods may go to GPU nodes, tainted for them by the usual convention, and to no other tainted node.
LEARNER_TOLERATIONS = ({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},)


def tolerated(taint):
    """Whether learner pods can be scheduled and keep running on a node with `taint` (PreferNoSchedule
    only steers kube-scheduler, which the node pin overrides)."""
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    return any(taint.get("key") == t["key"] and taint.get("effect") == t["effect"] for t in LEARNER_TOLERATIONS)


def locked_down():
    """A container securityContext that the "restricted" Pod Security Standard accepts, and then some."""
    return {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class ObjectError(ValueError):
    """A name or value cannot become a valid Kubernetes object; the message says which and why."""


# --- names ---------------------------------------------------------------------------------------
def dns_label(name):
    """`name` if it is a valid DNS-1035 label (<= 63), else a shortened form with a hash suffix."""
    if len(name) <= 63 and _DNS_LABEL.match(name):
        return name
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not cleaned or not cleaned[0].isalpha():
        cleaned = f"x-{cleaned}"
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{cleaned[:54].rstrip('-')}-{digest}"


def namespace_name(prefix, tenant):
    return dns_label(f"{prefix}{tenant}")


def attempt_name(job_id, attempt):
    """The name of the attempt's root ConfigMap, its Service, and the stem of everything else."""
    return dns_label(f"{job_id}-a{attempt}")


def pod_name(job_id, attempt, index):
    return dns_label(f"{job_id}-a{attempt}-l{index}")


def secret_name(job_id, attempt):
    return dns_label(f"{job_id}-a{attempt}-ingest")


def peers_policy_name(job_id, attempt):
    return dns_label(f"{job_id}-a{attempt}-peers")


def learner_host(job_id, attempt, index, namespace):
    """A learner's stable DNS name behind the attempt's headless Service (learner 0's: MASTER_ADDR)."""
    return f"{pod_name(job_id, attempt, index)}.{attempt_name(job_id, attempt)}.{namespace}.svc"


def attempt_labels(tenant, job_id, attempt):
    return {**MANAGED_BY, LABEL_TENANT: tenant, LABEL_JOB: job_id, LABEL_ATTEMPT: str(attempt)}


def learner_selector(job_id, attempt):
    return {LABEL_JOB: job_id, LABEL_ATTEMPT: str(attempt), LABEL_ROLE: "learner"}


# --- quantities ----------------------------------------------------------------------------------
def cpu_quantity(cpus):
    return f"{round(cpus * 1000)}m"


# --- per tenant ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Platform:
    """Where the platform runs, as far as the learners' network policy needs to know."""
    namespace: str  # the platform's own namespace (where its ingest servers run)
    ingest_port: int
    pod_security: str = "restricted"


def namespace(name, tenant, platform):
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {
                **MANAGED_BY, LABEL_TENANT: tenant,
                # Pod Security Admission rejects any pod in the namespace that is not locked down.
                "pod-security.kubernetes.io/enforce": platform.pod_security,
                "pod-security.kubernetes.io/enforce-version": "latest"}}}


def resource_quota(namespace_, quota):
    """The tenant's quota as a ResourceQuota: `quota` has gpus, cpus, memory_bytes (None = no limit).

    Requests equal limits on every learner, so both are capped alike. Finished pods stop counting at
    once. The number of jobs at once is not mirrored: any object Kubernetes can count per job (its
    Service, its root ConfigMap) outlives the job until teardown, and the scheduler enforces it anyway.
    """
    hard = {}
    if quota.get("gpus") is not None:
        hard[f"requests.{GPU_RESOURCE}"] = str(int(quota["gpus"]))
    if quota.get("cpus") is not None:
        hard["requests.cpu"] = hard["limits.cpu"] = cpu_quantity(float(quota["cpus"]))
    if quota.get("memory_bytes") is not None:
        hard["requests.memory"] = hard["limits.memory"] = str(int(quota["memory_bytes"]))
    return {"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "tenant-quota", "namespace": namespace_, "labels": dict(MANAGED_BY)},
            "spec": {"hard": hard}}


def limit_range(namespace_):
    """Defaults for any container created without resources, and requests = limits for all."""
    return {"apiVersion": "v1", "kind": "LimitRange",
            "metadata": {"name": "learner-limits", "namespace": namespace_, "labels": dict(MANAGED_BY)},
            "spec": {"limits": [{
                "type": "Container",
                "default": {"cpu": "1", "memory": "1Gi"},
                "defaultRequest": {"cpu": "1", "memory": "1Gi"},
                "maxLimitRequestRatio": {"cpu": "1", "memory": "1"}}]}}


# The platform pods learners may reach: the ingest servers (deploy/kubernetes/base/53-ingest.yaml),
# whose application serves agents' posts alone. The web servers, which serve everything else, they may not.
INGEST_SERVERS = {"app.kubernetes.io/name": "trainyard", "app.kubernetes.io/component": "ingest"}


def learners_default_policy(namespace_, platform):
    """Learner pods get no traffic in and none out, except DNS and the platform's ingest endpoint.

    NetworkPolicies add up: each attempt's own policy (attempt_peers_policy) opens the learners of that
    attempt to each other, and nothing opens them to anyone else.
    """
    dns_ports = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "learners-default-deny", "namespace": namespace_, "labels": dict(MANAGED_BY)},
            "spec": {
                "podSelector": {"matchLabels": {LABEL_ROLE: "learner"}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [],
                "egress": [
                    {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                             "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                     "ports": dns_ports},
                    {"to": [{"namespaceSelector": {"matchLabels": {
                                "kubernetes.io/metadata.name": platform.namespace}},
                             "podSelector": {"matchLabels": dict(INGEST_SERVERS)}}],
                     "ports": [{"protocol": "TCP", "port": platform.ingest_port}]},
                ]}}


# --- per attempt ---------------------------------------------------------------------------------
def owner_references(root):
    """References to the attempt's root object, or none when the server gave it no uid (a fake)."""
    uid = (root.get("metadata") or {}).get("uid")
    if not uid:
        return []
    return [{"apiVersion": "v1", "kind": "ConfigMap", "name": root["metadata"]["name"], "uid": uid,
             "controller": True, "blockOwnerDeletion": True}]


def _meta(name, namespace_, labels, owners):
    meta = {"name": name, "namespace": namespace_, "labels": labels}
    if owners:
        meta["ownerReferences"] = owners
    return meta


def _attempt_meta(spec, name, namespace_, owners):
    return _meta(name, namespace_, attempt_labels(spec.tenant, spec.job_id, spec.attempt), owners)


def attempt_root(spec, namespace_, agent_configs):
    """The root object of an attempt: deleting it garbage-collects everything the attempt owns.

    It carries the learner agents' configs (no secrets: the token is in the Secret).
    """
    data = {f"learner-{index}.json": json.dumps(config, indent=1, sort_keys=True)
            for index, config in agent_configs.items()}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _attempt_meta(spec, attempt_name(spec.job_id, spec.attempt), namespace_, []), "data": data}


def credential_key(index):
    return f"learner-{index}"


def ingest_secret(spec, namespace_, owners):
    """Only this attempt's learners' own ingest credentials, one key each (each pod mounts its own);
    no platform secret ever goes here."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _attempt_meta(spec, secret_name(spec.job_id, spec.attempt), namespace_, owners),
            "stringData": {credential_key(learner.index): learner.ingest_token for learner in spec.learners}}


def headless_service(spec, namespace_, owners):
    """Gives every learner the DNS name <pod>.<attempt>.<namespace>.svc (MASTER_ADDR for learner 0)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _attempt_meta(spec, attempt_name(spec.job_id, spec.attempt), namespace_, owners),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": learner_selector(spec.job_id, spec.attempt),
                     "ports": [{"name": "master", "port": MASTER_PORT, "protocol": "TCP"}]}}


def attempt_peers_policy(spec, namespace_, owners):
    """The learners of one attempt may talk to each other (any port: NCCL, gloo, MPI), nobody else."""
    peers = [{"podSelector": {"matchLabels": learner_selector(spec.job_id, spec.attempt)}}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _attempt_meta(spec, peers_policy_name(spec.job_id, spec.attempt), namespace_, owners),
            "spec": {"podSelector": {"matchLabels": learner_selector(spec.job_id, spec.attempt)},
                     "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": peers}], "egress": [{"to": peers}]}}


@dataclass(frozen=True)
class PodSettings:
    image: str  # the framework's image: anything with Python 3.10+ as `python` on PATH
    agent_image: str  # holds the learner agent at /opt/trainyard/learner_agent (deploy/images/agent)
    storage_root: str  # the platform's storage root path; mounted at the same path in the pod
    storage_volume: dict  # a Kubernetes volume source (e.g. {"persistentVolumeClaim": {...}})
    run_as_user: int = 1000


def node_pin(node):
    """Keep a learner on the node the scheduler chose for it: Trainyard's gang placement and packing
    decide where learners go, so kube-scheduler must not spread them elsewhere."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


def learner_pod(spec, learner, namespace_, owners, pods):
    """One learner: the learner agent is the container's entrypoint and runs the user's command.

    The framework image need not contain the agent: an init container copies it (stdlib only) from
    the agent image into a shared emptyDir, so any image with Python runs as a learner.
    """
    name = pod_name(spec.job_id, spec.attempt, learner.index)
    labels = {**attempt_labels(spec.tenant, spec.job_id, spec.attempt),
              LABEL_ROLE: "learner", LABEL_LEARNER: str(learner.index)}
    resources = {"cpu": cpu_quantity(spec.cpus), "memory": str(spec.memory_bytes)}
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TMPDIR", "value": "/tmp"},
           {"name": "PYTHONPATH", "value": AGENT_CODE_DIR}]
    if spec.gpus:
        resources[GPU_RESOURCE] = str(spec.gpus)  # the device plugin then names the container's own GPUs
    else:
        # Without it, an image that sets NVIDIA_VISIBLE_DEVICES=all (NVIDIA's own do) is given every GPU
        # of the node by the NVIDIA container runtime, those of other tenants' learners included.
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
    container = {
        "name": "learner",
        "image": pods.image,
        # The image may be any the researcher names: IfNotPresent would run one another tenant's job
        # left on the node without the registry asking whether this one may have it.
        "imagePullPolicy": "Always",
        "command": ["python", "-m", "learner_agent", "run", "--config", f"{AGENT_CONFIG_DIR}/agent.json"],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "env": env,
        "ports": [{"name": "master", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "securityContext": locked_down(),
        "volumeMounts": _storage_mounts(spec, learner, pods) + [
            {"name": "agent", "mountPath": AGENT_CODE_DIR, "readOnly": True},
            {"name": "agent-config", "mountPath": AGENT_CONFIG_DIR, "readOnly": True},
            {"name": "ingest-token", "mountPath": TOKEN_DIR},  # writable: the agent deletes what it read
            {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    copy_agent = _copying_container("agent", pods, ["cp", "-R", f"{AGENT_CODE_DIR}/learner_agent", "/agent/"],
                                    [{"name": "agent", "mountPath": "/agent"}])
    # The agent and the user's command share this container and its uid, so the credential must be gone
    # before the command starts: the Secret is mounted only in this init container, which copies this
    # learner's key into a memory-backed folder; the agent reads it from there and deletes it.
    copy_credential = _copying_container(
        "credential", pods, ["cp", f"{CREDENTIAL_SECRET_DIR}/{TOKEN_KEY}", f"{TOKEN_DIR}/{TOKEN_KEY}"],
        [{"name": "ingest-secret", "mountPath": CREDENTIAL_SECRET_DIR, "readOnly": True},
         {"name": "ingest-token", "mountPath": TOKEN_DIR}])
    pin = {"affinity": node_pin(learner.node)} if learner.node else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": _meta(name, namespace_, labels, owners),
            "spec": {
                **pin,
                "hostname": name,
                "subdomain": attempt_name(spec.job_id, spec.attempt),
                "restartPolicy": "Never",  # a crash is the lifecycle manager's call (retries, checkpoint)
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,  # no environment variables about other services
                "terminationGracePeriodSeconds": int(spec.grace_seconds) + AGENT_SHUTDOWN_S,
                "securityContext": {"runAsNonRoot": True, "runAsUser": pods.run_as_user,
                                    "runAsGroup": pods.run_as_user, "fsGroup": pods.run_as_user,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "tolerations": [dict(t) for t in LEARNER_TOLERATIONS],
                "initContainers": [copy_agent, copy_credential],
                "containers": [container],
                "volumes": [
                    {"name": "agent", "emptyDir": {"sizeLimit": "64Mi"}},
                    {"name": "storage", **pods.storage_volume},
                    {"name": "agent-config", "configMap": {
                        "name": attempt_name(spec.job_id, spec.attempt),
                        "items": [{"key": f"learner-{learner.index}.json", "path": "agent.json"}]}},
                    {"name": "ingest-secret", "secret": {
                        "secretName": secret_name(spec.job_id, spec.attempt), "defaultMode": 0o440,
                        "items": [{"key": credential_key(learner.index), "path": TOKEN_KEY}]}},
                    {"name": "ingest-token", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                    {"name": "podinfo", "downwardAPI": {"items": [
                        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": _tmp_size(spec)}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.memory_bytes // 2)}},
                ]}}


def _copying_container(name, pods, command, mounts):
    """An init container of the agent image that copies something into the pod."""
    small = {"cpu": "100m", "memory": "64Mi"}
    return {"name": name, "image": pods.agent_image, "imagePullPolicy": "IfNotPresent", "command": command,
            "resources": {"requests": dict(small), "limits": dict(small)}, "securityContext": locked_down(),
            "volumeMounts": mounts}


def _storage_mounts(spec, learner, pods):
    """The job's folder read-only, with the few folders this learner writes mounted writable on top.

    Paths inside the pod are the platform's own paths, so everything in DeploySpec stays valid, and a
    learner sees its own job's folder only: never another job's, never the platform's database.
    """
    root = PurePosixPath(pods.storage_root)
    job = PurePosixPath(spec.job_dir)
    checkpoint_dir = PurePosixPath(spec.env["CHECKPOINT_DIR"])
    writable = [job / "results", checkpoint_dir,
                job / f"attempt-{spec.attempt}" / f"learner-{learner.index}"]
    mounts = [{"name": "storage", "mountPath": str(job), "subPath": _relative(job, root), "readOnly": True}]
    mounts += [{"name": "storage", "mountPath": str(path), "subPath": _relative(path, root)} for path in writable]
    return mounts


def _relative(path, root):
    try:
        return str(path.relative_to(root))
    except ValueError:
        raise ObjectError(f"{path} is not inside the storage root {root}") from None
