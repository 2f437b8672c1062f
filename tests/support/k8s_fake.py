"""A fake Kubernetes cluster for tests: kmock's KubernetesEmulator (a stateful API server over HTTP)
in a background thread, plus a "kubelet" that moves pods along by PATCHing their status.

The backend talks to it through the official client exactly as to a real API server. The fake lacks
what a cluster does on its own: no scheduler, no kubelet, no garbage collector, no admission, and it
ignores label selectors (the backend filters too). Five things are adjusted here, each says why.
"""
import asyncio
import itertools
import json
import threading
import urllib.request
import uuid
from datetime import datetime, timezone

import aiohttp.web

from kmock import KubernetesEmulator, Server
from kmock._internal import parsing
from kmock._internal.k8s import KubernetesObjectConflictError

VERSION = {"major": "1", "minor": "34", "gitVersion": "v1.34.0", "gitCommit": "fake", "gitTreeState": "clean",
           "buildDate": "2025-08-27T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"}
_original_parse_path = parsing.parse_path


def _parse_path(path):
    # kmock 0.8 reads /api/v1/namespaces[/NAME] as "the namespace prefix of some other resource" and
    # fails; they are the cluster-scoped Namespace resource itself.
    parts = path.strip("/").split("/")
    if len(parts) in (3, 4) and parts[0] == "api" and parts[2] == "namespaces":
        return parsing.ParsedPath("", parts[1], "namespaces", None, parts[3] if len(parts) == 4 else None, None)
    return _original_parse_path(path)


class RealisticEmulator(KubernetesEmulator):
    """Assigns uid, creationTimestamp and resourceVersion as an API server does (kmock leaves them out)."""

    _versions = itertools.count(1000)

    async def _handle(self, request):
        # kmock logs every request for tests' assertions and matches each new one against its
        # reactions by scanning that whole log, so each request cost grew with all before it (0.2 s
        # per create after 2,000 requests, seconds per deploy in the control-plane bench). Nothing
        # here asserts on the log: keep only the request being served.
        del self._requests[:-1]
        data = request.data if isinstance(request.data, dict) else None
        if data is not None and request.resource is not None and request.method.upper() in ("POST", "PATCH"):
            meta = data.setdefault("metadata", {})
            if request.method.upper() == "POST":
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = str(next(self._versions))
        return await super()._handle(request)

    async def _render_error(self, exc):
        # kmock answers a create of an existing object with reason "Object Already Exists"; an API
        # server says "AlreadyExists" (metav1.StatusReasonAlreadyExists), which the backend goes by.
        if isinstance(exc, KubernetesObjectConflictError):
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": 409,
                "reason": "AlreadyExists", "message": "object already exists"}, status=409)
        return await super()._render_error(exc)


class FakeCluster:
    def __init__(self, *, realistic=True):
        self.realistic = realistic
        self.url = None
        self.emulator = None
        self._loop = None
        self._stopped = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="fake-k8s", daemon=True)

    def start(self):
        parsing.parse_path = _parse_path
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake Kubernetes API server did not start")
        return self

    def stop(self):
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)
        parsing.parse_path = _original_parse_path

    async def _serve(self):
        cls = RealisticEmulator if self.realistic else KubernetesEmulator
        async with cls() as emulator, Server(emulator) as server:
            emulator.resources.load_bundled()
            # The official client asks for /version/ with the slash, which kmock does not route.
            emulator["get /version/"] << VERSION
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stopped.wait()

    # --- plain HTTP, as other cluster components would talk to the API server ---------------------
    def request(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/merge-patch+json"
                                              if method == "PATCH" else "application/json"})
        with urllib.request.urlopen(req, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def get(self, path):
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def names(self, plural, namespace, *, group="api/v1"):
        listing = self.get(f"/{group}/namespaces/{namespace}/{plural}") or {}
        return sorted(item["metadata"]["name"] for item in listing.get("items", []))

    def add_node(self, name, *, gpus=0, cpus="8", memory="32Gi", cordoned=False, ready=True, taints=()):
        self.request("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "spec": {"unschedulable": cordoned, **({"taints": list(taints)} if taints else {})},
            "status": {"allocatable": {"cpu": cpus, "memory": memory, "nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})


class Kubelet:
    """Moves pods through their life the way a scheduler + kubelet would report it."""

    def __init__(self, cluster):
        self.cluster = cluster

    def _patch_status(self, namespace, name, status):
        return self.cluster.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status})

    def schedule(self, namespace, name, node="node-1"):
        self.cluster.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", {"spec": {"nodeName": node}})
        self._patch_status(namespace, name, {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]})

    def run(self, namespace, name):
        self._patch_status(namespace, name, {"phase": "Running", "containerStatuses": [
            {"name": "learner", "ready": True, "restartCount": 0, "image": "img", "imageID": "",
             "state": {"running": {"startedAt": _now()}}}]})

    def terminate(self, namespace, name, *, exit_code=0, reason="Completed"):
        phase = "Succeeded" if exit_code == 0 else "Failed"
        self._patch_status(namespace, name, {"phase": phase, "containerStatuses": [
            {"name": "learner", "ready": False, "restartCount": 0, "image": "img", "imageID": "",
             "state": {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": _now()}}}]})

    def image_pull_backoff(self, namespace, name, message):
        self._patch_status(namespace, name, {"phase": "Pending", "containerStatuses": [
            {"name": "learner", "ready": False, "restartCount": 0, "image": "registry.example/nope:1", "imageID": "",
             "state": {"waiting": {"reason": "ImagePullBackOff", "message": message}}}]})

    def unschedulable(self, namespace, name, message, *, since):
        self._patch_status(namespace, name, {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
             "lastTransitionTime": since}]})


def _now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
