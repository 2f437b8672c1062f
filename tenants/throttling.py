"""Limits on what a stranger can repeat: password logins, API-token failures and ingest posts.

Counters live in the shared cache (Redis, `CACHES`), so every web process counts the same attempts,
in fixed windows; a key over its rule's limit is refused for the rule's lockout, with 429 and
Retry-After. The client address is REMOTE_ADDR: behind a reverse proxy every client shares the
proxy's address, so an operator who puts one in front should have it limit too.

- Logins (the portal's and the admin console's), through django-axes: 5 failures for one username
  from one address, each within 15 minutes of the one before, lock that pair for 15 minutes, with a
  message saying so. Wrong passwords elsewhere cannot lock the real user out from their own address.
- API tokens: 30 failed token authentications from one address in a minute refuse that address's
  token attempts for a minute.
- Ingest: one learner credential may post 600 batches per 10 s (then waits out the 10 s) (agents keep one batch in flight,
  so only a runaway one comes near); 20 posts with a bad credential from one address in a minute
  refuse that address's posts for a minute.
- Single sign-on's device flow (the CLI's `login --sso`): one address may start 10 sign-ins and poll
  60 times a minute, each a call to the identity provider.
- Submissions: a tenant may submit its intake's submissions per minute (tenants.quotas.intake_of;
  TRAINYARD_SUBMITS_PER_MINUTE by default), counted per tenant in fixed windows of the clock's
  minutes; past it, submits are refused until the next minute begins (jobs.submission).
- Heavy work at once: a tenant may have 2 comparisons of jobs (jobs.compare, which reads every point
  of the lines it draws) running at a time, a third is refused with 429 until one ends, and one
  computation of the cluster's history of use (jobs.node_use, over every tenant's samples); one webhook
  delivery (notifications.services) and one download of training data (jobs.transfers) at a time, the
  rest waiting their turn.

If the cache cannot be reached, requests are let through (and a warning logged): an outage of Redis
must not lock every user out of a platform that is otherwise up.
"""
import contextlib
import functools
import hashlib
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass

import redis
from axes.backends import AxesStandaloneBackend
from axes.handlers.cache import AxesCacheHandler
from axes.helpers import get_cache as axes_cache
from django.conf import settings
from django.contrib.auth.backends import ModelBackend
from django.core.cache import cache, caches
from django.core.cache.backends.redis import RedisCache, RedisSerializer
from django.http import JsonResponse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    name: str
    limit: int  # events in one window that lock the key
    window_s: int
    lockout_s: int  # how long a key stays refused once it went over the limit


TOKEN_FAILURES = Rule("token", limit=30, window_s=60, lockout_s=60)
INGEST_POSTS = Rule("ingest", limit=600, window_s=10, lockout_s=10)
INGEST_FAILURES = Rule("ingest-bad", limit=20, window_s=60, lockout_s=60)


@dataclass(frozen=True)
class AtOnce:
    name: str
    limit: int  # requests of one key running at the same time
    hold_s: int  # the longest a request holds its slot: one whose process died frees it then
    renewed: bool = False  # the slot is kept while its block runs, however long: hold_s is then how
    # soon a slot whose process died is free again
    busy: str = ""  # what a refusal (Busy) says takes every slot, after their number

# A comparison runs statements per line of each job, each allowed TRAINYARD_WEB_STATEMENT_TIMEOUT_S: it may
# outlast any fixed hold, so its slot is kept while it runs.
COMPARISONS = AtOnce("compare", limit=2, hold_s=120, renewed=True, busy="comparisons of this tenant are running")
CLUSTER_HISTORY = AtOnce("cluster-use", limit=1, hold_s=120,  # jobs.node_use: every tenant's samples
                         busy="request(s) of this tenant for the cluster's history are being answered")
USAGE_REPORTS = AtOnce("usage", limit=2, hold_s=120,  # jobs.usage: a period's samples, summed by the database
                       busy="usage reports of this tenant are being prepared")
EXPERIMENT_READS = AtOnce("experiment-read", limit=2, hold_s=60,  # jobs.experiment_api: every trial of a large one
                          busy="reads of every trial of this tenant's large experiments are being answered")


