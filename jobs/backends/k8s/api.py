"""The one module that imports the official `kubernetes` client.

Everything else in the backend works on plain dicts (the JSON the API server speaks) and on the
project's own errors: KubeError is a BackendError, transient (retried here with backoff, then by the
Celery task) or permanent (bad input, missing permission: retrying cannot help). Responses are read as
raw JSON rather than the client's models, so a field the models do not know, or one a fake API server
leaves out, never breaks a read.
"""
import json
import logging
import os

import tenacity
import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.utils import parse_quantity as _parse_quantity
from kubernetes.watch.watch import iter_resp_lines

from jobs.backends.base import BackendError

log = logging.getLogger(__name__)
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
REQUEST_TIMEOUT = (5, 30)  # connect, read (seconds)


class KubeError(BackendError):
    def __init__(self, message, *, status=None, permanent=False):
        super().__init__(message, permanent=permanent)
        self.status = status


class NotFound(KubeError):
    pass


class AlreadyExists(KubeError):
    pass


class QuotaExceeded(KubeError):
    """The namespace's ResourceQuota refused a pod: transient, it frees up when the tenant's other pods end."""


class Gone(KubeError):
    """A watch's resourceVersion is too old (HTTP 410): list again, then watch from the new one."""


# kind -> (API class, the snake-case name in the client's method names, namespaced?)
KINDS = {
    "Namespace": (k8s_client.CoreV1Api, "namespace", False),
    "Node": (k8s_client.CoreV1Api, "node", False),
    "Pod": (k8s_client.CoreV1Api, "pod", True),
    "Service": (k8s_client.CoreV1Api, "service", True),
    "Secret": (k8s_client.CoreV1Api, "secret", True),
    "ConfigMap": (k8s_client.CoreV1Api, "config_map", True),
    "ResourceQuota": (k8s_client.CoreV1Api, "resource_quota", True),
    "LimitRange": (k8s_client.CoreV1Api, "limit_range", True),
    "NetworkPolicy": (k8s_client.NetworkingV1Api, "network_policy", True),
}


def load_api_client(*, context=""):
    """An ApiClient from KUBECONFIG (or ~/.kube/config), or the pod's service account in a cluster."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG") and not context:
            configuration = k8s_client.Configuration()
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s_client.ApiClient(configuration)
        # KUBECONFIG is read now, not when the client was imported (its own default is import-time).
        return k8s_config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or None,
                                                 context=context or None)
    except (k8s_config.ConfigException, OSError) as exc:
        raise KubeError(f"cannot load the Kubernetes configuration (KUBECONFIG or in-cluster): {exc}",
                        permanent=True) from exc


def api_client_for(host):
    """An ApiClient for a server at `host` (an http URL) with no authentication: tests' fake servers."""
    configuration = k8s_client.Configuration()
    configuration.host = host.rstrip("/")
    return k8s_client.ApiClient(configuration)


def parse_quantity(value):
    """A Kubernetes quantity ("3800m", "16Gi", "64", 2) as a float, by the client's own parser."""
    try:
        return float(_parse_quantity(value))
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise KubeError(f"{value!r} is not a Kubernetes quantity ({exc})", permanent=True) from None


