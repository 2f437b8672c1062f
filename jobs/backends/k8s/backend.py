"""The `kubernetes` backend: each learner is a pod in its tenant's namespace.

deploy() makes sure the tenant's namespace exists (with its quota, limits and network policy; at most
once a minute per process and tenant, NAMESPACE_FRESH_S), then creates the attempt's objects
root-first: the root ConfigMap, then what it owns (ingest Secret, headless Service, peers
NetworkPolicy, pods). Every name is deterministic, so a repeated deploy finds
its objects there already and moves on. halt() annotates the pods; the agent in each one sees the
annotation through a downward-API file and checkpoints. delete() removes the root and, explicitly,
everything it owns (the cluster's garbage collector would too, but explicit deletes also work where
ownerReferences could not be set).

The learners' files live on shared storage mounted at the platform's own storage path, so the agent's
exit record (exit.json) is read exactly as the local backend reads it.
"""
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from gpu_scheduler import SchedulingInputError
from jobs import storage
from jobs.backends.base import BackendError, Capacity, DeploySpec, Node, agent_config_base, read_exit_record
from jobs.backends.k8s import objects
from jobs.backends.k8s.api import AlreadyExists, KubeApi, KubeError, NotFound, parse_quantity
from jobs.backends.k8s.objects import ObjectError
from jobs.backends.k8s.podstatus import learner_status
from trainyard import frameworks

log = logging.getLogger(__name__)

# The framework images under deploy/images/; keras runs in the tensorflow image.
FRAMEWORK_IMAGES = {"pytorch": "pytorch", "tensorflow": "tensorflow", "keras": "tensorflow", "jax": "jax",
                    "sklearn": "sklearn", "custom": "custom"}
# Shared storage only: never hostPath, which would put a folder of the node's own in a learner's pod
# (and which the namespaces' restricted Pod Security level refuses anyway).
VOLUME_SOURCES = {"persistentVolumeClaim", "nfs", "csi", "ephemeral", "cephfs", "glusterfs", "azureFile", "iscsi"}
# How long a namespace this process made sure of (with the tenant's quota then) is taken to be as it
# left it, sparing a deploy four requests (namespace, LimitRange, NetworkPolicy, quota). A changed
# quota is mirrored at the next deploy; a namespace deleted behind the platform's back shows as a 404
# on a create, which forgets it; a hand-edited LimitRange or policy is put back within this time.
NAMESPACE_FRESH_S = 60.0


class ConfigError(BackendError):
    def __init__(self, message):
        super().__init__(message, permanent=True)


@dataclass(frozen=True)
class K8sConfig:
    """The backend's settings, checked once (settings.py reads them; their meaning is here)."""
    namespace_prefix: str
    image_prefix: str
    image_tag: str
    storage_volume: dict
    agent_image: str
    platform: objects.Platform
    ingest_url: str = ""  # replaces scheme://host:port of the ingest URL given to agents
    run_as_user: int = 1000
    unschedulable_timeout_s: float = 300.0
    log_pace: tuple = (0, 1)  # (bytes a second, burst bytes) of a learner's output (learner_agent.pace)
    # How often each agent samples its learner (learner_agent.telemetry): CPU and memory of the
    # learner's processes, and NVML for the GPUs its container sees (the device plugin shows it only
    # its own). 0: never.
    resource_sample_s: float = 0.0

    @classmethod
    def from_settings(cls, settings):
        return cls(namespace_prefix=settings.K8S_NAMESPACE_PREFIX, image_prefix=settings.K8S_IMAGE_PREFIX,
                   image_tag=settings.K8S_IMAGE_TAG, agent_image=settings.K8S_AGENT_IMAGE,
                   storage_volume=parse_storage_volume(settings.K8S_STORAGE_VOLUME),
                   platform=objects.Platform(namespace=settings.K8S_PLATFORM_NAMESPACE,
                                             ingest_port=settings.K8S_INGEST_PORT,
                                             pod_security=settings.K8S_POD_SECURITY),
                   ingest_url=parse_ingest_url(settings.K8S_INGEST_URL), run_as_user=settings.K8S_RUN_AS_USER,
                   unschedulable_timeout_s=settings.K8S_UNSCHEDULABLE_TIMEOUT_S,
                   log_pace=(settings.LOG_PACE_BYTES_PER_SECOND, settings.LOG_PACE_BURST_BYTES),
                   resource_sample_s=settings.RESOURCE_SAMPLE_S)


