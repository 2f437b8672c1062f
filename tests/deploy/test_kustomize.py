"""deploy/kubernetes: both overlays as `kubectl kustomize` renders them, valid against the Kubernetes
schemas (strict: an unknown or misspelt field fails) of the oldest version the manual supports and the
newest kubernetes-validate knows, and each overlay being what the manual says it is."""
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.optional import skip_or_fail

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("dev", "production")
VERSIONS = ("1.25.0", kubernetes_validate.utils.latest_version())  # docs/kubernetes.md: "Kubernetes 1.25 or newer"
PLATFORM = {"trainyard-web", "trainyard-ingest", "trainyard-worker", "trainyard-scheduler", "trainyard-webhooks",
            "trainyard-beat", "trainyard-migrate"}
SCHEDULER = "trainyard-scheduler"  # two replicas everywhere: a leader and a standby


def render(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        skip_or_fail("kubectl is not installed (Debian package kubectl)")
    result = subprocess.run([kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(objects):
    """{workload name: its container} of the platform's Deployments and the migration Job."""
    workloads = {**by_kind(objects, "Deployment"), **by_kind(objects, "Job")}
    return {name: w["spec"]["template"]["spec"]["containers"][0] for name, w in workloads.items() if name in PLATFORM}


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", VERSIONS)
def test_its_rendered_objects_are_valid_kubernetes(overlay, version):
    objects = render(overlay)
    assert objects
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): "
                        f"{'.'.join(map(str, error.path))}: {error.message}")


def test_dev_runs_postgres_and_redis_in_the_cluster():
    objects = render("dev")
    assert {"trainyard-postgres", "trainyard-redis"} <= set(by_kind(objects, "StatefulSet"))
    config = by_kind(objects, "ConfigMap")["trainyard-config"]["data"]
    assert config["REDIS_URL"] == "redis://trainyard-redis.trainyard.svc:6379/0"
    assert set(containers(objects)) == PLATFORM
    assert by_kind(objects, "NetworkPolicy")["trainyard-datastores"]
    assert all(d["spec"]["replicas"] == 1 for name, d in by_kind(objects, "Deployment").items()
               if name in PLATFORM - {SCHEDULER})


def test_production_uses_external_datastores_from_the_secret():
    objects = render("production")
    assert not by_kind(objects, "StatefulSet"), "production runs no PostgreSQL or Redis of its own"
    assert "REDIS_URL" not in by_kind(objects, "ConfigMap")["trainyard-config"]["data"]
    for name, container in containers(objects).items():
        env = env_of(container)
        for variable, key in (("REDIS_URL", "redis-url"), ("DATABASE_URL", "database-url")):
            assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": "trainyard-secrets", "key": key}, name


def test_production_sizes_scales_and_protects_web_and_workers():
    objects = render("production")
    for name, container in containers(objects).items():
        if name != "trainyard-migrate":
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), name
    deployments = by_kind(objects, "Deployment")
    for name in ("trainyard-web", "trainyard-ingest", "trainyard-worker"):
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        budget = by_kind(objects, "PodDisruptionBudget")[name]["spec"]
        assert budget["minAvailable"] >= 1 and budget["selector"]["matchLabels"].items() <= labels.items()
        scaler = by_kind(objects, "HorizontalPodAutoscaler")[name]["spec"]
        assert scaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert 2 <= scaler["minReplicas"] < scaler["maxReplicas"]
    assert "trainyard-beat" not in by_kind(objects, "HorizontalPodAutoscaler")  # exactly one beat, always


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scheduling_loop_runs_a_leader_and_a_standby(overlay):
    """Two replicas of `manage.py run_scheduler`, never scaled (one leads, the rest only stand by), on
    the service account that may read the nodes' capacity; in production a drain keeps one."""
    objects = render(overlay)
    scheduler = by_kind(objects, "Deployment")[SCHEDULER]
    assert scheduler["spec"]["replicas"] == 2
    pod = scheduler["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["python", "manage.py", "run_scheduler"]
    assert pod["serviceAccountName"] == "trainyard-lifecycle"
    assert SCHEDULER not in by_kind(objects, "HorizontalPodAutoscaler")
    if overlay == "production":
        budget = by_kind(objects, "PodDisruptionBudget")[SCHEDULER]["spec"]
        assert budget["minAvailable"] == 1
        assert budget["selector"]["matchLabels"].items() <= scheduler["spec"]["template"]["metadata"]["labels"].items()
    else:
        allowed = by_kind(objects, "NetworkPolicy")["trainyard-datastores"]["spec"]["ingress"][0]["from"][0]
        assert "scheduler" in allowed["podSelector"]["matchExpressions"][0]["values"]  # it reaches PostgreSQL and Redis


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_web_server_may_only_read_nodes(overlay):
    """The process that faces the users carries no account that could make or delete pods anywhere."""
    objects = render(overlay)
    pod = by_kind(objects, "Deployment")["trainyard-web"]["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    bindings = [b for b in [*by_kind(objects, "ClusterRoleBinding").values(), *by_kind(objects, "RoleBinding").values()]
                if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])]
    roles = by_kind(objects, "ClusterRole")
    rules = [rule for binding in bindings for rule in roles[binding["roleRef"]["name"]]["rules"]]
    assert rules == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]
    assert env_of(pod["containers"][0])["TRAINYARD_K8S_WATCH"]["value"] == "false"  # no pod cache to feed


