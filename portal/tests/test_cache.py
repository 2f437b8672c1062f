"""The cache's Redis connections are shared by every thread of a process (portal.cache)."""
import threading
import weakref

import redis
from django.core.cache.backends.redis import RedisCache

import portal.settings as platform_settings


def test_a_cache_object_per_thread_shares_one_connection_to_redis(redis_url):
    """Django builds a cache object per thread and request context; under the ASGI server each request's sync
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
    them at every request's end cost a tenth of the web process's CPU."""
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