def parse_storage_volume(text):
    """TRAINYARD_K8S_STORAGE_VOLUME: one Kubernetes volume source, as JSON, for the storage root."""
    name = "TRAINYARD_K8S_STORAGE_VOLUME"
    example = '{"persistentVolumeClaim": {"claimName": "trainyard-storage"}}'
    if not text:
        raise ConfigError(f"{name} is not set; learner pods need the shared storage, e.g. {example}")
    try:
        volume = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{name} is not valid JSON ({exc}); e.g. {example}") from None
    if not isinstance(volume, dict) or len(volume) != 1 or next(iter(volume)) not in VOLUME_SOURCES \
            or not isinstance(next(iter(volume.values())), dict):
        raise ConfigError(f"{name} must be one volume source object, one of {', '.join(sorted(VOLUME_SOURCES))}; "
                          f"e.g. {example}")
    return volume


def parse_ingest_url(text):
    if not text:
        return ""
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"TRAINYARD_K8S_INGEST_URL={text!r} must be an http(s) URL like "
                          "http://trainyard-ingest.trainyard.svc:8000")
    return text.rstrip("/")


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, api: KubeApi, config: K8sConfig, *, quota_for=None, watcher=None):
        """`quota_for(tenant_slug)` gives {gpus, cpus, memory_bytes, jobs} (None: no limit) or None."""
        self.api = api
        self.config = config
        self.quota_for = quota_for or (lambda slug: None)
        self.watcher = watcher
        self._ensured = {}  # tenant -> (the quota its namespace was made sure of with, time.monotonic())

    # --- tenants -------------------------------------------------------------------------------
    def namespace_for(self, tenant):
        return objects.namespace_name(self.config.namespace_prefix, tenant)

    def ensure_namespace(self, tenant, quota=None):
        """The tenant's namespace with its LimitRange, learner NetworkPolicy and, if it has a quota,
        a ResourceQuota mirroring it (updated when the quota changed). Returns the namespace name."""
        name = self.namespace_for(tenant)
        wanted_namespace = objects.namespace(name, tenant, self.config.platform)
        try:
            self.api.create(wanted_namespace)
        except AlreadyExists:
            labels = self._refuse_a_namespace_not_made_for(tenant, name)
            # Its Pod Security level as configured now, whatever an earlier release or a hand edit set.
            changed = {key: value for key, value in wanted_namespace["metadata"]["labels"].items()
                       if labels.get(key) != value}
            if changed:
                self.api.patch("Namespace", None, name, {"metadata": {"labels": changed}})
        # What an earlier release made (a looser policy: learners once reached the web pods) or a hand
        # edit left is put back as built today, not merely found to exist.
        self._create_or_make_like(objects.limit_range(name))
        self._create_or_make_like(objects.learners_default_policy(name, self.config.platform))
        wanted = objects.resource_quota(name, quota or {})
        current = self.api.read("ResourceQuota", name, "tenant-quota")
        if wanted["spec"]["hard"] and current is None:
            self._create_or_skip(wanted)
        elif current is not None and (current.get("spec") or {}).get("hard") != wanted["spec"]["hard"]:
            if wanted["spec"]["hard"]:
                # A merge patch keeps keys it does not name, so name the removed ones with null.
                hard = {key: None for key in (current.get("spec") or {}).get("hard") or {}}
                hard.update(wanted["spec"]["hard"])
                self.api.patch("ResourceQuota", name, "tenant-quota", {"spec": {"hard": hard}})
            else:
                self.api.delete("ResourceQuota", name, "tenant-quota")
        return name

    def _refuse_a_namespace_not_made_for(self, tenant, name):
        """A namespace of the tenant's name that the platform did not make for it (the prefix and a
        slug that spell an existing one) is not taken over: its workloads are none of the tenant's.
        Returns the labels of one it did make."""
        labels = ((self.api.read("Namespace", None, name) or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(objects.LABEL_TENANT) != tenant or any(labels.get(k) != v for k, v in objects.MANAGED_BY.items()):
            raise BackendError(f"namespace {name} exists but was not made by Trainyard for tenant {tenant} "
                               "(its labels say otherwise); choose another TRAINYARD_K8S_NAMESPACE_PREFIX or "
                               "rename the tenant", permanent=True)
        return labels

    def namespace_ready(self, tenant):
        """The tenant's namespace, made sure of (ensure_namespace) unless this process did so with the
        same quota within NAMESPACE_FRESH_S."""
        quota = self.quota_for(tenant)
        ensured = self._ensured.get(tenant)
        if ensured is not None and ensured[0] == quota and time.monotonic() - ensured[1] < NAMESPACE_FRESH_S:
            return self.namespace_for(tenant)
        name = self.ensure_namespace(tenant, quota)
        self._ensured[tenant] = (quota, time.monotonic())
        return name

    # --- deploy --------------------------------------------------------------------------------
    def deploy(self, spec: DeploySpec):
        namespace = self.namespace_ready(spec.tenant)
        self._prepare_folders(spec)
        try:
            self._create_attempt(spec, namespace)
        except NotFound:
            # On a create, 404 means the namespace is gone: make sure of it again when the deploy is
            # re-driven (NotFound is transient, the outbox retries).
            self._ensured.pop(spec.tenant, None)
            raise

    def _create_attempt(self, spec, namespace):
        try:
            pods = objects.PodSettings(image=self.image_for(spec), agent_image=self.config.agent_image,
                                       storage_root=str(storage.root()),
                                       storage_volume=self.config.storage_volume,
                                       run_as_user=self.config.run_as_user)
            configs = {learner.index: self.agent_config(spec, learner, namespace) for learner in spec.learners}
            root = self._create_or_read(objects.attempt_root(spec, namespace, configs))
            owners = objects.owner_references(root)
            if not owners:
                log.warning("the API server gave %s no uid; its objects are deleted one by one",
                            root["metadata"]["name"])
            children = [objects.ingest_secret(spec, namespace, owners),
                        objects.headless_service(spec, namespace, owners),
                        objects.attempt_peers_policy(spec, namespace, owners)]
            children += [objects.learner_pod(spec, learner, namespace, owners, pods) for learner in spec.learners]
        except ObjectError as exc:
            raise BackendError(str(exc), permanent=True) from exc
        for obj in children:
            self._create_or_skip(obj)

    def image_for(self, spec):
        if spec.image:
            return spec.image
        image = FRAMEWORK_IMAGES.get(spec.framework)
        if image is None:
            raise BackendError(f"framework {spec.framework!r} has no default learner image on Kubernetes; "
                               f"the job needs an image from the framework registry", permanent=True)
        return f"{self.config.image_prefix}{image}:{self.config.image_tag}"

    def agent_config(self, spec, learner, namespace):
        """The learner agent's config (learner_agent.config); secrets stay out (the token is a file)."""
        job_dir = Path(spec.job_dir)
        folder = storage.learner_dir(spec.tenant, spec.job_id, spec.attempt, learner.index)
        env = dict(spec.env, **learner.env)
        # The container sees only its own GPUs, numbered from 0 (the device plugin picks which).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(spec.gpus))
        if "MASTER_ADDR" in env:
            env.update(self._distributed_env(spec, learner, namespace))
        return {
            **agent_config_base(spec, learner),
            "work_dir": str(folder / "work"), "state_dir": str(folder), "env": env,
            "writable_dirs": [str(folder / "work"), str(job_dir / "results"), env["CHECKPOINT_DIR"],
                              env["JOB_STATE_DIR"]],
            "hidden_dirs": [],
            "ingest_url": self._ingest_url(spec.ingest_url),
            "ingest_token_file": f"{objects.TOKEN_DIR}/{objects.TOKEN_KEY}",
            "halt_file": f"{objects.PODINFO_DIR}/annotations",
            # The pod is the sandbox (own filesystem view, no privileges, network policy); bubblewrap
            # cannot create namespaces under the RuntimeDefault seccomp profile anyway.
            "sandbox": "none",
            "log_bytes_per_second": self.config.log_pace[0], "log_burst_bytes": self.config.log_pace[1],
            "resource_sample_s": self.config.resource_sample_s,
        }

    def _distributed_env(self, spec, learner, namespace):
        """How learners find each other here: by their pods' DNS names, not 127.0.0.1 as on `local`."""
        hosts = [objects.learner_host(spec.job_id, spec.attempt, i, namespace) for i in range(len(spec.learners))]
        env = {"MASTER_ADDR": hosts[0], "MASTER_PORT": str(objects.MASTER_PORT)}
        framework = frameworks.REGISTRY.get(spec.framework)
        if framework is not None:  # TF_CONFIG, JAX_COORDINATOR_ADDRESS, ... with these hosts
            env.update(framework.distributed_env(index=learner.index, learners=len(hosts), hosts=hosts,
                                                 port=objects.MASTER_PORT))
        return env

    def _ingest_url(self, url):
        if not self.config.ingest_url:
            return url
        base, path = urlparse(self.config.ingest_url), urlparse(url)
        return urlunparse(path._replace(scheme=base.scheme, netloc=base.netloc))

    def _prepare_folders(self, spec):
        # Created here, by the platform's user, so the learner's (non-root) user can write into them:
        # a subPath the kubelet has to create would belong to root.
        job_dir = Path(spec.job_dir)
        folders = [job_dir / "results", Path(spec.env["CHECKPOINT_DIR"])]
        folders += [storage.learner_dir(spec.tenant, spec.job_id, spec.attempt, lr.index) / sub
                    for lr in spec.learners for sub in ("work", "state/logs")]
        try:
            for folder in folders:
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"cannot prepare the job's folders on the shared storage: {exc}") from exc

    def _create_or_skip(self, obj):
        try:
            self.api.create(obj)
        except AlreadyExists:
            pass  # a repeated deploy: it is there from the first one

    def _create_or_make_like(self, obj):
        """Create `obj`, or bring the one there to its `spec` (a merge patch of what differs)."""
        try:
            self.api.create(obj)
            return
        except AlreadyExists:
            pass
        meta = obj["metadata"]
        current = self.api.read(obj["kind"], meta["namespace"], meta["name"]) or {}
        patch = merge_patch(current.get("spec") or {}, obj["spec"])
        if patch:
            self.api.patch(obj["kind"], meta["namespace"], meta["name"], {"spec": patch})

    def _create_or_read(self, obj):
        try:
            created = self.api.create(obj)
        except AlreadyExists:
            created = None
        if not (created or {}).get("metadata", {}).get("uid"):
            created = self.api.read(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]) or obj
        return created

    # --- observe -------------------------------------------------------------------------------
    def status(self, *, tenant, job_id, attempt, learners):
        namespace = self.namespace_for(tenant)
        pods = self._attempt_pods(namespace, job_id, attempt)
        now = datetime.now(timezone.utc)
        statuses = []
        for index in range(learners):
            name = objects.pod_name(job_id, attempt, index)
            pod = pods.get(name)
            if pod is None and self._cache_in_use():
                pod = self.api.read("Pod", namespace, name)  # the cache may just lag behind a create
            statuses.append(learner_status(index, pod, exit_record=self._exit_record(tenant, job_id, attempt, index),
                                           now=now, unschedulable_timeout_s=self.config.unschedulable_timeout_s))
        return statuses

    def _cache_in_use(self):
        return self.watcher is not None and self.watcher.fresh()

    def _attempt_pods(self, namespace, job_id, attempt):
        labels = objects.learner_selector(job_id, attempt)
        if self._cache_in_use():
            found = self.watcher.pods(labels)
        else:
            found, _ = self.api.list("Pod", namespace=namespace, labels=labels)
        return {pod["metadata"]["name"]: pod for pod in found
                if (pod.get("metadata") or {}).get("namespace", namespace) == namespace}

    def _exit_record(self, tenant, job_id, attempt, index):
        return read_exit_record(storage.learner_dir(tenant, job_id, attempt, index))

    def capacity(self):
        """Allocatable resources of every node that takes new pods (not cordoned, Ready)."""
        nodes, _ = self.api.list("Node")
        return Capacity(nodes=tuple(node for node in map(node_capacity, nodes) if node is not None))

    # --- stop ----------------------------------------------------------------------------------
    def halt(self, *, tenant, job_id, attempt, learners):
        """Ask each learner's agent to checkpoint and stop (it watches its pod's annotations)."""
        namespace = self.namespace_for(tenant)
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for index in range(learners):
            name = objects.pod_name(job_id, attempt, index)
            pod = self.api.read("Pod", namespace, name)
            if pod is None or ((pod.get("metadata") or {}).get("annotations") or {}).get(objects.HALT_ANNOTATION):
                continue  # gone, or asked already: a repeated halt must not restart the grace period
            self.api.patch("Pod", namespace, name, {"metadata": {"annotations": {objects.HALT_ANNOTATION: stamp}}})

    def delete(self, *, tenant, job_id, attempt, learners):
        """Remove everything the attempt created. The kubelet sends the agents SIGTERM and waits for
        their grace period; the agents stop their learners and deliver what is left."""
        namespace = self.namespace_for(tenant)
        for index in range(learners):
            self.api.delete("Pod", namespace, objects.pod_name(job_id, attempt, index))
        self.api.delete("NetworkPolicy", namespace, objects.peers_policy_name(job_id, attempt))
        self.api.delete("Service", namespace, objects.attempt_name(job_id, attempt))
        self.api.delete("Secret", namespace, objects.secret_name(job_id, attempt))
        self.api.delete("ConfigMap", namespace, objects.attempt_name(job_id, attempt))


