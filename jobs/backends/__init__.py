"""Learner backends: where learners actually run. `get_backend()` picks the configured one."""
from functools import lru_cache

from django.conf import settings


@lru_cache(maxsize=None)
def get_backend():
    """The configured backend; its failing calls are counted for /metrics (jobs.prometheus_series)."""
    from jobs.prometheus_series import CountingBackend
    return CountingBackend(_build_backend())


def _build_backend():
    if settings.BACKEND == "local":
        from jobs.backends.local import LocalBackend
        return LocalBackend()
    if settings.BACKEND == "kubernetes":
        from jobs.backends.k8s import build_backend
        return build_backend(settings, quota_for=tenant_quota)
    raise NotImplementedError(f"TRAINYARD_BACKEND={settings.BACKEND!r} is not available in this build")


def tenant_quota(tenant_slug):
    """The limits a tenant's namespace mirrors as a ResourceQuota: {gpus, cpus, memory_bytes, jobs}
    (jobs is passed along but not mirrored; see jobs.backends.k8s.objects.resource_quota).

    A tenant allowed to borrow idle capacity gets no GPU/CPU/memory cap in its namespace (the
    scheduler decides when it may exceed its share), only its cap on jobs at once.
    """
    from tenants.models import Quota

    quota = Quota.objects.filter(tenant__slug=tenant_slug).first()
    if quota is None:
        return None
    limits = {"gpus": quota.gpus, "cpus": quota.cpus, "memory_bytes": quota.memory_bytes, "jobs": quota.jobs}
    if quota.can_borrow:
        limits.update(gpus=None, cpus=None, memory_bytes=None)
    return limits
