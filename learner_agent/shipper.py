"""Delivering the agent's records to the platform, each exactly once and in order.

The ingest protocol (DEVELOPERS.md) numbers records with `seq` from 1 without gaps; the platform
stores a batch only where it continues what it has, drops what it already has, and answers how far it
got (`acked`). So the agent can afford to be simple and stubborn: keep every record until it is
acked, always send from the oldest unacked one, and on any doubt (lost connection, lost response,
timeout, 5xx) send the same records again after a backoff. Resends are harmless; skipping is not.

Every record goes to the spool (learner_agent.spool) when it is added, and batches are read back
from it, so what the platform has not acked outlives the agent: a restarted agent continues from
the spool and its numbering. Memory holds one batch, whatever the backlog.

The platform may move while the agent runs (started again on another address): `current_url`, when
given, says where it is now (learner_agent.address), and is asked whenever a connection is opened
(at the start, after a dropped connection) and after any failed post, before giving up on a refusal
too (the old address may now be someone else's): a moved platform gets the records where it is now.

One background thread does all network I/O over one keep-alive connection. While a request is in
flight, new records pile up and go out together in the next one, so batches grow with the load
without adding latency when it is quiet.

A full spool (the platform has acked nothing for a long while) holds the learner's output back:
`wait_for_room` blocks the reader of its pipe, so the learner blocks on its next write until the
platform catches up. It could instead drop the oldest unsent lines, but they are numbered already
(the platform needs gap-free seqs, so dropping would mean rewriting an append-only file), and a
paused learner loses nothing it cannot finish later while a dropped line is gone for good. Status
records are never held back, and two `system` log lines say when the spool filled and when it was
below half full again.

A disk that refuses the spool's writes (full) is waited out the same way: the records stay in
memory (a bounded amount: Spool.has_room), the flusher and the sender retry with backoff, what the
file already holds is still sent, and two `system` lines say when writing failed and when it worked
again. Nothing is dropped and no seq is skipped or reused.
"""
import contextlib
import json
import logging
import os
import threading
import time
import urllib.parse

from learner_agent.sizes import format_bytes
from learner_agent.spool import MAX_UNWRITTEN_BYTES

log = logging.getLogger(__name__)

# Statuses that mean "this will never work": retrying would only hammer the platform.
_PERMANENT_FAILURES = {400: "malformed body", 401: "token not valid", 403: "forbidden",
                       404: "token not valid for this job"}
HTTP_TIMEOUT_S = 30
FLUSH_INTERVAL_S = 0.05  # the longest an added record waits in memory before the kernel has it
SYNC_INTERVAL_S = 1.0  # the longest it waits before it is on the disk itself


