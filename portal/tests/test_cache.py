"""The cache's Redis connections are shared by every thread of a process (portal.cache)."""
import threading
import weakref

import redis
from django.core.cache.backends.redis import RedisCache

import portal.settings as platform_settings
from portal.tests.test_metrics import redis_url  # noqa: F401 - the fixture: an embedded Redis of the test's own


def test_a_cache_object_per_thread_shares_one_connection_to_redis(redis_url):  # noqa: F811
    """Django builds a cache object per thread and request context; under daphne each request's sync
    code runs in a thread of its own. Forty of them, one after another, as forty requests would."""
    options = platform_settings.CACHES["default"]["OPTIONS"]
    accepted = lambda: redis.Redis.from_url(redis_url).info("stats")["total_connections_received"]
    before = accepted()

    def request(n):
        cache = RedisCache(redis_url, {"OPTIONS": options})
        cache.add(f"count-{n % 3}", 0, timeout=60)
        cache.incr(f"count-{n % 3}")
        assert cache.get(f"count-{n % 3}") >= 1

    for n in range(40):
        thread = threading.Thread(target=request, args=(n,))
        thread.start()
        thread.join()
    # One for the shared pool, one for each `accepted()` call; a pool per cache object made 40.
    assert accepted() - before <= 3
    assert sum(RedisCache(redis_url, {"OPTIONS": options}).get(f"count-{i}") for i in range(3)) == 40


class ClosingCache(RedisCache):
    def close(self, **kwargs):
        pass  # a backend with something to close at the end of a request


def closes_caches_after_requests():
    from django.core import signals
    from django.core.cache import close_caches
    receivers = [ref() if isinstance(ref, weakref.ref) else ref for _, ref, _ in signals.request_finished.receivers]
    return close_caches in receivers


def test_caches_are_not_closed_after_each_request_when_no_backend_has_anything_to_close(settings):
    """The platform's backends (Redis, local memory) close nothing; Django's handler that closes
    them at every request's end cost a tenth of the web process's CPU under daphne."""
    from django.core import signals
    from django.core.cache import close_caches

    from portal import cache
    assert not closes_caches_after_requests()  # as the platform starts (PortalConfig.ready)
    try:
        signals.request_finished.connect(close_caches)
        settings.CACHES = {"default": {"BACKEND": "portal.tests.test_cache.ClosingCache", "LOCATION": "redis://x"}}
        cache.keep_between_requests()
        assert closes_caches_after_requests()  # a backend that closes something keeps it
        settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
        cache.keep_between_requests()
        assert not closes_caches_after_requests()
    finally:
        signals.request_finished.disconnect(close_caches)


def test_every_cache_object_of_a_process_calls_redis_through_one_client(redis_url):  # noqa: F811
    """Django's client built a redis.Redis per call; ours is built once per connection pool and
    shared by the threads, each command still taking a connection of the pool."""
    from portal.cache import RedisCache as PlatformRedisCache
    options = platform_settings.CACHES["default"]["OPTIONS"]
    caches = [PlatformRedisCache(redis_url, {"OPTIONS": options}) for _ in range(3)]
    clients = {id(cache._cache.get_client(write=write)) for cache in caches for write in (True, False)}
    assert len(clients) == 1
    failures = []

    def request(n):
        try:
            cache = caches[n % 3]
            cache.add("shared", 0, timeout=60)
            cache.incr("shared")
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=request, args=(n,)) for n in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and caches[0].get("shared") == 30
