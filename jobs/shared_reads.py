"""Reads any member may ask for as often as they like, computed once for every caller of a period:
the cluster's history, its capacity. Without the cache each caller computes, as without sharing."""
import logging
import time

from django.core.cache import cache

log = logging.getLogger(__name__)


def shared(name, seconds, compute):
    """compute(), as some caller of any process computed it in the current `seconds`-long period;
    `name` (a cache key: no spaces) names the read."""
    key = f"shared:{name}:{int(time.time() // seconds)}"
    try:
        found = cache.get(key)
    except Exception as exc:  # noqa: BLE001 - the cache is an economy: without it, compute
        log.warning("could not reach the cache for %s (%s)", name, exc)
        return compute()
    if found is None:
        found = compute()
        try:
            cache.set(key, found, timeout=max(1, int(seconds)))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not keep %s in the cache (%s)", name, exc)
    return found
