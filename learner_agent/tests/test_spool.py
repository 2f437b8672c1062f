"""The spool on its own (append, read back, ack, reopen, a torn tail, the bound), and the shipper
on a spool: full, and taken over by a second shipper as a restarted agent would."""
import json
import os
import threading
import time

import pytest

from learner_agent.shipper import Shipper
from learner_agent.spool import Spool, SpoolError, has_undelivered
from tests.support.agent_runs import TOKEN, IngestServer


def numbered(first, count, size=40):
    return [(seq, json.dumps({"seq": seq, "kind": "log", "line": "x" * size}, separators=(",", ":")).encode())
            for seq in range(first, first + count)]


def seqs(records):
    return [seq for seq, _ in records]


def read_all(spool, after):
    """Every record after `after`, batch by batch (a batch ends where its segment does)."""
    records = []
    while batch := spool.read(after, max_records=1000, max_bytes=10**6):
        records += batch
        after = batch[-1][0]
    return records


def segment_files(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".seg"))


def test_it_reads_back_what_was_appended_in_batches_and_from_the_first_unacked(tmp_path):
    spool = Spool(str(tmp_path / "spool"))
    spool.append(numbered(1, 100))
    spool.flush()
    assert seqs(spool.read(0, max_records=30, max_bytes=10**6)) == list(range(1, 31))
    spool.ack(17)  # a partial ack: the next batch starts right after it
    batch = spool.read(17, max_records=1000, max_bytes=10**6)
    assert seqs(batch) == list(range(18, 101))
    assert json.loads(batch[0][1])["seq"] == 18
    assert spool.read(100, max_records=10, max_bytes=10**6) == []
    small = spool.read(0, max_records=1000, max_bytes=200)  # bytes bound: whole records only
    assert 1 <= len(small) <= 3 and all(json.loads(body) for _, body in small)


def test_it_refuses_a_record_that_does_not_continue_its_numbering(tmp_path):
    spool = Spool(str(tmp_path / "spool"))
    spool.append(numbered(1, 3))
    with pytest.raises(SpoolError, match="does not continue"):
        spool.append(numbered(5, 1))


def test_it_deletes_whole_segments_once_acked_and_keeps_the_cursor(tmp_path):
    folder = tmp_path / "spool"
    spool = Spool(str(folder), max_bytes=2**20, segment_bytes=1000)
    spool.append(numbered(1, 100))  # ~50 bytes each: about 20 per segment
    spool.flush()
    before = segment_files(folder)
    assert len(before) >= 5
    spool.ack(60)
    after = segment_files(folder)
    assert len(after) < len(before) and int(after[0][:-4]) <= 61  # the segment holding 61 stays
    assert (folder / "acked").read_text() == "60\n"
    assert seqs(spool.read(60, max_records=5, max_bytes=10**6)) == [61, 62, 63, 64, 65]
    assert all(oct(os.stat(folder / n).st_mode & 0o777) == "0o600" for n in after)
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"


def test_a_reopened_spool_continues_where_the_last_one_stopped(tmp_path):
    folder = str(tmp_path / "spool")
    spool = Spool(folder, segment_bytes=1000)
    spool.append(numbered(1, 50))
    spool.flush()
    spool.ack(20)
    spool.close()
    assert has_undelivered(folder)
    again = Spool(folder, segment_bytes=1000)
    assert (again.acked, again.last_seq) == (20, 50)
    assert seqs(read_all(again, 20)) == list(range(21, 51))
    again.append(numbered(51, 2))
    again.flush()
    again.ack(52)
    assert not has_undelivered(folder)
    assert Spool(folder).last_seq == 52


def test_a_torn_last_record_is_cut_off_and_numbering_continues_before_it(tmp_path):
    folder = tmp_path / "spool"
    spool = Spool(str(folder))
    spool.append(numbered(1, 10))
    spool.flush()
    segment = folder / segment_files(folder)[-1]
    with open(segment, "ab") as f:  # an agent killed in the middle of a write
        f.write(b'{"seq":11,"kind":"log","li')
    again = Spool(str(folder))
    assert again.last_seq == 10 and again.torn_bytes == len(b'{"seq":11,"kind":"log","li')
    again.append(numbered(11, 1))
    again.flush()
    assert [json.loads(body)["seq"] for _, body in read_all(again, 0)] == list(range(1, 12))
    assert again.last_record()["seq"] == 11


