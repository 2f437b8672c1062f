"""Which hosts Trainyard answers as, and which page origins may open its websockets.

Both come from the address the platform is reached at (TRAINYARD_PUBLIC_URL), so a request for a
name the operator never gave (DNS rebinding, a forged Host in a password-reset link) gets a 400,
and a page of another site cannot open a websocket on a visitor's session. Always allowed:
loopback names (`make demo`, the tests, `docker compose` on localhost) and the Kubernetes backend's
in-cluster ingest address; anything else is listed in TRAINYARD_ALLOWED_HOSTS.
"""
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def allowed_hosts(public_url, *, extra="", service_urls=()):
    """ALLOWED_HOSTS: the public URL's host, loopback, the hosts of `service_urls` (in-cluster
    addresses agents post to) and the comma-separated `extra` names (Django host patterns)."""
    hosts = [_host(public_url), *LOOPBACK_HOSTS, *(_host(url) for url in service_urls if url)]
    hosts += [name.strip() for name in extra.split(",") if name.strip()]
    return list(dict.fromkeys(hosts))


def trusted_origins(public_url, *, extra=""):
    """CSRF_TRUSTED_ORIGINS: the public URL's origin (what a TLS-terminating proxy in front
    presents) and the comma-separated `extra` origins."""
    parts = urlsplit(public_url)
    origins = [f"{parts.scheme}://{parts.netloc}"]
    origins += [origin.strip().rstrip("/") for origin in extra.split(",") if origin.strip()]
    return list(dict.fromkeys(origins))


def _host(url):
    hostname = urlsplit(url).hostname or ""
    return f"[{hostname}]" if ":" in hostname else hostname


def origin_allowed(origin, host, *, allowed, trusted):
    """May a websocket with this Origin (None: not a browser) be opened on this Host?

    The Host must be one we answer as. A browser always sends Origin, so a page may open a socket
    only on its own host (same scheme-less host and port, as the portal's pages do) or from a
    trusted origin; a client without Origin (the CLI, scripts) authenticates with a token anyway.
    """
    from django.http.request import split_domain_port, validate_host
    domain, _ = split_domain_port(host or "")
    if not domain or not validate_host(domain, allowed):
        return False
    if origin is None:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    return parts.netloc.lower() == host.lower() or f"{parts.scheme}://{parts.netloc}".lower() in (
        t.lower() for t in trusted)


class WebsocketOriginValidator:
    """ASGI middleware: refuses (HTTP 403 at the handshake) a websocket whose Host or Origin
    `origin_allowed` refuses. (Channels' own validator refuses clients without Origin, the CLI's.)"""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        from channels.security.websocket import WebsocketDenier
        from django.conf import settings
        headers = dict(scope.get("headers", []))
        origin = headers.get(b"origin")
        host = headers.get(b"host", b"").decode("latin1")
        if origin_allowed(origin.decode("latin1") if origin is not None else None, host,
                          allowed=settings.ALLOWED_HOSTS, trusted=settings.CSRF_TRUSTED_ORIGINS):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
