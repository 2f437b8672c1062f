"""Delivering the agent's records to the platform, each exactly once and in order.

The ingest protocol (DEVELOPERS.md) numbers records with `seq` from 1 without gaps; the platform
stores a batch only where it continues what it has, drops what it already has, and answers how far it
got (`acked`). So the agent can afford to be simple and stubborn: keep every record until it is
acked, always send from the oldest unacked one, and on any doubt (lost connection, lost response,
timeout, 5xx) send the same records again after a backoff. Resends are harmless; skipping is not.

One background thread does all network I/O over one keep-alive connection. While a request is in
flight, new records pile up and go out together in the next one, so batches grow with the load
without adding latency when it is quiet.
"""
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections import deque

log = logging.getLogger(__name__)

# Statuses that mean "this will never work": retrying would only hammer the platform.
_PERMANENT_FAILURES = {400: "malformed body", 401: "token not valid", 403: "forbidden",
                       404: "token not valid for this job"}


class Shipper:
    def __init__(self, ingest_url, token, *, attempt, learner, max_batch=20000,
                 max_batch_bytes=8 * 1024 * 1024, http_timeout=30, on_gone=None,
                 backoff_initial=0.1, backoff_max=5.0):
        url = urllib.parse.urlsplit(ingest_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"ingest_url must be an http(s) URL, not {ingest_url!r}")
        self._connection_class = (http.client.HTTPSConnection if url.scheme == "https"
                                  else http.client.HTTPConnection)
        self._host, self._port = url.hostname, url.port
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._headers = {"Authorization": f"Ingest {token}", "Content-Type": "application/json"}
        # Each record is encoded once, when added; a request body is the fixed head + joined records.
        self._body_head = (json.dumps({"attempt": attempt, "learner": learner})[:-1]
                           + ', "records": [').encode()
        self._max_batch = max_batch
        self._max_batch_bytes = max_batch_bytes
        self._http_timeout = http_timeout
        self._on_gone = on_gone
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max

        self._cond = threading.Condition()
        self._unacked = deque()  # (seq, encoded record), oldest first
        self._last_seq = 0
        self._acked = 0
        self._stopped = None  # why shipping stopped for good (410, 401, ...), or None
        self._closing = False
        self.gone = False  # the platform answered 410: this attempt is over

        self._conn = None
        self._conn_requests = 0
        self._thread = threading.Thread(target=self._run, name="shipper", daemon=True)
        self._thread.start()

    # --- called by the agent (any thread) ---

    def add(self, record):
        """Queue one record (a dict); returns its seq. `time` defaults to now."""
        return self.add_many([record])[0]

    def add_many(self, records):
        """Queue records with consecutive seqs, so a log line and the metrics found in it stay together."""
        now = time.time()
        encoded = []
        for record in records:
            record = {k: v for k, v in record.items() if k != "seq"}
            record.setdefault("time", now)
            # Encode before taking a seq: a record that can't be encoded must not leave a gap.
            encoded.append(json.dumps(record, separators=(",", ":"), allow_nan=False).encode())
        seqs = []
        with self._cond:
            for body in encoded:
                self._last_seq += 1
                # Splice the seq in as the first field: '{"kind":...}' → '{"seq":7,"kind":...}'.
                rest = b"}" if body == b"{}" else b"," + body[1:]
                self._unacked.append((self._last_seq, b'{"seq":%d' % self._last_seq + rest))
                seqs.append(self._last_seq)
            self._cond.notify_all()
        return seqs

    def flush(self, timeout=None):
        """Wait until everything added so far is acked; False on timeout or when shipping stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._acked < self._last_seq and self._stopped is None and not self._closing:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._acked >= self._last_seq

    def close(self, timeout=None):
        """Stop the sender. Records not yet acked are abandoned: call flush() first to deliver them."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout if timeout is not None else self._http_timeout + 1)

    @property
    def acked(self):
        return self._acked

    @property
    def last_seq(self):
        return self._last_seq

    @property
    def stopped_reason(self):
        """Why shipping stopped for good, or None while it is still trying."""
        return self._stopped

    # --- the sender thread ---

    def _run(self):
        backoff = self._backoff_initial
        failures = 0
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                try:
                    outcome, detail = self._send(batch)
                except Exception as e:  # a bug here must not silently end delivery
                    log.exception("unexpected error while shipping")
                    self._drop_connection()
                    outcome, detail = "retry", f"{type(e).__name__}: {e}"
                if outcome == "progress":
                    if failures:
                        log.info("ingest reachable again after %d failed attempts", failures)
                    backoff, failures = self._backoff_initial, 0
                    continue
                if outcome == "stop":
                    return
                # "retry": a keep-alive connection the server had quietly closed fails once for no
                # real reason, so the first failure on a reused connection retries at once.
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning("ingest attempt %d failed (%s); retrying with backoff", failures, detail)
                if failures == 1 and detail.startswith("reused:"):
                    continue
                with self._cond:
                    if not self._closing:
                        self._cond.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max)
        finally:
            self._drop_connection()

    def _next_batch(self):
        """The oldest unacked records, within the batch limits; None when it is time to stop."""
        with self._cond:
            while not self._unacked and not self._closing and self._stopped is None:
                self._cond.wait()
            if self._closing or self._stopped is not None:
                return None
            batch, size = [], 0
            for seq, body in self._unacked:
                if batch and (len(batch) >= self._max_batch or size + len(body) > self._max_batch_bytes):
                    break
                batch.append((seq, body))
                size += len(body) + 1
            return batch

    def _send(self, batch):
        """One request; returns ("progress" | "retry" | "stop", detail)."""
        body = self._body_head + b",".join(b for _, b in batch) + b"]}"
        reused = self._conn is not None and self._conn_requests > 0
        try:
            if self._conn is None:
                self._conn = self._connection_class(self._host, self._port, timeout=self._http_timeout)
                self._conn_requests = 0
            self._conn.request("POST", self._path, body=body, headers=self._headers)
            response = self._conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as e:
            self._drop_connection()
            return "retry", f"{'reused: ' if reused else ''}{type(e).__name__}: {e}"
        self._conn_requests += 1
        if response.will_close:
            self._drop_connection()
        status = response.status
        if status in (200, 409):
            acked = _acked_from(payload)
            if acked is None:
                return "retry", f"HTTP {status} without a valid 'acked'"
            return self._apply_ack(acked, status=status, first_sent=batch[0][0])
        if status == 410:
            self._stop("gone: the platform answered 410 (attempt is over)", gone=True)
            return "stop", "410"
        if status in _PERMANENT_FAILURES:
            text = payload[:300].decode("utf-8", "replace")
            self._stop(f"HTTP {status} ({_PERMANENT_FAILURES[status]}): {text}")
            return "stop", str(status)
        return "retry", f"HTTP {status}"

    def _apply_ack(self, acked, *, status, first_sent):
        with self._cond:
            if acked > self._last_seq:
                # Only possible if another agent used these seqs: ours at or below `acked` are dropped
                # by the platform. Nothing to resend can fix that; say so loudly.
                log.error("platform acked seq %d but only %d records exist here", acked, self._last_seq)
            if acked > self._acked:
                self._acked = acked
            while self._unacked and self._unacked[0][0] <= self._acked:
                self._unacked.popleft()
            self._cond.notify_all()
            next_unacked = self._unacked[0][0] if self._unacked else self._last_seq + 1
        if next_unacked > acked + 1:
            # The platform lost records it had acked; they are gone here too, so resending can't help.
            self._stop(f"platform reports acked={acked} but seqs up to {next_unacked - 1} were acked before")
            return "stop", "lost records"
        if status == 409 and first_sent == acked + 1:
            # "gap" although the batch starts right after what it has: it is confused; don't spin.
            return "retry", f"HTTP 409 acked={acked} for a batch starting at {first_sent}"
        return "progress", ""

    def _stop(self, reason, *, gone=False):
        with self._cond:
            self._stopped = reason
            self.gone = self.gone or gone
            self._cond.notify_all()
        if gone:
            log.warning("ingest: %s", reason)
            if self._on_gone is not None:
                self._on_gone()
        else:
            log.error("ingest stopped for good: %s", reason)

    def _drop_connection(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _acked_from(payload):
    try:
        acked = json.loads(payload)["acked"]
    except (ValueError, TypeError, KeyError):
        return None
    return acked if isinstance(acked, int) and not isinstance(acked, bool) and acked >= 0 else None
