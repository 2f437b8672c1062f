"""The `kubernetes` backend (TRAINYARD_BACKEND=kubernetes); see docs/kubernetes.md.

Layout: `objects` builds every manifest (pure), `podstatus` reads pods (pure), `api` is the only
module importing the `kubernetes` client, `watcher` keeps a pod cache, `backend` puts them together.
"""
from jobs.backends.k8s.backend import K8sConfig, KubernetesBackend


def build_backend(settings, *, quota_for=None):
    """The backend as configured by Django settings (KUBECONFIG / in-cluster, TRAINYARD_K8S_*)."""
    from jobs.backends.k8s.api import KubeApi, load_api_client
    from jobs.backends.k8s.watcher import PodWatcher

    config = K8sConfig.from_settings(settings)
    api = KubeApi(load_api_client(context=settings.K8S_CONTEXT), retries=settings.K8S_API_RETRIES)
    watcher = PodWatcher(api, resync_s=settings.K8S_RESYNC_S).start() if settings.K8S_WATCH else None
    return KubernetesBackend(api, config, quota_for=quota_for, watcher=watcher)


__all__ = ["K8sConfig", "KubernetesBackend", "build_backend"]
