"""The shipper against a real HTTP server: exactly once, in order, whatever the network does."""
import os
import socket
import threading
import time

import pytest

from learner_agent.shipper import Shipper
from learner_agent.spool import Spool
from tests.support.agent_runs import TOKEN, IngestServer, wait_for


def shipper_for(server, folder, **kwargs):
    spool = Spool(str(folder / "spool"), **{k: kwargs.pop(k) for k in ("max_bytes",) if k in kwargs})
    return Shipper(server.url, kwargs.pop("token", TOKEN), attempt=1, learner=0, spool=spool, **kwargs)


def log_record(i, producer=0):
    return {"kind": "log", "stream": "stdout", "line": f"p{producer} line {i}"}


def test_it_delivers_everything_exactly_once_in_order_through_dropped_connections(tmp_path):
    server = IngestServer(drop_rate=0.2, seed=1234)
    shipper = shipper_for(server, tmp_path, max_batch=200)
    try:
        def produce(producer):
            for i in range(10_000):
                shipper.add(log_record(i, producer))
                if i % 500 == 0:
                    time.sleep(0.01)  # bursts, so there are many requests (and many drops)
        producers = [threading.Thread(target=produce, args=(p,)) for p in (0, 1)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        assert shipper.flush(timeout=60)
    finally:
        shipper.close()
        server.close()
    stored = server.stored()
    assert [r["seq"] for r in stored] == list(range(1, 20_001))
    for producer in (0, 1):  # each thread's records in the order it added them
        lines = [r["line"] for r in stored if r["line"].startswith(f"p{producer} ")]
        assert lines == [f"p{producer} line {i}" for i in range(10_000)]
    assert all(isinstance(r["time"], float) for r in stored)
    assert server.dropped > 20  # the test really went through failures


def test_it_batches_what_accumulates_and_respects_the_byte_limit(tmp_path):
    server = IngestServer()
    shipper = shipper_for(server, tmp_path, max_batch=1000, max_batch_bytes=4096)
    try:
        shipper.add_many([{"kind": "log", "stream": "stdout", "line": "x" * 100} for _ in range(500)])
        assert shipper.flush(timeout=10)
    finally:
        shipper.close()
        server.close()
    assert len(server.stored()) == 500
    assert max(server.body_sizes) <= 4096 + 64  # the records, plus the attempt/learner head
    assert sum(server.body_sizes) / len(server.body_sizes) > 3000  # full batches, not one per record


def test_it_resends_from_the_first_unstored_record_after_a_partial_ack(ingest, tmp_path):
    ingest.max_store_per_request = 7
    shipper = shipper_for(ingest, tmp_path)
    shipper.add_many([log_record(i) for i in range(50)])
    assert shipper.flush(timeout=10)
    shipper.close()
    assert [r["seq"] for r in ingest.stored()] == list(range(1, 51))
    assert ingest.requests >= 8


def test_it_retries_a_confused_409_after_a_backoff_instead_of_spinning(ingest, tmp_path):
    ingest.scripted = [409, 409]
    shipper = shipper_for(ingest, tmp_path)
    started = time.monotonic()
    shipper.add(log_record(1))
    assert shipper.flush(timeout=10)
    shipper.close()
    assert time.monotonic() - started >= 0.3  # 0.1 s, then 0.2 s
    assert [r["seq"] for r in ingest.stored()] == [1]


def test_it_keeps_everything_while_the_platform_fails_and_sends_it_when_back(ingest, tmp_path):
    ingest.status_override = 503
    shipper = shipper_for(ingest, tmp_path)
    shipper.add_many([log_record(i) for i in range(10)])
    assert not shipper.flush(timeout=0.5)
    assert ingest.stored() == [] and ingest.requests >= 2
    ingest.status_override = None
    assert shipper.flush(timeout=10)
    shipper.close()
    assert [r["seq"] for r in ingest.stored()] == list(range(1, 11))


def test_it_survives_a_platform_that_is_not_listening_yet(tmp_path):
    server = IngestServer()
    server.close()
    shipper = shipper_for(server, tmp_path)
    shipper.add(log_record(1))
    assert not shipper.flush(timeout=0.5)
    shipper.close()
    assert shipper.stopped_reason is None  # still willing: connection refused is retried


def test_it_stops_and_calls_back_on_410(ingest, tmp_path):
    ingest.gone = True
    called = threading.Event()
    shipper = shipper_for(ingest, tmp_path, on_gone=called.set)
    shipper.add(log_record(1))
    assert called.wait(5)
    assert shipper.gone
    assert [r["seq"] for r in ingest.stored()] == [1]  # its last words are kept
    spooled = spool_bytes(tmp_path)
    shipper.add_many([log_record(i) for i in range(2, 1000)])
    assert not shipper.flush(timeout=5)
    time.sleep(0.2)  # the spool's flush interval, several times
    assert spool_bytes(tmp_path) == spooled  # nothing kept that can never be delivered
    shipper.close()


def spool_bytes(folder):
    return sum(os.path.getsize(path) for path in (folder / "spool").glob("*.seg"))


@pytest.mark.parametrize("status", [400, 401, 404])
def test_it_stops_for_good_on_errors_that_retrying_cannot_fix(ingest, status, tmp_path):
    ingest.status_override = status
    shipper = shipper_for(ingest, tmp_path)
    shipper.add(log_record(1))
    started = time.monotonic()
    assert not shipper.flush(timeout=5)
    assert time.monotonic() - started < 2
    assert f"HTTP {status}" in shipper.stopped_reason
    assert not shipper.gone
    shipper.close()
    assert ingest.requests == 1


def test_it_assigns_seq_and_keeps_a_given_time(ingest, tmp_path):
    shipper = shipper_for(ingest, tmp_path)
    assert shipper.add({"kind": "status", "state": "preparing", "time": 5.5, "seq": 99}) == 1
    assert shipper.add_many([log_record(1), log_record(2)]) == [2, 3]
    assert shipper.flush(timeout=5)
    shipper.close()
    assert ingest.stored()[0] == {"seq": 1, "kind": "status", "state": "preparing", "time": 5.5}
    assert [r["seq"] for r in ingest.stored()] == [1, 2, 3]


def test_it_refuses_a_record_it_cannot_encode_without_leaving_a_gap(ingest, tmp_path):
    shipper = shipper_for(ingest, tmp_path)
    with pytest.raises(ValueError):
        shipper.add({"kind": "metric", "name": "loss", "value": float("nan")})
    shipper.add(log_record(1))
    assert shipper.flush(timeout=5)
    shipper.close()
    assert [r["seq"] for r in ingest.stored()] == [1]


class CountingSpool(Spool):
    """A spool that counts the flusher's visits: its flushes, and the fsyncs it hands out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flushes = self.syncs = 0

    def flush(self):
        self.flushes += 1
        super().flush()

    def dup_for_sync(self):
        fd = super().dup_for_sync()
        self.syncs += fd is not None
        return fd


def test_the_spool_is_left_alone_while_nothing_is_added(ingest, tmp_path):
    spool = CountingSpool(str(tmp_path / "spool"))
    shipper = Shipper(ingest.url, TOKEN, attempt=1, learner=0, spool=spool)
    shipper.add(log_record(1))
    assert shipper.flush(timeout=5)
    wait_for(lambda: spool.syncs == 1, timeout=3, interval=0.01)  # that record reached the disk, once
    before = spool.flushes
    time.sleep(1.0)  # twenty of the flush intervals, and a sync interval
    assert spool.flushes == before and spool.syncs == 1
    shipper.close()


def test_records_reach_the_file_and_then_the_disk_while_the_platform_does_not_answer(tmp_path):
    hung = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog, unanswered
    url = f"http://127.0.0.1:{hung.getsockname()[1]}/api/v1/ingest/training-test0001/"
    spool = CountingSpool(str(tmp_path / "spool"))
    shipper = Shipper(url, TOKEN, attempt=1, learner=0, spool=spool)
    try:
        shipper.add(log_record(1))
        time.sleep(0.3)  # the sender has read it back and waits for an answer that never comes
        shipper.add_many([log_record(i) for i in range(2, 5)])
        # Only the flusher writes these: within a few of its intervals they survive the agent.
        wait_for(lambda: spooled_lines(tmp_path) == 4, timeout=0.5, interval=0.01)
        wait_for(lambda: spool.syncs >= 1, timeout=2, interval=0.01)
        assert shipper.acked == 0
    finally:
        shipper.close(timeout=0.2)
        hung.close()


def spooled_lines(folder):
    return sum(path.read_bytes().count(b"\n") for path in (folder / "spool").glob("*.seg"))


def test_records_the_platform_refuses_are_logged_and_not_sent_again(tmp_path, caplog):
    server = IngestServer()
    server.refuse = lambda record: "step: must be an integer" if record.get("step") == -1 else None
    shipper = shipper_for(server, tmp_path)
    try:
        shipper.add({"kind": "log", "stream": "stdout", "line": "before"})
        shipper.add({"kind": "metric", "name": "loss", "value": 1.0, "step": -1})
        shipper.add({"kind": "log", "stream": "stdout", "line": "after"})
        with caplog.at_level("WARNING", logger="learner_agent.shipper"):
            assert shipper.flush(timeout=10)
            shipper.add({"kind": "log", "stream": "stdout", "line": "later"})
            assert shipper.flush(timeout=10)
    finally:
        shipper.close()
        server.close()
    assert [r.get("line") for r in server.stored()] == ["before", "after", "later"]
    assert [r["seq"] for r in server.refused[(1, 0)]] == [2]
    assert sum(2 in batch for batch in server.batches) == 1  # acked with the rest: never sent again
    assert "the platform refused record 2: step: must be an integer" in caplog.text
    assert shipper.stopped_reason is None
