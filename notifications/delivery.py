"""Sending one signed POST to a hook's URL over a connection made only to checked addresses.

Django-free. The signature is HMAC-SHA256 with the hook's secret over `<timestamp>.<body>` (the
timestamp as sent in TIMESTAMP_HEADER, the body byte for byte), hex, sent as `v1=<hex>` in
SIGNATURE_HEADER; a receiver recomputes it and refuses an old timestamp (replay). Redirects are not
followed: a 3xx is a failed delivery, so a hook cannot be bounced to an internal address.
"""
import hashlib
import hmac
import http.client
import ssl
import time
from urllib.parse import urlsplit

from jobs import egress

TIMESTAMP_HEADER = "X-Trainyard-Timestamp"
SIGNATURE_HEADER = "X-Trainyard-Signature"
DELIVERY_HEADER = "X-Trainyard-Delivery"
EVENT_HEADER = "X-Trainyard-Event"
MAX_ERROR_BODY = 300


class DeliveryFailed(Exception):
    """The receiver could not be reached or did not answer 2xx; the message says which, briefly."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def sign(secret, timestamp, body):
    return "v1=" + hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret, timestamp, body, signature, *, now=None, tolerance_s=300):
    """What a receiver does (also the README's example): the signature matches and the time is recent."""
    fresh = abs((now or time.time()) - int(timestamp)) <= tolerance_s
    return fresh and hmac.compare_digest(sign(secret, timestamp, body), signature)


class _CheckedConnection(http.client.HTTPConnection):
    """http.client's connection, its socket made by jobs.egress.connect (checked addresses only)."""

    def __init__(self, host, port, *, policy, timeout, tls):
        super().__init__(host, port, timeout=timeout)
        self._policy, self._tls = policy, tls

    def connect(self):
        sock = egress.connect(self.host, self.port, self._policy, timeout=self.timeout)
        if self._tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.sock = sock


def post(url, body, headers, *, secret, policy, timeout_s):
    """POST `body` signed; returns the HTTP status (2xx), DeliveryFailed otherwise. `timeout_s`
    bounds the connection and every read, so a slow receiver holds a worker that long at most."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    timestamp = str(int(time.time()))
    headers = {**headers, "Content-Type": "application/json", "User-Agent": "Trainyard-Webhook/1",
               TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: sign(secret, timestamp, body)}
    connection = _CheckedConnection(parts.hostname, parts.port or (443 if tls else 80),
                                    policy=policy, timeout=timeout_s, tls=tls)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        answer = response.read(MAX_ERROR_BODY)
    except egress.EndpointRefused:
        raise DeliveryFailed("the receiver cannot be reached (not allowed, does not resolve, refused or no answer)")
    except (OSError, http.client.HTTPException) as exc:
        raise DeliveryFailed(f"{type(exc).__name__}: {exc}"[:300]) from None
    finally:
        connection.close()
    if not 200 <= response.status < 300:
        raise DeliveryFailed(f"the receiver answered HTTP {response.status}: "
                             f"{answer.decode('utf-8', 'replace')[:200]}", status=response.status)
    return response.status