def test_the_web_reads_the_metrics_token_from_the_secret():
    for overlay in OVERLAYS:
        token = env_of(containers(render(overlay))["trainyard-web"])["TRAINYARD_METRICS_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["key"] == "metrics-token"


def test_the_web_reads_single_sign_on_from_the_config_and_its_client_secret_from_the_secret():
    for overlay in OVERLAYS:
        objects = render(overlay)
        config = by_kind(objects, "ConfigMap")["trainyard-config"]["data"]
        assert {"TRAINYARD_OIDC_ISSUER", "TRAINYARD_OIDC_CLIENT_ID", "TRAINYARD_OIDC_GROUP_MAP",
                "TRAINYARD_LOCAL_LOGIN"} <= set(config)
        secret = env_of(containers(objects)["trainyard-web"])["TRAINYARD_OIDC_CLIENT_SECRET"]
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "trainyard-secrets", "key": "oidc-client-secret",
                                                       "optional": True}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agents_post_to_ingest_servers_their_network_policy_lets_them_reach(overlay):
    """TRAINYARD_K8S_INGEST_URL names the ingest Service; its pods, and no other platform pods, are what
    the learners' default policy (jobs.backends.k8s.objects) opens egress to, and they serve only the
    ingest endpoint. The ingest servers do not talk to the Kubernetes API."""
    from urllib.parse import urlsplit

    from jobs.backends.k8s import objects as k8s_objects
    rendered = render(overlay)
    config = by_kind(rendered, "ConfigMap")["trainyard-config"]["data"]
    host = urlsplit(config["TRAINYARD_K8S_INGEST_URL"]).hostname
    service_name, namespace = host.split(".")[:2]
    service = by_kind(rendered, "Service")[service_name]
    assert service["metadata"]["namespace"] == namespace == config["TRAINYARD_K8S_PLATFORM_NAMESPACE"]
    selected = [d for d in by_kind(rendered, "Deployment").values()
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert [d["metadata"]["name"] for d in selected] == ["trainyard-ingest"]
    platform = k8s_objects.Platform(namespace=namespace, ingest_port=int(config["TRAINYARD_K8S_INGEST_PORT"]))
    rule = k8s_objects.learners_default_policy("trainyard-team-a", platform)["spec"]["egress"][1]
    selector = rule["to"][0]["podSelector"]
    labels = selected[0]["spec"]["template"]["metadata"]["labels"]
    assert selector["matchLabels"].items() <= labels.items()
    reachable = [d["metadata"]["name"] for d in by_kind(rendered, "Deployment").values()
                 if selector["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert reachable == ["trainyard-ingest"]
    assert "portal.asgi:ingest_application" in selected[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert rule["ports"] == [{"protocol": "TCP", "port": service["spec"]["ports"][0]["port"]}]
    assert selected[0]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
