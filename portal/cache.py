"""One Redis connection pool per process for Django's cache, and one client per pool.

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
import weakref

import redis
from django.core.cache.backends.redis import RedisCache as DjangoRedisCache
from django.core.cache.backends.redis import RedisCacheClient


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


class RedisCache(DjangoRedisCache):
    """Django's Redis cache with one redis.Redis client per connection pool (SharedClients).

    Django's builds a redis.Redis for every call (get, add, delete), and building one (its table of
    response callbacks, its event dispatcher) took longer than the call's round trip: 4% of a
    worker's CPU on a trivial job (py-spy), for the scheduling cycle's marks and the coalescing
    keys (jobs.dispatch). A client holds no connection of its own and is safe to share between
    threads: each command takes a connection from the pool and gives it back."""

    def __init__(self, server, params):
        super().__init__(server, params)
        self._class = SharedClients


class SharedClients(RedisCacheClient):
    _clients = weakref.WeakKeyDictionary()  # connection pool -> its redis.Redis
    _lock = threading.Lock()

    def get_client(self, key=None, *, write=False):
        pool = self._get_connection_pool(write)
        client = self._clients.get(pool)
        if client is None:
            with self._lock:
                client = self._clients.setdefault(pool, self._client(connection_pool=pool))
        return client


def keep_between_requests():
    """Stop Django closing every cache at the end of each request (its `close_caches` handler on
    request_finished), when no configured backend has anything to close (the Redis and local-memory
    backends do not: their close() is BaseCache's no-op, and the pool above outlives requests).
    Under daphne each request's thread looked every cache up in an asgiref Local to close nothing:
    7.6% of the web process's CPU on trivial jobs like bench frameworks' fixed_cost_s (py-spy), about
    8 ms a job in alternating runs. A backend with a close() of its own keeps the handler."""
    from django.core import signals
    from django.core.cache import caches, close_caches
    from django.core.cache.backends.base import BaseCache
    if all(type(caches.create_connection(alias)).close is BaseCache.close for alias in caches.settings):
        signals.request_finished.disconnect(close_caches)