def merge_patch(current, wanted):
    """The merge patch (RFC 7386; strategic merge reads it alike for these objects' fields) that turns
    the dict `current` into `wanted`, {} when they already agree: maps merged key by key, a key
    `wanted` lacks removed (None), anything else replaced whole. A field the server leaves out when it
    is empty agrees with an empty one."""
    patch = {key: None for key in current if key not in wanted}
    for key, value in wanted.items():
        old = current.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            nested = merge_patch(old, value)
            if nested:
                patch[key] = nested
        elif old != value and not (old in _EMPTY and value in _EMPTY):
            patch[key] = value
    return patch


_EMPTY = (None, [], {})


def node_capacity(node):
    """A Node for the scheduler's snapshot, or None for a node that takes no new learner pods."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if spec.get("unschedulable"):
        return None  # cordoned
    if not all(objects.tolerated(taint) for taint in spec.get("taints") or []):
        return None  # learner pods pinned there would never be scheduled (a control plane, another's node)
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    if ready and ready[0].get("status") != "True":
        return None
    allocatable = status.get("allocatable") or {}
    try:
        return Node(name=node["metadata"]["name"],
                    gpus=int(parse_quantity(allocatable.get(objects.GPU_RESOURCE, 0))),
                    cpus=parse_quantity(allocatable.get("cpu", 0)),
                    memory_bytes=int(parse_quantity(allocatable.get("memory", 0))))
    except (KubeError, SchedulingInputError) as exc:
        log.warning("ignoring node %s: %s", node.get("metadata", {}).get("name"), exc)
        return None