class KubeApi:
    def __init__(self, api_client, *, retries=4, backoff_s=0.2, max_backoff_s=5.0):
        self.api_client = api_client
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self._apis = {}

    # --- objects -------------------------------------------------------------------------------
    def create(self, obj):
        """Create `obj`; the created object (AlreadyExists if it is there already)."""
        kind, namespace = obj["kind"], obj["metadata"].get("namespace")
        api, snake, namespaced = self._resolve(kind)
        if namespaced:
            return self._call(f"create {kind} {namespace}/{obj['metadata']['name']}",
                              getattr(api, f"create_namespaced_{snake}"), namespace, obj)
        return self._call(f"create {kind} {obj['metadata']['name']}", getattr(api, f"create_{snake}"), obj)

    def read(self, kind, namespace, name):
        """The object, or None if there is none."""
        try:
            return self._call(f"read {kind} {namespace}/{name}", *self._method(kind, "read", namespace, name))
        except NotFound:
            return None

    def patch(self, kind, namespace, name, body):
        return self._call(f"patch {kind} {namespace}/{name}", *self._method(kind, "patch", namespace, name), body)

    def delete(self, kind, namespace, name):
        """Delete with background propagation (owned objects go too); False if it was already gone."""
        try:
            self._call(f"delete {kind} {namespace}/{name}", *self._method(kind, "delete", namespace, name),
                       propagation_policy="Background")
        except NotFound:
            return False
        return True

    def list(self, kind, *, namespace=None, labels=None):
        """(items, resourceVersion) of the objects of `kind` carrying every label in `labels`.

        The label filter is also applied here, not only by the server: it costs nothing and keeps a
        server that ignores labelSelector (a fake) from handing back other jobs' objects.
        """
        api, snake, namespaced = self._resolve(kind)
        selector = _selector(labels)
        if namespaced and namespace:
            method, args = getattr(api, f"list_namespaced_{snake}"), (namespace,)
        elif namespaced:
            method, args = getattr(api, f"list_{snake}_for_all_namespaces"), ()
        else:
            method, args = getattr(api, f"list_{snake}"), ()
        result = self._call(f"list {kind}", method, *args, label_selector=selector)
        items = [item for item in result.get("items") or [] if _has_labels(item, labels)]
        for item in items:  # list items carry no kind; callers treat all objects alike
            item.setdefault("kind", kind)
        return items, (result.get("metadata") or {}).get("resourceVersion")

    def watch(self, kind, *, labels=None, resource_version=None, timeout_s=60):
        """Yield (type, object) for every change to `kind` objects (all namespaces) after
        `resource_version`, until the server ends the stream (about `timeout_s`). Raises Gone on 410."""
        api, snake, _ = self._resolve(kind)
        options = {"label_selector": _selector(labels), "timeout_seconds": int(timeout_s),
                   "allow_watch_bookmarks": True, "watch": True, "_preload_content": False,
                   "_request_timeout": (REQUEST_TIMEOUT[0], timeout_s + 10)}
        if resource_version:
            options["resource_version"] = resource_version
        # The stream is read line by line here rather than through kubernetes.watch.Watch, which
        # deserializes into models and retries a 410 on its own; this loop wants raw dicts and Gone.
        try:
            response = getattr(api, f"list_{snake}_for_all_namespaces")(**options)
            try:
                for line in iter_resp_lines(response):
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise _from_status_object(obj, f"watch {kind}")
                    if event.get("type") == "BOOKMARK" or _has_labels(obj, labels):
                        yield event["type"], obj
            finally:
                response.release_conn()
        except k8s_client.ApiException as exc:
            raise _error(exc, f"watch {kind}") from exc
        except urllib3.exceptions.ReadTimeoutError:
            # Nothing arrived for longer than the stream was to last: nothing was missed either, so
            # this ends the stream as the server's own timeout would, and the next one goes on from
            # the same version. (A server that ignores timeoutSeconds ends a quiet stream this way.)
            return
        except urllib3.exceptions.HTTPError as exc:
            raise KubeError(f"watch {kind}: connection failed: {exc}") from exc
        except ValueError as exc:
            raise KubeError(f"watch {kind}: unreadable event: {exc}") from exc

    # --- plumbing ------------------------------------------------------------------------------
    def _resolve(self, kind):
        try:
            api_class, snake, namespaced = KINDS[kind]
        except KeyError:
            raise KubeError(f"kind {kind!r} is not one the backend manages", permanent=True) from None
        if api_class not in self._apis:
            self._apis[api_class] = api_class(self.api_client)
        return self._apis[api_class], snake, namespaced

    def _method(self, kind, verb, namespace, name):
        api, snake, namespaced = self._resolve(kind)
        if namespaced:
            return getattr(api, f"{verb}_namespaced_{snake}"), name, namespace
        return getattr(api, f"{verb}_{snake}"), name

    def _call(self, what, method, *args, raw=False, **kwargs):
        """Call the API, retrying transient failures with exponential backoff; the decoded JSON."""
        def once():
            try:
                response = method(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
            except k8s_client.ApiException as exc:
                raise _error(exc, what) from None
            except urllib3.exceptions.HTTPError as exc:
                raise KubeError(f"{what}: cannot reach the Kubernetes API: {exc}") from None
            text = response.data.decode("utf-8", errors="replace")
            return text if raw else (json.loads(text) if text.strip() else {})

        def say_retrying(state):
            log.warning("%s failed (%s); retrying in %.1fs", what, state.outcome.exception(), state.next_action.sleep)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(_transient),
            wait=tenacity.wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            stop=tenacity.stop_after_attempt(self.retries + 1), before_sleep=say_retrying, reraise=True)(once)


def _transient(error):
    """Worth calling again: a KubeError that is not permanent, and not an answer about the object
    itself (it does not exist, or already does)."""
    return isinstance(error, KubeError) and not error.permanent and not isinstance(error, (NotFound, AlreadyExists))


def _error(exc, what):
    """The project's error for an ApiException, from the Status object the API server sends."""
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        body = {}
    body = body if isinstance(body, dict) else {}
    message = body.get("message") or exc.reason or ""
    return _classify(exc.status, body.get("reason"), f"{what}: {message} (HTTP {exc.status})")


def _from_status_object(obj, what):
    return _classify(obj.get("code"), obj.get("reason"),
                     f"{what}: {obj.get('message') or obj.get('reason')} (HTTP {obj.get('code')})")


def _classify(status, reason, message):
    """Which error, and whether retrying can help, from the HTTP status and the Status object's
    `reason` (metav1.StatusReason), never from the wording of its message — with one exception: a
    ResourceQuota refusal is a plain `Forbidden` whose only mark is the quota admission's
    "exceeded quota" message, so that one test needs both."""
    if status == 404:
        return NotFound(message, status=status)
    if reason == "AlreadyExists":
        return AlreadyExists(message, status=status)
    if status == 410 or reason in ("Expired", "Gone"):
        return Gone(message, status=status)
    if status == 403 and reason == "Forbidden" and "exceeded quota" in message:
        return QuotaExceeded(message, status=status)
    transient = status is None or status in TRANSIENT_STATUS or status == 409  # 409 Conflict: read again, retry
    return KubeError(message, status=status, permanent=not transient)


def _selector(labels):
    return ",".join(f"{key}={value}" for key, value in sorted((labels or {}).items()))


def _has_labels(obj, labels):
    present = (obj.get("metadata") or {}).get("labels") or {}
    return all(present.get(key) == value for key, value in (labels or {}).items())