class Busy(Exception):
    """Every slot of a rule is taken (held()): the API answers 429 with Retry-After (portal.api), and
    a page the same (portal.views)."""

    retry_after_s = 3

    def __init__(self, rule):
        super().__init__(f"{rule.limit} {rule.busy}; try again in a few seconds")


@contextlib.contextmanager
def held(rule, *parts):
    """One of the rule's slots of `parts` for the block (slot()); Busy when every one is taken."""
    with slot(rule, *parts) as free:
        if not free:
            raise Busy(rule)
        yield


@contextlib.contextmanager
def slot(rule, *parts):
    """One of `rule.limit` slots of `parts` for the block; yields False when every one is taken. A slot
    holds a token of its own: a request that outran `hold_s` frees only a slot it still holds."""
    held, token = None, secrets.token_hex(8)
    try:
        held = next((key for key in (_key(rule, (*parts, index), "slot") for index in range(rule.limit))
                     if cache.add(key, token, timeout=rule.hold_s)), None)
    except Exception as exc:  # noqa: BLE001 - fail open
        log.warning("throttling: cache unreachable (%s); %s not limited", exc, rule.name)
        held = ""
    renewal = _Renewal(held, token, rule.hold_s) if held and rule.renewed else contextlib.nullcontext()
    try:
        with renewal:
            yield held is not None
    finally:
        if held:
            with contextlib.suppress(Exception):
                if cache.get(held) == token:
                    cache.delete(held)


class _Renewal:
    """Keeps a held slot from expiring while its block runs (a thread touching it every third of its
    hold), so a long block keeps it and a dead process frees it within hold_s."""

    def __init__(self, key, token, hold_s):
        self.key, self.token, self.hold_s = key, token, hold_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._renew, name=f"renew {key}", daemon=True)

    def __enter__(self):
        self.thread.start()

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def _renew(self):
        while not self.done.wait(self.hold_s / 3):
            try:
                if cache.get(self.key) != self.token:
                    return  # outran its hold after all: the slot is someone else's now
                cache.touch(self.key, self.hold_s)
            except Exception as exc:  # noqa: BLE001 - the slot then expires as if its process died
                log.warning("throttling: could not keep %s (%s)", self.key, exc)


def _key(rule, parts, kind):
    digest = hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:32]
    return f"throttle:{rule.name}:{kind}:{digest}"


def retry_after(rule, *parts):
    """Seconds until `parts` may try again under `rule`; 0 when it may now."""
    try:
        until = cache.get(_key(rule, parts, "lock"))
    except Exception as exc:  # noqa: BLE001 - see the module docstring: fail open
        log.warning("throttling: cache unreachable (%s); %s not checked", exc, rule.name)
        return 0
    return _seconds_until(until)


def _seconds_until(until):
    """Whole seconds left of a lock that lasts `until` (Unix time; None: no lock)."""
    return max(0, math.ceil(until - time.time())) if until else 0


def record(rule, *parts):
    """Count one event; once over the limit, lock the key. Returns retry_after() afterwards."""
    try:
        count = _count(_key(rule, parts, "count"), rule.window_s)
        if count >= rule.limit:
            return _lock_out(rule, parts)
    except Exception as exc:  # noqa: BLE001 - fail open
        log.warning("throttling: cache unreachable (%s); %s not counted", exc, rule.name)
    return 0


def _lock_out(rule, parts):
    """Refuse `parts` for the rule's lockout; returns its length in seconds."""
    cache.set(_key(rule, parts, "lock"), time.time() + rule.lockout_s, timeout=rule.lockout_s)
    return rule.lockout_s


def _count(counter, window_s):
    """Add one to `counter`, which starts at 0 for `window_s` seconds; the count so far.

    On Redis, one round trip (MULTI: SET NX with the window's expiry, INCR): every ingest post counts
    its credential, and the cache's add and incr took three (incr asks whether the key exists first).
    """
    client = _redis()
    if client is None:  # another cache backend (the unit tests' in-memory one)
        cache.add(counter, 0, timeout=window_s)
        try:
            return cache.incr(counter)
        except ValueError:  # the window ended between add and incr
            cache.set(counter, 1, timeout=window_s)
            return 1
    with client.pipeline(transaction=True) as pipe:  # atomic: an INCR never outlives its window
        _add_count(pipe, counter, window_s)
        return pipe.execute()[1]


