"""Django's Redis cache with one connection pool per process (through its public `pool_class` option),
and caches kept open between requests.

Django keeps a cache object per thread-and-request context (its `caches` handler is an asgiref
Local), and each object builds its own connection pool: under the ASGI server, where every request
runs its sync code in a thread of its own, each request would open a new TCP connection to Redis
for the throttling counters. `CACHES["default"]["OPTIONS"]["pool_class"]` names SharedConnectionPool,
so every cache object of a process shares one pool per server and options; redis-py's pool is
thread-safe and resets itself in a forked child (Celery's prefork workers).
"""
import threading

import redis

_shared = {}  # (url, options) -> the process's pool
_shared_lock = threading.Lock()


class SharedConnectionPool(redis.ConnectionPool):
    @classmethod
    def from_url(cls, url, **kwargs):
        key = (url, tuple(sorted((name, repr(value)) for name, value in kwargs.items())))
        with _shared_lock:
            pool = _shared.get(key)
            if pool is None:
                pool = _shared[key] = super().from_url(url, **kwargs)
            return pool


def keep_between_requests():
    """Stop Django closing every cache at the end of each request (its `close_caches` receiver of
    request_finished) when no configured backend has anything to close: the Redis and local-memory
    backends' close() is BaseCache's no-op, and the pool above outlives requests. Each request's
    thread otherwise looks every cache up in an asgiref Local to close nothing. A backend with a
    close() of its own keeps the receiver."""
    from django.core import signals
    from django.core.cache import caches, close_caches
    from django.core.cache.backends.base import BaseCache
    if all(type(caches.create_connection(alias)).close is BaseCache.close for alias in caches.settings):
        signals.request_finished.disconnect(close_caches)
