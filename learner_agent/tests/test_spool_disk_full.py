"""The spool and the shipper through a disk that refuses writes for a while (full): a short write,
then ENOSPC, then fine again. Nothing may be lost, duplicated, torn or renumbered, and no thread dies."""
import errno
import json
import os
import threading
import time

import pytest

from learner_agent import spool as spool_module
from learner_agent.shipper import Shipper
from learner_agent.spool import Spool
from tests.support.agent_runs import TOKEN, IngestServer, wait_for


class DiskFull:
    """Stands in for `os` in learner_agent.spool. Writes to segments go as `plan` says, one step a
    call ("short": the first half, cut inside a record; "full": ENOSPC), then are refused while `full`
    is set, else written; `refused_creates` segments fail to be created. The rest is the real os."""

    def __init__(self):
        self.plan, self.full, self.refused_creates = [], False, 0
        self.refusals = 0  # writes refused so far
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777):
        if str(path).endswith(".seg") and self.refused_creates:
            self.refused_creates -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.open(path, flags, mode)

    def write(self, fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".seg"):  # the acked cursor
            return os.write(fd, data)
        with self._lock:
            step = self.plan.pop(0) if self.plan else "full" if self.full else None
        if step == "short":
            cut = len(data) // 2
            cut += data[cut - 1] == ord("\n")  # inside a record, never just after one
            return os.write(fd, bytes(data[:cut]))
        if step == "full":
            self.refusals += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)


@pytest.fixture
def disk(monkeypatch):
    fake = DiskFull()
    monkeypatch.setattr(spool_module, "os", fake)
    return fake


def numbered(first, count):
    return [(seq, json.dumps({"seq": seq, "kind": "log", "line": "x" * 40}, separators=(",", ":")).encode())
            for seq in range(first, first + count)]


def read_all(spool, after):
    records = []
    while batch := spool.read(after, max_records=1000, max_bytes=10**6):
        records += batch
        after = batch[-1][0]
    return [seq for seq, _ in records]