def _add_count(pipe, counter, window_s):
    """_count's two commands (SET NX with the window's expiry, INCR), added to a Redis pipeline."""
    key = cache.make_and_validate_key(counter)
    pipe.set(key, 0, ex=window_s, nx=True)
    pipe.incr(key)


def _redis():
    """A Redis client on the default cache's server (the one it writes to), or None if the cache is not
    Django's Redis backend. Counters are stored as that backend stores integers (plain, not pickled),
    so its get and incr read them."""
    if not isinstance(caches["default"], RedisCache):
        return None
    location = settings.CACHES["default"]["LOCATION"]
    return _client((location.split(",") if isinstance(location, str) else location)[0])


@functools.cache
def _client(url):
    # Short timeouts, as the cache's: a Redis that hangs must not hang every login and ingest post.
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)


def client_address(request):
    return request.META.get("REMOTE_ADDR", "") if request is not None else ""


def too_many(retry_s, detail):
    response = JsonResponse({"detail": detail}, status=429)
    response["Retry-After"] = str(retry_s)
    return response


# --- logins ------------------------------------------------------------------------------------------
# django-axes counts failed password sign-ins (portal and admin console) per username and address and
# refuses a locked pair before any password is checked; settings.py's AXES_* set its limits and name
# these pieces.


class LoginLockout(AxesStandaloneBackend):
    """axes's check, for password sign-ins only: without a request (manage.py, a test client's login)
    there is no address to count, and single sign-on (no username) is the provider's to limit."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None or username is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


class LocalPasswordBackend(ModelBackend):
    """Django's username/password backend, while local sign-in is on (TRAINYARD_LOCAL_LOGIN)."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if not settings.LOCAL_LOGIN:  # single sign-on only (tenants.sso)
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


class LoginFailures(AxesCacheHandler):
    """axes's cache handler, on the cache as it is configured at each use, and failing open: an
    outage of Redis must not lock every user out (see the module docstring)."""

    def __init__(self):  # the cache is looked up at each use, not kept (see `cache`)
        pass

    @property
    def cache(self):
        return axes_cache()

    def get_failures(self, request, credentials=None):
        try:
            return super().get_failures(request, credentials)
        except Exception as exc:  # noqa: BLE001 - fail open
            log.warning("throttling: cache unreachable (%s); login not checked", exc)
            return 0

    def user_login_failed(self, sender, credentials, request=None, **kwargs):
        try:
            super().user_login_failed(sender, credentials, request, **kwargs)
        except Exception as exc:  # noqa: BLE001 - fail open
            log.warning("throttling: cache unreachable (%s); failed login not counted", exc)

    def user_logged_in(self, sender, request, user, **kwargs):
        try:
            super().user_logged_in(sender, request, user, **kwargs)
        except Exception as exc:  # noqa: BLE001 - fail open
            log.warning("throttling: cache unreachable (%s); login failures not reset", exc)


def login_username(request, credentials):
    """The username axes counts under: as typed, without case or surrounding spaces."""
    name = (credentials or {}).get("username") if credentials else request.POST.get("username")
    return str(name or "").strip().lower() or None


def not_a_password_login(request, credentials):
    """What axes leaves alone: a sign-in without a username (single sign-on's callback)."""
    return login_username(request, credentials) is None


def lockout_message(retry_s):
    minutes = max(1, math.ceil(retry_s / 60))
    return (f"Too many failed sign-ins for this username from your address. Try again in {minutes} "
            f"minute{'s' if minutes != 1 else ''}.")


# --- API tokens ----------------------------------------------------------------------------------------
def token_retry_after(request):
    return retry_after(TOKEN_FAILURES, client_address(request))


def token_failed(request):
    record(TOKEN_FAILURES, client_address(request))


# --- single sign-on's device flow ---------------------------------------------------------------------------
# Anyone may start a CLI's sign-in or poll for its token, and each is a call to the identity provider
# made in the request: an address may start DEVICE_STARTS.limit and poll DEVICE_POLLS.limit times a
# minute (the CLI polls every 5 s), so nobody can hold the web process or spend the platform's
# standing with the provider.
DEVICE_STARTS = Rule("sso-device", limit=10, window_s=60, lockout_s=60)
DEVICE_POLLS = Rule("sso-poll", limit=60, window_s=60, lockout_s=60)


