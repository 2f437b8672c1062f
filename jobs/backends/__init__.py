"""Learner backends: where learners actually run. `get_backend()` picks the configured one."""
from functools import lru_cache

from django.conf import settings


@lru_cache(maxsize=None)
def get_backend():
    if settings.BACKEND == "local":
        from jobs.backends.local import LocalBackend
        return LocalBackend()
    raise NotImplementedError(f"TRAINYARD_BACKEND={settings.BACKEND!r} is not available in this build")
