"""Hosts and websocket origins derived from the public URL (portal.hosts)."""
import pytest
from asgiref.sync import async_to_sync

from portal import hosts

K8S = "http://trainyard-web.trainyard.svc:8000"


def test_it_allows_the_public_host_loopback_and_the_in_cluster_ingest_host():
    allowed = hosts.allowed_hosts("https://trainyard.example.com", extra=" a.example.org, .lab.internal ",
                                  service_urls=[K8S, ""])
    assert allowed == ["trainyard.example.com", "127.0.0.1", "localhost", "[::1]", "trainyard-web.trainyard.svc",
                       "a.example.org", ".lab.internal"]
    assert "*" not in hosts.allowed_hosts("http://127.0.0.1:8000")


def test_it_trusts_the_public_origin_and_the_extras():
    assert hosts.trusted_origins("https://trainyard.example.com/", extra="https://b.example.org/") == [
        "https://trainyard.example.com", "https://b.example.org"]


ALLOWED = hosts.allowed_hosts("https://trainyard.example.com")
TRUSTED = hosts.trusted_origins("https://trainyard.example.com")


@pytest.mark.parametrize("origin, host, ok", [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", True),  # the demo's own pages
    ("http://localhost:8000", "localhost:8000", True),
    ("https://trainyard.example.com", "trainyard.example.com", True),
    ("https://trainyard.example.com", "127.0.0.1:8000", True),  # behind a proxy that rewrites Host
    (None, "127.0.0.1:8000", True),  # the CLI and scripts send no Origin
    ("http://evil.example", "127.0.0.1:8000", False),
    ("http://localhost:9999", "127.0.0.1:8000", False),  # another local site
    ("null", "127.0.0.1:8000", False),  # a sandboxed iframe or a file:// page
    ("http://evil.example", "evil.example", False),  # DNS rebinding: a Host we never answer as
    (None, "evil.example", False),
    (None, "", False),
])
def test_it_decides_which_websocket_origins_may_connect(origin, host, ok):
    assert hosts.origin_allowed(origin, host, allowed=ALLOWED, trusted=TRUSTED) is ok


@pytest.mark.django_db
@pytest.mark.parametrize("origin, accepted", [(b"http://testserver", True), (b"http://evil.example", False)])
def test_the_asgi_application_refuses_a_foreign_origin_at_the_handshake(origin, accepted, settings):
    from portal.asgi import application
    from tests.support.websockets import Communicator
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

    @async_to_sync
    async def connect():
        communicator = Communicator(application, "/ws/jobs/", headers=[(b"host", b"testserver"), (b"origin", origin)])
        connected, _ = await communicator.connect()
        await communicator.disconnect()
        return connected
    # Accepted means it reached the consumer, which then refuses an anonymous caller with 4401.
    assert connect() is accepted


@pytest.mark.parametrize("public_url, secure", [("https://trainyard.example.org", True), ("http://127.0.0.1:8000", False)])
def test_an_https_public_url_keeps_the_session_and_csrf_cookies_to_https(public_url, secure, tmp_path):
    import os
    import subprocess
    import sys
    code = ("import django; django.setup(); from django.conf import settings; "
            "print(settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE)")
    env = {**os.environ, "TRAINYARD_PUBLIC_URL": public_url, "TRAINYARD_DATA_DIR": str(tmp_path),
           "DJANGO_SETTINGS_MODULE": "portal.settings"}
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert shown.split() == [str(secure)] * 2