def device_flow_refusal(request, rule):
    """A 429 when the request's address is over `rule` (this request counted), else None."""
    address = client_address(request)
    retry_s = retry_after(rule, address) or record(rule, address)
    if not retry_s:
        return None
    return too_many(retry_s, f"Too many single sign-on requests from this address; try again in {retry_s} s.")


# --- submissions ---------------------------------------------------------------------------------------
SUBMIT_WINDOW_S = 60
# A minute's allowance may not arrive at once: within any clock-aligned BURST_WINDOW_S, at most its
# share of it (a sixth), though never fewer than MIN_BURST (or the whole minute's, if smaller).
# Submissions are served one after another by a web process's request thread, so a tenant sending its
# whole minute in one burst would hold that thread from every other tenant's requests meanwhile.
BURST_WINDOW_S = 10
MIN_BURST = 5


def submission_burst(per_minute):
    return max(min(per_minute, MIN_BURST), math.ceil(per_minute * BURST_WINDOW_S / SUBMIT_WINDOW_S))


def submission_retry_after(tenant_id, per_minute, now=None):
    """Count one submission of the tenant in this minute and in this ten seconds; 0 while it is
    within `per_minute` and its burst (submission_burst), else the seconds until the window it is
    over ends (when it may submit again). Every attempt counts, refused ones too: what an attempt
    costs (reading its upload, checking its archive) is what is limited."""
    now = time.time() if now is None else now
    waits = []
    for window_s, limit in ((BURST_WINDOW_S, submission_burst(per_minute)), (SUBMIT_WINDOW_S, per_minute)):
        window = int(now // window_s)
        try:
            count = _count(_key(Rule("submit", limit, window_s, 0), (tenant_id, window_s, window), "count"),
                           window_s)
        except Exception as exc:  # noqa: BLE001 - fail open
            log.warning("throttling: cache unreachable (%s); submissions not counted", exc)
            return 0
        if count > limit:
            waits.append(max(1, math.ceil((window + 1) * window_s - now)))
    return max(waits, default=0)


# --- ingest --------------------------------------------------------------------------------------------
INGEST_REFUSED = {401, 403, 404}  # a credential not valid for this job


def throttle_ingest(view):
    """Around the ingest view: refuse an address that keeps posting bad credentials, and a credential
    posting far faster than an agent does, before anything else is looked at."""
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        address = client_address(request)
        retry_s = _ingest_refusal(address, request.headers.get("Authorization", ""))
        if retry_s:
            return too_many(retry_s, f"too many ingest requests; retry in {retry_s}s")
        response = view(request, *args, **kwargs)
        if response.status_code in INGEST_REFUSED:
            record(INGEST_FAILURES, address)
        return response
    return wrapper


def _ingest_refusal(address, credential):
    """retry_after(INGEST_FAILURES, address) or record(INGEST_POSTS, credential), in one round trip
    to Redis instead of two (every post pays it, and under load the cores are saturated). Unlike the two calls, a post from a refused address is still counted against its
    credential; it is refused either way."""
    client = _redis()
    if client is None:
        return retry_after(INGEST_FAILURES, address) or record(INGEST_POSTS, credential)
    try:
        with client.pipeline(transaction=True) as pipe:  # as _count: an INCR never outlives its window
            pipe.get(cache.make_and_validate_key(_key(INGEST_FAILURES, (address,), "lock")))
            _add_count(pipe, _key(INGEST_POSTS, (credential,), "count"), INGEST_POSTS.window_s)
            until, _, count = pipe.execute()
        # The lock as cache.set stored it, read straight from Redis: decoded in that backend's format.
        retry_s = _seconds_until(None if until is None else RedisSerializer().loads(until))
        if retry_s:
            return retry_s
        if count >= INGEST_POSTS.limit:
            return _lock_out(INGEST_POSTS, (credential,))
    except Exception as exc:  # noqa: BLE001 - fail open
        log.warning("throttling: cache unreachable (%s); ingest not checked", exc)
    return 0