class Shipper:
    def __init__(self, ingest_url, token, *, attempt, learner, spool, max_batch=20000,
                 max_batch_bytes=8 * 1024 * 1024, on_gone=None,
                 backoff_initial=0.1, backoff_max=5.0, current_url=None, on_answer=None):
        self._url = None
        self._aim(ingest_url)
        self._current_url = current_url
        self._headers = {"Authorization": f"Ingest {token}", "Content-Type": "application/json"}
        # Each record is encoded once, when added; a request body is the fixed head + joined records.
        self._body_head = (json.dumps({"attempt": attempt, "learner": learner})[:-1]
                           + ', "records": [').encode()
        self._max_batch = max_batch
        self._max_batch_bytes = max_batch_bytes
        self._on_gone = on_gone
        self._on_answer = on_answer  # called with each 200 answer's JSON object (the agent's batch changes)
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max

        self._cond = threading.Condition()
        self._spool = spool  # every record not yet acked, and maybe some acked ones
        self._last_seq = spool.last_seq  # a restarted agent continues the numbering
        self._acked = spool.acked
        self._full_since = None  # monotonic time the spool filled up, while it is full
        self._stopped = None  # why shipping stopped for good (410, 401, ...), or None
        self._closing = False
        self.gone = False  # the platform answered 410: this attempt is over

        self._conn = None
        self._conn_requests = 0
        self._closed = threading.Event()
        # Records were spooled since the flusher last looked. An event of its own, not the condition
        # every add notifies: woken per record, the flusher would write per record.
        self._added = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shipper", daemon=True)
        self._thread.start()
        self._flusher = threading.Thread(target=self._flush_spool_periodically, name="spool-flush",
                                         daemon=True)
        self._flusher.start()

    # --- called by the agent (any thread) ---

    def add(self, record):
        """Queue one record (a dict); returns its seq. `time` defaults to now."""
        return self.add_many([record])[0]

    def add_many(self, records, *, spool_now=False):
        """Queue records with consecutive seqs, so a log line and the metrics found in it stay together.

        `spool_now`: hand them to the kernel before returning, for a caller that records how far it
        has read a file once they are safe (learner_agent.tfevents)."""
        now = time.time()
        encoded = []
        for record in records:
            record = {k: v for k, v in record.items() if k != "seq"}
            record.setdefault("time", now)
            # Encode before taking a seq: a record that can't be encoded must not leave a gap.
            encoded.append(json.dumps(record, separators=(",", ":"), allow_nan=False).encode())
        with self._cond:
            seqs = self._append(encoded)
            if spool_now and self._stopped is None:
                self._spool.flush()
            return seqs

    def _append(self, encoded):
        """Number encoded records and spool them (the lock held); returns their seqs."""
        numbered, seq = [], self._last_seq
        for body in encoded:
            seq += 1
            # Splice the seq in as the first field: '{"kind":...}' → '{"seq":7,"kind":...}'.
            rest = b"}" if body == b"{}" else b"," + body[1:]
            numbered.append((seq, b'{"seq":%d' % seq + rest))
        if self._stopped is None:
            self._spool.append(numbered)  # raises having taken none of them: their seqs stay free
            self._added.set()
        self._last_seq = seq
        # else never deliverable (410, a refused credential): numbered for the caller, not kept,
        # or a learner that keeps printing would fill the disk for nothing.
        self._cond.notify_all()
        return [seq for seq, _ in numbered]

    def wait_for_room(self):
        """Block while the spool is full (back-pressure on whoever produces output); returns at once
        when it has room, and also once shipping has stopped or the shipper closes."""
        with self._cond:
            while not self._spool.has_room(0) and self._stopped is None and not self._closing:
                if self._full_since is None and self._spool.write_error is None:  # else the flusher says why
                    self._full_since = time.monotonic()
                    self._notice(f"the spool is full ({format_bytes(self._spool.max_bytes)} of records the "
                                 f"platform has not acknowledged, up to seq {self._last_seq}): the "
                                 "learner's output is held back until the platform catches up")
                self._cond.wait()

    def _notice(self, text):
        """A `system` line in the job's log (and agent.log); goes in even when the spool is full."""
        log.warning("%s", text)
        # No segment the disk takes: agent.log has it, and the caller's thread lives on.
        with contextlib.suppress(OSError):
            self._append([json.dumps({"kind": "log", "stream": "system", "time": time.time(),
                                      "line": f"learner agent: {text}"}, separators=(",", ":")).encode()])

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

    def close(self, timeout=None, *, discard_spool=False):
        """Stop the sender. Records not yet acked stay in the spool for a later agent (call flush()
        first to deliver them), unless `discard_spool`: everything is delivered or never can be."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._closed.set()
        self._added.set()
        self._thread.join(timeout if timeout is not None else HTTP_TIMEOUT_S + 1)
        self._flusher.join(1.0)
        with self._cond:
            if discard_spool:
                self._spool.destroy()
            else:
                self._spool.close()

    def last_record(self):
        """The last record spooled (a dict), or None: what a restarted agent checks before it adds one."""
        with self._cond:
            return self._spool.last_record()

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

    # --- where to post ---

    def _aim(self, ingest_url):
        url = urllib.parse.urlsplit(ingest_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"ingest_url must be an http(s) URL, not {ingest_url!r}")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._url = ingest_url

    def _follow_platform(self):
        """Post where the platform is now (`current_url`); True if that is a new address."""
        if self._current_url is None:
            return False
        try:
            url = self._current_url()
            if not url or url == self._url:
                return False
            before = self._url
            self._aim(url)
        except Exception as e:  # a bad address file must never end delivery
            log.warning("cannot follow the platform's address: %s", e)
            return False
        self._drop_connection()
        log.warning("the platform moved: posting to %s instead of %s", url, before)
        return True

    # --- the sender thread ---

    def _run(self):
        backoff = self._backoff_initial
        failures = 0
        try:
            while True:
                try:
                    batch = self._next_batch()
                    if batch is None:
                        return
                    outcome, detail = self._send(batch)
                except OSError as e:  # the spool's disk (full, failing): retried like a failed post
                    outcome, detail = "retry", f"spool: {type(e).__name__}: {e}"
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
                if self._follow_platform():
                    continue  # it failed at an address the platform has left: try the new one now
                if failures == 1 and detail.startswith("reused:"):
                    continue
                with self._cond:
                    if not self._closing:
                        self._cond.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max)
        finally:
            self._drop_connection()

    def _flush_spool_periodically(self):
        """Bound how long an added record lives only in this process (FLUSH_INTERVAL_S) and only in
        the page cache (SYNC_INTERVAL_S); the fsync runs outside the lock, on a duplicate descriptor.

        Asleep while nothing was added: a timer waking 20 times a second for a learner that prints
        a line a second (or none while it trains) was most of the agent's wake-ups during a job."""
        unsynced_since = None  # when records first reached the kernel that are not on the disk yet
        failing_since, backoff = None, self._backoff_initial  # while the disk refuses the spool's writes
        while True:
            # Woken by an add, by close, or when records written earlier are due for their fsync.
            due = None if unsynced_since is None else unsynced_since + SYNC_INTERVAL_S - time.monotonic()
            self._added.wait(None if due is None else max(0.0, due))
            # After an add, wait out the interval so what follows it goes in the same write.
            pause = FLUSH_INTERVAL_S if failing_since is None else backoff
            if self._closed.wait(pause if self._added.is_set() else 0):
                return
            with self._cond:
                if self._closing:
                    return
                self._added.clear()
                try:
                    self._spool.flush()
                except OSError as e:  # kept in memory and retried; this thread must outlive a full disk
                    self._added.set()
                    if failing_since is not None:
                        backoff = min(backoff * 2, self._backoff_max)
                        continue
                    failing_since = time.monotonic()
                    self._notice(f"cannot write the spool ({type(e).__name__}: {e}): retrying; up to "
                                 f"{format_bytes(MAX_UNWRITTEN_BYTES)} of records are kept in memory meanwhile, then "
                                 "the learner's output is held back until the disk takes it; nothing is dropped")
                    continue
                if failing_since is not None:
                    self._notice(f"the spool is written again after {time.monotonic() - failing_since:.1f}s")
                    failing_since, backoff = None, self._backoff_initial
                    self._cond.notify_all()  # output held back (wait_for_room) may go on
                now, sync_fd = time.monotonic(), None
                unsynced_since = unsynced_since or now
                if now - unsynced_since >= SYNC_INTERVAL_S - FLUSH_INTERVAL_S:
                    sync_fd, unsynced_since = self._spool.dup_for_sync(), None
            if sync_fd is not None:
                try:
                    os.fsync(sync_fd)
                except OSError as e:  # the records are still in the file; only a machine crash could take them
                    log.warning("spool: fsync failed: %s", e)
                finally:
                    os.close(sync_fd)

    def _next_batch(self):
        """The oldest unacked records, within the batch limits; None when it is time to stop."""
        with self._cond:
            while self._acked >= self._last_seq and not self._closing and self._stopped is None:
                self._cond.wait()
            if self._closing or self._stopped is not None:
                return None
            # Read back from the file, so nothing goes out that a restarted agent would not find.
            # When the disk refuses the rest, what the file holds still goes: acks free the disk.
            error = None
            try:
                self._spool.flush()
            except OSError as e:
                error = e
            batch = self._spool.read(self._acked, max_records=self._max_batch, max_bytes=self._max_batch_bytes)
            if not batch and error is not None:
                raise error
            return batch

    def _send(self, batch):
        """One request; returns ("progress" | "retry" | "stop", detail)."""
        # Imported here, on the shipping thread, not with the module: http.client (with ssl and
        # email) is a large share of the agent's imports, and the learner's command can start without it.
        import http.client
        body = self._body_head + b",".join(b for _, b in batch) + b"]}"
        reused = self._conn is not None and self._conn_requests > 0
        if self._conn is None:
            self._follow_platform()
        try:
            if self._conn is None:
                connection_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = connection_class(self._host, self._port, timeout=HTTP_TIMEOUT_S)
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
            answer = _json_object(payload)
            acked = _acked_from(answer)
            if acked is None:
                return "retry", f"HTTP {status} without a valid 'acked'"
            if status == 200:
                _log_rejected(answer)
                if self._on_answer is not None:
                    self._on_answer(answer)
            return self._apply_ack(acked, status=status, first_sent=batch[0][0])
        if status == 410:
            self._stop("gone: the platform answered 410 (attempt is over)", gone=True)
            return "stop", "410"
        if status in _PERMANENT_FAILURES:
            if self._follow_platform():  # refused by whoever has the old address now
                return "retry", f"HTTP {status} from the platform's old address"
            text = payload[:300].decode("utf-8", "replace")
            self._stop(f"HTTP {status} ({_PERMANENT_FAILURES[status]}): {text}")
            return "stop", str(status)
        return "retry", f"HTTP {status}"

    def _apply_ack(self, acked, *, status, first_sent):
        with self._cond:
            acked_before = self._acked
            if acked > self._last_seq:
                # Only possible if another agent used these seqs (or the machine went down and took
                # the spool's last records with it): the platform has them, so ours continue after.
                log.error("platform acked seq %d but only %d records exist here; numbering on from %d",
                          acked, self._last_seq, acked + 1)
                self._last_seq = acked
            if acked > self._acked:
                self._acked = acked
                self._spool.ack(acked)
            # The episode ends at half full, not at the first free byte: a learner faster than
            # the platform would otherwise make these notices flap with every ack.
            if self._full_since is not None and self._spool.has_room(self._spool.max_bytes // 2):
                took, self._full_since = time.monotonic() - self._full_since, None
                self._notice(f"the spool is below half full again; over the last {took:.1f}s the learner's "
                             "output was held back whenever it was full")
            self._cond.notify_all()
        if acked < acked_before:
            # The platform lost records it had acked; they are gone here too, so resending can't help.
            self._stop(f"platform reports acked={acked} but seqs up to {acked_before} were acked before")
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


def _json_object(payload):
    """The answer's JSON object, or {} for anything else."""
    try:
        answer = json.loads(payload)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _log_rejected(answer):
    """Log the records the platform refused (`rejected`: [{"seq", "error"}]; acked all the same, so
    they are not sent again). The platform notes them in the job's log too."""
    try:
        rejected = answer.get("rejected") or []
        unlisted = answer.get("rejected_unlisted") or 0
        for entry in rejected[:20]:
            log.warning("the platform refused record %s: %s", entry.get("seq"), str(entry.get("error"))[:300])
        more = len(rejected) - 20 + (unlisted if isinstance(unlisted, int) else 0)
    except (ValueError, TypeError, AttributeError):  # an answer this agent does not understand: ack is what counts
        return
    if more > 0:
        log.warning("the platform refused %d more records of that batch", more)


def _acked_from(answer):
    acked = answer.get("acked")
    return acked if isinstance(acked, int) and not isinstance(acked, bool) and acked >= 0 else None
