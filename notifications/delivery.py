"""Sending one signed POST to a hook's URL over a connection made only to checked addresses.

Django-free. The signature is HMAC-SHA256 with the hook's secret over `<timestamp>.<body>` (the
timestamp as sent in TIMESTAMP_HEADER, the body byte for byte), hex, sent as `v1=<hex>` in
SIGNATURE_HEADER; a receiver recomputes it and refuses an old timestamp (replay). Redirects are not
followed: a 3xx is a failed delivery, so a hook cannot be bounced to an internal address.

A delivery has one deadline for all of it (connecting, sending, reading the answer), not a timeout
per read: a receiver that sent one byte a second held a worker as long as it liked, each byte
within the read timeout. The socket waits at most what is left of the deadline for each step, and
a watchdog shuts it down when the deadline passes, whatever the receiver is doing.
"""
import hashlib
import hmac
import http.client
import socket
import ssl
import threading
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
    """What a receiver does (also the example in docs/notifications.md): the signature matches and the time is recent."""
    fresh = abs((now or time.time()) - int(timestamp)) <= tolerance_s
    return fresh and hmac.compare_digest(sign(secret, timestamp, body), signature)


class _CheckedConnection(http.client.HTTPConnection):
    """http.client's connection, its socket made by jobs.egress.connect (checked addresses only),
    within `deadline` (time.monotonic())."""

    def __init__(self, host, port, *, policy, deadline, tls):
        super().__init__(host, port, timeout=_left(deadline))
        self._policy, self._tls, self._deadline = policy, tls, deadline

    def connect(self):
        sock = egress.connect(self.host, self.port, self._policy, timeout=_left(self._deadline))
        if self._tls:
            sock.settimeout(_left(self._deadline))
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        sock.settimeout(_left(self._deadline))  # no step waits past the deadline; the watchdog ends the rest
        self.sock = sock


def _left(deadline):
    return max(0.01, deadline - time.monotonic())


class _Watchdog:
    """Shuts the connection's socket down when the deadline passes: a blocked send or read then
    returns at once, however the receiver paces its bytes. `fired` says whether it did."""

    def __init__(self, connection, deadline):
        self.fired = False
        self._connection = connection
        self._lock = threading.Lock()
        self._timer = threading.Timer(_left(deadline), self._fire)
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        with self._lock:  # a firing in progress finishes before the caller closes the socket
            self._connection = None

    def _fire(self):
        with self._lock:
            if self._connection is None:
                return  # the delivery ended
            sock = self._connection.sock
            if sock is None:  # still connecting (its timeout is what was left): look again shortly
                self._timer = threading.Timer(0.05, self._fire)
                self._timer.daemon = True
                self._timer.start()
                return
            self.fired = True
            try:
                # socket.socket's own shutdown, also for a TLS socket: it only wakes the reader and
                # leaves the TLS state to the thread using it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass


def post(url, body, headers, *, secret, policy, timeout_s):
    """POST `body` signed; returns the HTTP status (2xx), DeliveryFailed otherwise. The whole delivery
    (connecting, sending, the answer) takes at most `timeout_s`, however slowly the receiver answers."""
    deadline = time.monotonic() + timeout_s
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    timestamp = str(int(time.time()))
    headers = {**headers, "Content-Type": "application/json", "User-Agent": "Trainyard-Webhook/1",
               TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: sign(secret, timestamp, body)}
    connection = _CheckedConnection(parts.hostname, parts.port or (443 if tls else 80),
                                    policy=policy, deadline=deadline, tls=tls)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    watchdog = _Watchdog(connection, deadline)
    try:
        with watchdog:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read(MAX_ERROR_BODY)
    except egress.EndpointRefused:
        raise DeliveryFailed("the receiver cannot be reached (not allowed, does not resolve, refused or no answer)")
    except (OSError, http.client.HTTPException) as exc:
        if watchdog.fired or time.monotonic() >= deadline:
            raise DeliveryFailed(f"timed out: the receiver did not answer within {timeout_s:g}s in all") from None
        raise DeliveryFailed(f"{type(exc).__name__}: {exc}"[:300]) from None
    finally:
        connection.close()
    if not 200 <= response.status < 300:
        said = "".join(c if c.isprintable() else "?" for c in answer.decode("utf-8", "replace")[:200])
        raise DeliveryFailed(f"the receiver answered HTTP {response.status}: {said}", status=response.status)
    return response.status
