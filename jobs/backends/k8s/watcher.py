"""A cache of the learner pods, kept current by list + watch (an informer in miniature).

`sync()` lists every Trainyard pod and remembers the list's resourceVersion; `watch_once()` follows
changes from there until the server closes the stream, tracking the resourceVersion of each event and
bookmark. A 410 Gone (the version is too old) or any broken stream leads to a fresh list, and so does
every `resync_s` seconds, so a missed event can only leave the cache stale for one resync period.
`run()` loops that in a daemon thread; `status()` of the backend reads the cache while it is fresh
and lists directly otherwise, so correctness never depends on the watch.

The cache is fresh while that loop follows the watch without error, however long ago the last list
was (a stream kept open past `resync_s` is ended by the watcher itself for the resync); a stale cache
costs a list per job per reconcile pass. Pods are indexed by their job's label: the backend asks for
one job's pods at a time.
"""
import logging
import threading
import time

from jobs.backends.k8s.api import Gone, KubeError
from jobs.backends.k8s.objects import LABEL_JOB, MANAGED_BY

log = logging.getLogger(__name__)


class PodWatcher:
    def __init__(self, api, *, resync_s=300.0, watch_timeout_s=60.0, on_change=None, clock=time.monotonic):
        self.api = api
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.on_change = on_change  # called with (event type, pod) after the cache changed
        self._clock = clock
        self._lock = threading.Lock()
        self._pods = {}  # (namespace, name) -> pod dict
        self._by_job = {}  # job label -> {(namespace, name): pod dict}
        self._resource_version = None
        self._synced_at = None
        self._following = False  # run() is following the watch from the last list, no error since
        self._stop = threading.Event()
        self._thread = None

    # --- reading -------------------------------------------------------------------------------
    def fresh(self):
        """Whether the cache reflects a list plus every watch event since: the watch is being
        followed, or the list is less than `resync_s` old."""
        with self._lock:
            return self._synced_at is not None and (
                self._following or self._clock() - self._synced_at < self.resync_s)

    def pods(self, labels):
        with self._lock:
            if LABEL_JOB in labels:
                candidates = self._by_job.get(labels[LABEL_JOB], {}).values()
            else:
                candidates = self._pods.values()
            return [pod for pod in candidates if all(_labels(pod).get(k) == v for k, v in labels.items())]

    @property
    def resource_version(self):
        return self._resource_version

    # --- feeding -------------------------------------------------------------------------------
    def sync(self):
        """Replace the cache with a fresh list of every Trainyard pod."""
        items, version = self.api.list("Pod", labels=MANAGED_BY)
        with self._lock:
            self._pods, self._by_job = {}, {}
            for pod in items:
                self._put(pod)
            self._resource_version = version
            self._synced_at = self._clock()
        log.debug("pod cache synced: %d pods at resourceVersion %s", len(items), version)

    def watch_once(self):
        """Follow changes until the stream ends or a resync is due; on 410 Gone forget the version
        so the next pass lists."""
        try:
            for kind, pod in self.api.watch("Pod", labels=MANAGED_BY, resource_version=self._resource_version,
                                            timeout_s=self.watch_timeout_s):
                self.apply(kind, pod)
                if self._stop.is_set() or self.due_for_resync():
                    return
        except Gone:
            log.info("pod watch expired (410 Gone); listing again")
            with self._lock:
                self._resource_version = None
                self._synced_at = None

    def apply(self, kind, pod):
        version = (pod.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            if version:  # a fake API server may leave it out: keep the last one known
                self._resource_version = version
            if kind == "BOOKMARK":
                return
            if kind == "DELETED":
                self._drop(pod)
            else:
                self._put(pod)
        if self.on_change is not None:
            try:
                self.on_change(kind, pod)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the cache
                log.exception("pod change listener failed")

    def _put(self, pod):
        """Store `pod` (under the lock), replacing any earlier version of it in both maps."""
        key = _key(pod)
        earlier = self._pods.get(key)
        if earlier is not None and _labels(earlier).get(LABEL_JOB) != _labels(pod).get(LABEL_JOB):
            self._drop(earlier)
        self._pods[key] = pod
        self._by_job.setdefault(_labels(pod).get(LABEL_JOB), {})[key] = pod

    def _drop(self, pod):
        key = _key(pod)
        earlier = self._pods.pop(key, None)
        job = _labels(earlier if earlier is not None else pod).get(LABEL_JOB)
        pods = self._by_job.get(job)
        if pods is not None:
            pods.pop(key, None)
            if not pods:
                del self._by_job[job]

    def due_for_resync(self):
        with self._lock:
            return self._synced_at is None or self._resource_version is None or \
                self._clock() - self._synced_at >= self.resync_s

    # --- the loop ------------------------------------------------------------------------------
    def run_once(self):
        if self.due_for_resync():
            self.sync()
        with self._lock:
            self._following = self._synced_at is not None
        self.watch_once()

    def run(self, *, error_backoff_s=1.0, max_backoff_s=30.0):
        backoff = error_backoff_s
        while not self._stop.is_set():
            try:
                self.run_once()
                backoff = error_backoff_s
            except KubeError as exc:
                log.warning("pod watch failed (%s); retrying in %.0fs", exc, backoff)
                with self._lock:
                    self._synced_at = None  # events may have been missed: list again
                    self._following = False
                self._stop.wait(backoff)
                backoff = min(max_backoff_s, backoff * 2)

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="k8s-pod-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        with self._lock:
            self._following = False


def _labels(pod):
    return (pod.get("metadata") or {}).get("labels") or {}


def _key(pod):
    meta = pod.get("metadata") or {}
    return meta.get("namespace"), meta.get("name")
