"""One Redis connection pool per process for Django's cache.

Django keeps a cache object per thread-and-request context (its `caches` handler is an asgiref
Local), and each object built its own connection pool: under daphne, where every request runs its
sync code in a thread of its own, each request opened a new TCP connection to Redis (with its
HELLO/CLIENT SETINFO round trips) for the throttling counters and the dispatch coalescing keys
— about a tenth of the web process's CPU at 1,000 learners posting (bench controlplane, py-spy).
`CACHES["default"]["OPTIONS"]["pool_class"]` names this class, so every cache object of a process
shares one pool per server and options; redis-py's pool is thread-safe and resets itself in a
forked child (Celery's prefork workers).
"""
import threading

import redis


class SharedConnectionPool(redis.ConnectionPool):
    _shared = {}
    _lock = threading.Lock()

    @classmethod
    def from_url(cls, url, **kwargs):
        key = (url, tuple(sorted((name, repr(value)) for name, value in kwargs.items())))
        with cls._lock:
            pool = cls._shared.get(key)
            if pool is None:
                pool = cls._shared[key] = super().from_url(url, **kwargs)
            return pool