def test_garbage_after_the_last_whole_record_is_cut_off(tmp_path):
    folder = tmp_path / "spool"
    spool = Spool(str(folder))
    spool.append(numbered(1, 3))
    spool.close()
    with open(folder / segment_files(folder)[-1], "ab") as f:
        f.write(b"\0" * 100 + b"\n")  # the machine went down: the size grew, the data never came
    assert Spool(str(folder)).last_seq == 3


def test_the_bound_counts_what_is_on_disk_and_buffered(tmp_path):
    spool = Spool(str(tmp_path / "spool"), max_bytes=10_000)
    spool.append(numbered(1, 100, size=40))  # ~5 KB
    assert spool.has_room(1000) and not spool.has_room(6000)
    spool.flush()
    assert not spool.has_room(6000)


def test_a_full_spool_holds_output_back_says_so_and_keeps_status_records(tmp_path):
    server = IngestServer()
    server.status_override = 503  # the platform acks nothing: the spool fills
    shipper = Shipper(server.url, TOKEN, attempt=1, learner=0, backoff_max=0.2,
                      spool=Spool(str(tmp_path / "spool"), max_bytes=64 * 1024, segment_bytes=4096))
    produced = []

    def produce():
        for i in range(600):  # ~80 KB: more than the spool holds, less than it and half of it
            shipper.wait_for_room()
            shipper.add({"kind": "log", "stream": "stdout", "line": f"line {i:04d} " + "x" * 50})
            produced.append(i)

    producer = threading.Thread(target=produce, daemon=True)
    try:
        producer.start()
        time.sleep(1.0)
        assert producer.is_alive() and 300 < len(produced) < 600  # held back, not dropping
        shipper.add({"kind": "status", "state": "running"})  # never held back
        server.status_override = None
        producer.join(20)
        assert not producer.is_alive()
        shipper.add({"kind": "status", "state": "exited", "exit_code": 0})
        assert shipper.flush(timeout=20)
    finally:
        shipper.close(discard_spool=True)
        server.close()
    stored = server.stored()
    assert [r["seq"] for r in stored] == list(range(1, len(stored) + 1))
    lines = [r["line"] for r in stored if r.get("stream") == "stdout"]
    assert lines == [f"line {i:04d} " + "x" * 50 for i in range(600)]  # every line, once, in order
    system = [r["line"] for r in stored if r.get("stream") == "system"]
    assert len(system) == 2 and "spool is full (0.1MiB" in system[0] and "below half full again" in system[1]
    assert [r["state"] for r in stored if r["kind"] == "status"] == ["running", "exited"]
    assert not (tmp_path / "spool").exists()  # delivered: discarded


def test_a_second_shipper_on_the_spool_delivers_the_rest_exactly_once_and_numbers_on(tmp_path):
    server = IngestServer()
    server.max_store_per_request = 10
    first = Shipper(server.url, TOKEN, attempt=1, learner=0, spool=Spool(str(tmp_path / "spool")))
    first.add_many([{"kind": "log", "stream": "stdout", "line": f"first {i}"} for i in range(25)])
    assert first.flush(timeout=10)
    server.status_override = 503
    first.add_many([{"kind": "log", "stream": "stdout", "line": f"unacked {i}"} for i in range(40)])
    time.sleep(0.3)
    first.close()  # the spool stays, as a dead agent leaves it
    server.status_override = None
    reopened = Spool(str(tmp_path / "spool"))
    assert (reopened.acked, reopened.last_seq) == (25, 65)
    second = Shipper(server.url, TOKEN, attempt=1, learner=0, spool=reopened)
    assert second.add({"kind": "status", "state": "exited"}) == 66
    assert second.flush(timeout=10)
    second.close(discard_spool=True)
    server.close()
    stored = server.stored()
    assert [r["seq"] for r in stored] == list(range(1, 67))
    assert [r["line"] for r in stored[25:65]] == [f"unacked {i}" for i in range(40)]


def test_an_anonymous_spool_leaves_nothing_with_a_name_to_write_into(tmp_path):
    folder = tmp_path / "spool"
    spool = Spool(str(folder), segment_bytes=1000, anonymous=True)
    spool.append(numbered(1, 100))
    spool.flush()
    assert os.listdir(folder) == []  # nothing another process of our uid could open
    assert seqs(read_all(spool, 0)) == list(range(1, 101))
    spool.ack(70)
    assert seqs(read_all(spool, 70)) == list(range(71, 101))
    assert spool.last_record()["seq"] == 100
    spool.close()
    assert os.listdir(folder) == [] and Spool(str(folder)).last_seq == 0
