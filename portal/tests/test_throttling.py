"""Throttling of logins (django-axes, as tenants.throttling configures it), API-token failures and
ingest posts (tenants.throttling), through the real views and authentication, with each test's own cache."""
import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from tenants import throttling
from tests.support.builders import member, token_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    membership = member("team-a", "alice")
    membership.user.set_password("right-password")
    membership.user.save()
    return membership.user


def sign_in(password, *, username="alice", address="10.0.0.1", path="/login/"):
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password})


def test_it_locks_a_username_from_one_address_after_five_failures(alice):
    for _ in range(django_settings.AXES_FAILURE_LIMIT - 1):
        assert sign_in("wrong").status_code == 200
    assert sign_in("wrong").status_code == 429  # the failure that locks it says so
    locked = sign_in("right-password")
    assert locked.status_code == 429 and int(locked["Retry-After"]) > 14 * 60
    assert "Too many failed sign-ins" in locked.content.decode() and "15 minutes" in locked.content.decode()
    # The real user elsewhere, and other usernames from this address, are not locked out.
    assert sign_in("right-password", address="10.0.0.2").status_code == 302
    get_user_model().objects.create_user("bob", password="bobs-password")
    assert sign_in("bobs-password", username="bob").status_code == 302


def test_the_admin_console_sign_in_is_locked_too(alice):
    alice.is_staff = True
    alice.save()
    for _ in range(django_settings.AXES_FAILURE_LIMIT):
        sign_in("wrong", path="/admin/login/")
    refused = sign_in("right-password", path="/admin/login/")
    assert refused.status_code == 429 and "Too many failed sign-ins" in refused.content.decode()
    assert "_auth_user_id" not in refused.wsgi_request.session


def test_a_successful_sign_in_forgets_earlier_failures(alice):
    for _ in range(django_settings.AXES_FAILURE_LIMIT - 1):
        sign_in("wrong")
    assert sign_in("right-password").status_code == 302
    for _ in range(django_settings.AXES_FAILURE_LIMIT - 1):
        sign_in("wrong")
    assert sign_in("right-password").status_code == 302


def api(token, address):
    client = APIClient(REMOTE_ADDR=address)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client.get("/api/v1/jobs/")


def test_a_flood_of_bad_tokens_from_one_address_gets_429():
    good = token_for(member())
    for _ in range(throttling.TOKEN_FAILURES.limit):
        assert api("ty_guess", "10.0.0.1").status_code == 401
    refused = api(good, "10.0.0.1")  # refused before any key is looked up
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert "Too many failed token authentications" in refused.json()["detail"]
    assert api(good, "10.0.0.2").status_code == 200


def ingest(credential, address="10.0.0.1"):
    return Client(REMOTE_ADDR=address).post("/api/v1/ingest/j-none/", b"{}", content_type="application/json",
                                            HTTP_AUTHORIZATION=f"Ingest {credential}")


def test_bad_ingest_credentials_from_one_address_get_429(any_cache):
    for _ in range(throttling.INGEST_FAILURES.limit):
        assert ingest("forged").status_code in throttling.INGEST_REFUSED
    refused = ingest("forged")
    assert refused.status_code == 429 and int(refused["Retry-After"]) == throttling.INGEST_FAILURES.lockout_s
    assert ingest("forged", address="10.0.0.2").status_code in throttling.INGEST_REFUSED


@pytest.fixture(params=["in-memory", "redis"])
def any_cache(request, settings, tmp_path):
    """Each test's own cache: the unit tests' in-memory one, or a Redis server as the platform runs
    (its counters take one round trip; see throttling._count)."""
    if request.param == "in-memory":
        yield None
        return
    from tests.support.redis_server import RedisServer
    server = RedisServer(tmp_path).start()
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": server.url,
                                   "KEY_PREFIX": "trainyard"}}
    try:
        yield server
    finally:
        server.stop()


def test_a_counter_counts_within_its_window_and_then_starts_again(any_cache, monkeypatch):
    rule = throttling.Rule("probe", limit=3, window_s=1, lockout_s=1)
    assert [throttling.record(rule, "key") for _ in range(3)] == [0, 0, 1]
    assert throttling.retry_after(rule, "key") == 1
    if any_cache is not None:  # the counter carries the window's expiry, as the cache sets it
        from django.core.cache import cache, caches
        client = caches["default"]._cache.get_client(write=True)
        counter = cache.make_and_validate_key(throttling._key(rule, ("key",), "count"))
        assert 0 < client.pttl(counter) <= 1000 and cache.get(throttling._key(rule, ("key",), "count")) == 3
    import time
    time.sleep(1.1)
    assert throttling.record(rule, "key") == 0 and throttling.retry_after(rule, "key") == 0


def test_one_credential_posting_too_fast_gets_429(any_cache, monkeypatch):
    monkeypatch.setattr(throttling, "INGEST_POSTS", throttling.Rule("ingest", limit=3, window_s=10, lockout_s=10))
    monkeypatch.setattr(throttling, "INGEST_FAILURES", throttling.Rule("ingest-bad", limit=100, window_s=60,
                                                                       lockout_s=60))
    assert [ingest("one").status_code for _ in range(3)][:2] == [401, 401]
    assert ingest("one").status_code == 429
    assert ingest("another").status_code == 401


@pytest.mark.parametrize("any_cache", ["redis"], indirect=True)
def test_an_ingest_posts_checks_take_one_round_trip_to_redis(any_cache, monkeypatch):
    import redis
    trips = []

    def counted(method, original):
        return lambda self, *args, **kwargs: trips.append(method) or original(self, *args, **kwargs)
    for cls, method in ((redis.Redis, "execute_command"), (redis.client.Pipeline, "execute")):
        monkeypatch.setattr(cls, method, counted(method, getattr(cls, method)))
    assert throttling._ingest_refusal("10.0.0.1", "Ingest one") == 0
    assert trips == ["execute"]


def test_an_unreachable_cache_lets_requests_through(settings, alice):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": "redis://127.0.0.1:1/0"}}
    assert sign_in("right-password").status_code == 302


def test_a_tenants_submissions_are_counted_per_clock_minute(any_cache):
    minute = 29_000_000 * 60 + 20  # 20 s into a minute
    counts = [throttling.submission_retry_after(7, 3, now=minute) for _ in range(4)]
    assert counts == [0, 0, 0, 40]  # the fourth waits for the next minute
    assert throttling.submission_retry_after(8, 3, now=minute) == 0  # another tenant counts apart
    assert throttling.submission_retry_after(7, 3, now=minute + 40) == 0  # the next minute starts again


def test_a_minutes_submissions_cannot_arrive_in_one_burst(any_cache):
    second = 29_000_000 * 60 + 3  # 3 s into a ten-second window
    assert [throttling.submission_burst(n) for n in (3, 12, 60, 600)] == [3, 5, 10, 100]
    counts = [throttling.submission_retry_after(7, 60, now=second) for _ in range(11)]
    assert counts == [0] * 10 + [7]  # the eleventh waits for the next ten seconds
    assert throttling.submission_retry_after(7, 60, now=second + 7) == 0