def seqs_in_files(folder):
    """The seqs of the segments' records, in file order; fails on anything but whole JSON lines."""
    data = b"".join((folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith(".seg"))
    assert data.endswith(b"\n")
    return [json.loads(line)["seq"] for line in data.splitlines()]


def line(i):
    return {"kind": "log", "stream": "stdout", "line": f"line {i:04d}"}


def stdout_lines(server):
    return [r["line"] for r in server.stored() if r.get("stream") == "stdout"]


def test_a_short_write_then_a_full_disk_leaves_whole_records_and_a_usable_spool(tmp_path, disk):
    folder = tmp_path / "spool"
    spool = Spool(str(folder))
    spool.append(numbered(1, 10))
    spool.flush()
    disk.plan = ["short", "full"]
    spool.append(numbered(11, 10))
    with pytest.raises(OSError):
        spool.flush()
    on_disk = seqs_in_files(folder)  # cut back to the last whole record that went
    assert on_disk == list(range(1, len(on_disk) + 1)) and 10 < len(on_disk) < 20
    assert read_all(spool, 0) == on_disk and spool.write_error is not None
    spool.append(numbered(21, 5))  # the buffer is still usable
    spool.flush()  # the disk takes writes again: the rest follows, none twice
    assert seqs_in_files(folder) == list(range(1, 26)) and spool.write_error is None
    spool.close()
    reopened = Spool(str(folder))
    assert (reopened.last_seq, reopened.torn_bytes) == (25, 0)
    assert read_all(reopened, 0) == list(range(1, 26))


def test_a_record_the_spool_cannot_take_takes_no_seq(tmp_path, disk):
    server = IngestServer()
    shipper = Shipper(server.url, TOKEN, attempt=1, learner=0, spool=Spool(str(tmp_path / "spool")))
    try:
        disk.refused_creates = 1  # the first segment cannot be created
        with pytest.raises(OSError):
            shipper.add(line(0))
        assert shipper.add(line(1)) == 1
        assert shipper.flush(timeout=10)
    finally:
        shipper.close()
        server.close()
    assert [(r["seq"], r["line"]) for r in server.stored()] == [(1, "line 0001")]


def test_after_a_full_disk_everything_is_shipped_once_in_order_and_a_restart_finds_the_rest(tmp_path, disk):
    server = IngestServer()
    folder = tmp_path / "spool"
    shipper = Shipper(server.url, TOKEN, attempt=1, learner=0, spool=Spool(str(folder)),
                      backoff_initial=0.01, backoff_max=0.05)
    try:
        shipper.add_many([line(i) for i in range(10)])
        assert shipper.flush(timeout=10)
        disk.plan = ["short", "full", "full", "full"]  # whichever thread writes first meets it
        shipper.add_many([line(i) for i in range(10, 30)])
        assert shipper.flush(timeout=10) and disk.plan == []
        assert shipper._thread.is_alive() and shipper._flusher.is_alive()
        last = shipper.last_seq
        assert shipper.add(line(30)) == last + 1  # numbering continues
        assert shipper.flush(timeout=10)
        server.status_override = 503  # what follows is spooled, not acked
        acked = shipper.acked
        shipper.add_many([line(i) for i in range(31, 40)])
        time.sleep(0.2)
    finally:
        shipper.close()
    reopened = Spool(str(folder))  # as a restarted agent finds it
    assert (reopened.acked, reopened.last_seq) == (acked, acked + 9)
    assert read_all(reopened, acked) == list(range(acked + 1, acked + 10))
    server.status_override = None
    second = Shipper(server.url, TOKEN, attempt=1, learner=0, spool=reopened)
    try:
        assert second.add({"kind": "status", "state": "exited"}) == acked + 10
        assert second.flush(timeout=10)
    finally:
        second.close(discard_spool=True)
        server.close()
    assert [r["seq"] for r in server.stored()] == list(range(1, acked + 11))
    assert stdout_lines(server) == [f"line {i:04d}" for i in range(40)]


def test_output_waits_in_memory_then_is_held_back_while_the_disk_is_full_and_all_of_it_goes_after(
        tmp_path, disk, monkeypatch):
    monkeypatch.setattr(spool_module, "MAX_UNWRITTEN_BYTES", 4096, raising=False)
    server = IngestServer()
    spool = Spool(str(tmp_path / "spool"))
    shipper = Shipper(server.url, TOKEN, attempt=1, learner=0, spool=spool, backoff_initial=0.01, backoff_max=0.05)
    produced = []

    def produce():  # as the agent's reader of the learner's output does (Agent._ship_lines)
        for i in range(1, 200):
            shipper.wait_for_room()
            shipper.add(line(i))
            produced.append(i)

    producer = threading.Thread(target=produce, daemon=True)
    try:
        disk.full = True
        shipper.add(line(0))
        wait_for(lambda: disk.refusals > 0, timeout=5, interval=0.01)
        producer.start()
        time.sleep(0.5)
        assert producer.is_alive() and 10 < len(produced) < 100  # held back past the bound, not dead
        assert len(spool._buffer) < 4096 + 1024  # the bound, a record and the notice past it
        assert shipper._thread.is_alive() and shipper._flusher.is_alive()
        disk.full = False
        producer.join(10)
        assert not producer.is_alive()
        assert shipper.flush(timeout=10)
    finally:
        shipper.close(discard_spool=True)
        server.close()
    stored = server.stored()
    assert [r["seq"] for r in stored] == list(range(1, len(stored) + 1))
    assert stdout_lines(server) == [f"line {i:04d}" for i in range(200)]
    system = [r["line"] for r in stored if r.get("stream") == "system"]
    assert len(system) == 2 and "cannot write the spool (OSError" in system[0] and "written again" in system[1]
