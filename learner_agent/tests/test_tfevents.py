"""Reading TensorBoard event files: the framing, the folder walk, hostile files, offsets across restarts.

Event files are written by the tensorboard package's own writer where it matters (the platform
depends on it; the agent itself never imports it), and what the agent reads is compared with what
tensorboard's reader reads from the same file."""
import base64
import json
import os
import signal
import struct
import subprocess
import time

import pytest

from learner_agent import tfevents
from tests.support.agent_runs import agent_command, agent_env, run_agent, stop_process, wait_for, write_agent_config

tb = pytest.importorskip("tensorboard", reason="the platform's dependency tensorboard is not installed")
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader  # noqa: E402
from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc32c  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402


def scalar_event(tag, value, step):
    return event_pb2.Event(wall_time=1_700_000_000.0 + step, step=step, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]))


def write_events(folder, events):
    writer = EventFileWriter(str(folder))
    for event in events:
        writer.add_event(event)
    writer.close()
    (path,) = [p for p in folder.iterdir() if ".tfevents" in p.name]
    return path


class Shipped:
    """A tailer's ship/notice callbacks, remembering what it was given."""

    def __init__(self):
        self.records, self.notices = [], []

    def ship(self, records):
        self.records.extend(records)

    def notice(self, text):
        self.notices.append(text)

    def tailer(self, root, parts, state_dir):
        return tfevents.EventFileTailer(str(root), parts, state_dir=str(state_dir), ship=self.ship,
                                        notice=self.notice)

    def data(self):
        return [base64.b64decode(r["data"]) for r in self.records]


def test_its_checksum_is_tfrecords_masked_crc32c():
    for data in (b"", b"a", b"123456789", bytes(range(256)) * 3):
        assert tfevents.masked_crc32c(data) == tb_masked_crc32c(data)
    assert tfevents.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_it_reads_exactly_the_records_tensorboards_reader_reads(tmp_path):
    path = write_events(tmp_path, [scalar_event("loss", 1.0 / (i + 1), i) for i in range(50)])
    expected = list(RawEventFileLoader(str(path)).Load())
    fd = os.open(path, os.O_RDONLY)
    try:
        records, offset, dropped, _ = tfevents.read_records(fd, 0, size=os.fstat(fd).st_size, budget=10**9)
    finally:
        os.close(fd)
    assert [data for _, data in records] == expected and len(expected) == 51  # file_version + 50
    assert offset == path.stat().st_size and dropped == []


def test_it_waits_for_a_record_the_learner_is_still_writing(tmp_path):
    whole = tfevents.frame(b"first") + tfevents.frame(b"second")
    path = tmp_path / "events.out.tfevents.1"
    path.write_bytes(whole[:-7])  # the second record cut short
    fd = os.open(path, os.O_RDONLY)
    records, offset, _, _ = tfevents.read_records(fd, 0, size=os.fstat(fd).st_size, budget=10**9)
    assert [d for _, d in records] == [b"first"] and offset == len(tfevents.frame(b"first"))
    path.write_bytes(whole)
    records, offset, _, _ = tfevents.read_records(fd, offset, size=os.fstat(fd).st_size, budget=10**9)
    os.close(fd)
    assert [d for _, d in records] == [b"second"] and offset == len(whole)


def test_it_steps_over_big_records_drops_bad_checksums_and_stops_at_a_bad_length(tmp_path):
    bad_data = bytearray(tfevents.frame(b"tampered"))
    bad_data[14] ^= 0xFF
    big = tfevents.frame(b"x" * (tfevents.MAX_RECORD_BYTES + 1))
    bad_length = bytearray(tfevents.frame(b"after"))
    bad_length[0] ^= 0x01
    path = tmp_path / "f"
    path.write_bytes(tfevents.frame(b"ok") + bytes(bad_data) + big + tfevents.frame(b"ok2") + bytes(bad_length)
                     + tfevents.frame(b"never"))
    fd = os.open(path, os.O_RDONLY)
    with pytest.raises(tfevents.CorruptFile) as error:
        tfevents.read_records(fd, 0, size=os.fstat(fd).st_size, budget=10**9)
    good_part = len(tfevents.frame(b"ok")) + len(bad_data) + len(big) + len(tfevents.frame(b"ok2"))
    assert error.value.offset == good_part
    records, offset, dropped, read = tfevents.read_records(fd, 0, size=good_part, budget=10**9)
    os.close(fd)
    assert [d for _, d in records] == [b"ok", b"ok2"] and offset == good_part
    assert [why.split(" (")[0] for _, why in dropped] == [
        "a record whose data fails its checksum", f"a {tfevents.MAX_RECORD_BYTES + 1}-byte record"]
    assert read < tfevents.MAX_RECORD_BYTES  # the big one was never read


def test_a_huge_claimed_length_is_never_allocated(tmp_path):
    length = struct.pack("<Q", 2**62)
    path = tmp_path / "events.out.tfevents.x"
    path.write_bytes(length + struct.pack("<I", tfevents.masked_crc32c(length)) + b"tiny")
    fd = os.open(path, os.O_RDONLY)
    records, offset, _, read = tfevents.read_records(fd, 0, size=os.fstat(fd).st_size, budget=10**9)
    os.close(fd)
    assert records == [] and offset == 0 and read == 0  # waits (the file will never be that long)


def test_a_pass_steps_over_no_more_big_records_than_its_budget_allows(tmp_path):
    # A record over MAX_RECORD_BYTES is stepped over unread, but its header is still read and
    # checksummed: a sparse file of nothing but such headers (its holes take no room in the work
    # cap) held one pass, and the final drain before `exited`, for as long as the file was long.
    length = tfevents.MAX_RECORD_BYTES + 1
    header = struct.pack("<Q", length) + struct.pack("<I", tfevents.masked_crc32c(struct.pack("<Q", length)))
    stride, count = length + 16, 50_000
    path = tmp_path / "events.out.tfevents.sparse"
    with open(path, "wb") as f:
        for k in range(count):
            f.seek(k * stride)
            f.write(header)
        f.truncate(count * stride)
    fd = os.open(path, os.O_RDONLY)
    _, offset, dropped, read = tfevents.read_records(fd, 0, size=count * stride, budget=tfevents.MAX_READ_PER_POLL)
    os.close(fd)
    assert len(dropped) <= tfevents.MAX_READ_PER_POLL // 12 + 1 and offset < count * stride
    assert read >= tfevents.MAX_READ_PER_POLL


def test_skipped_records_cost_the_agent_log_a_line_per_file(tmp_path, caplog):
    # agent.log is on the platform's disk and no cap of the job's counts it: a line per bad record
    # (17 bytes each, named by a path of hundreds) wrote many times what the learner did.
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    root.mkdir()
    bad = bytearray(tfevents.frame(b"x"))
    bad[-1] ^= 0xFF
    (root / "events.out.tfevents.bad").write_bytes(bytes(bad) * 1000 + tfevents.frame(b"fine"))
    shipped = Shipped()
    tailer = shipped.tailer(root, [], state)
    with caplog.at_level("INFO", logger="learner_agent.tfevents"):
        tailer.drain()
    assert shipped.data() == [b"fine"] and tailer.skipped == 1000
    assert len(caplog.records) <= 1


def test_the_tailer_reads_each_run_and_continues_where_it_stopped(tmp_path):
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    train = root / "logs" / "tb" / "train"
    train.mkdir(parents=True)
    shipped = Shipped()
    tailer = shipped.tailer(root, ["logs", "tb"], state)
    assert tailer.poll() is False  # nothing yet
    path = train / "events.out.tfevents.1"
    path.write_bytes(tfevents.frame(b"a") + tfevents.frame(b"b")[:5])
    assert tailer.poll() is True
    assert [(r["file"], r["offset"]) for r in shipped.records] == [("train/events.out.tfevents.1", 0)]
    path.write_bytes(tfevents.frame(b"a") + tfevents.frame(b"b"))
    (root / "logs" / "tb" / "events.out.tfevents.2").write_bytes(tfevents.frame(b"c"))
    # A new agent (a restart) continues from the offsets the first one kept.
    again = Shipped()
    again.tailer(root, ["logs", "tb"], state).drain()
    assert [(r["file"], r["offset"], base64.b64decode(r["data"])) for r in again.records] == [
        ("events.out.tfevents.2", 0, b"c"), ("train/events.out.tfevents.1", len(tfevents.frame(b"a")), b"b")]
    assert json.loads((state / tfevents.OFFSETS_FILE).read_text())["offsets"] == {
        "events.out.tfevents.2": len(tfevents.frame(b"c")),
        "train/events.out.tfevents.1": len(tfevents.frame(b"a")) + len(tfevents.frame(b"b"))}


def test_the_tailer_follows_no_symlink_and_opens_no_fifo(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "events.out.tfevents.s").write_bytes(tfevents.frame(b"secret"))
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    tb_dir = root / "tb"
    tb_dir.mkdir(parents=True)
    (tb_dir / "run").symlink_to(secret)  # a run folder pointing elsewhere
    (tb_dir / "events.out.tfevents.link").symlink_to(secret / "events.out.tfevents.s")
    os.mkfifo(tb_dir / "events.out.tfevents.fifo")
    shipped = Shipped()
    tailer = shipped.tailer(root, ["tb"], state)
    tailer.drain()
    assert shipped.records == []
    # The folder itself swapped for a symlink: nothing is read through it either.
    os.rename(tb_dir, root / "old")
    (root / "tb").symlink_to(secret)
    assert tailer.poll() is False and shipped.records == []


def test_the_tailer_notes_a_corrupt_file_once_and_reads_the_others(tmp_path):
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    root.mkdir()
    (root / "events.out.tfevents.bad").write_bytes(b"this is not a TFRecord file at all")
    (root / "events.out.tfevents.good").write_bytes(tfevents.frame(b"fine"))
    shipped = Shipped()
    tailer = shipped.tailer(root, [], state)
    tailer.drain()
    tailer.drain()
    assert shipped.data() == [b"fine"]
    assert len(shipped.notices) == 1 and "events.out.tfevents.bad is not a TensorBoard event file past byte 0" \
        in shipped.notices[0]


def test_the_tailer_reads_at_most_max_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tfevents, "MAX_FILES", 3)
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    root.mkdir()
    for i in range(5):
        (root / f"events.out.tfevents.{i}").write_bytes(tfevents.frame(b"%d" % i))
    shipped = Shipped()
    shipped.tailer(root, [], state).drain()
    assert shipped.data() == [b"0", b"1", b"2"]
    assert len(shipped.notices) == 1 and "more than 3 TensorBoard event files" in shipped.notices[0]


def test_a_poll_looks_at_a_bounded_number_of_names_whatever_the_learner_leaves(tmp_path, monkeypatch):
    """A learner filling its folder with files made the agent (outside the learner's CPU quota) list and
    sort all of them every second."""
    monkeypatch.setattr(tfevents, "MAX_ENTRIES", 50)
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    (root / "run").mkdir(parents=True)
    for i in range(200):
        (root / "run" / f"junk-{i:03d}").touch()
    (root / "events.out.tfevents.1").write_bytes(tfevents.frame(b"kept"))
    listed = []
    real_scandir = os.scandir

    def counting_scandir(folder):
        listing = real_scandir(folder)

        class Counted:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                listing.close()

            def __iter__(self):
                for entry in listing:
                    listed.append(entry.name)
                    yield entry
        return Counted()
    monkeypatch.setattr(tfevents.os, "scandir", counting_scandir)
    shipped = Shipped()
    tailer = shipped.tailer(root, [], state)
    tailer.drain()
    assert shipped.data() == [b"kept"]  # the event file beside the crowded folder is read
    listed.clear()
    tailer.poll()
    assert len(listed) <= 50 + 2  # one name past the bound tells a folder holds more
    assert len(shipped.notices) == 1 and "more than 50 files and folders" in shipped.notices[0]


def test_the_final_read_stops_at_its_time_limit_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(tfevents, "MAX_READ_PER_POLL", 100)
    root, state = tmp_path / "state", tmp_path / "agent"
    state.mkdir()
    root.mkdir()
    (root / "events.out.tfevents.1").write_bytes(b"".join(tfevents.frame(b"x" * 50) for _ in range(20)))
    shipped = Shipped()
    shipped.tailer(root, [], state).drain(timeout=0)
    assert 0 < len(shipped.records) < 20
    assert len(shipped.notices) == 1 and "stopped reading" in shipped.notices[0]


@pytest.mark.parametrize("raw, root, parts", [
    ("$JOB_STATE_DIR/logs/tb", "/s", ["logs", "tb"]), ("${LOG_DIR}/tb/test", "/s", ["logs", "tb", "test"]),
    (None, "/s", ["logs", "tb"]), ("runs/./x/", "/w", ["runs", "x"])])
def test_it_reads_from_the_learners_own_folders_only(raw, root, parts):
    env = {"JOB_STATE_DIR": "/s", "LOG_DIR": "/s/logs"}
    assert tfevents.resolve_dir(raw, env=env, work_dir="/w") == (root, parts)


@pytest.mark.parametrize("raw", ["/etc", "$HOME/x", "a/../../b", "${PATH}", "a/$LOG_DIR"])
def test_it_refuses_folders_outside_them(raw):
    with pytest.raises(tfevents.PathError):
        tfevents.split_dir(raw)


# --- the agent as a real process ---

# A learner (standard library only) copying framed records from events.bin into its event file, each
# record in two writes with a pause between, so the agent often finds half a record.
WRITER = """
import os, struct, sys, time
data = open("events.bin", "rb").read()
folder = os.path.join(os.environ["LOG_DIR"], "tb", "train")
os.makedirs(folder, exist_ok=True)
out = open(os.path.join(folder, "events.out.tfevents.1.host"), "ab", buffering=0)
offset, pause = 0, float(sys.argv[1])
while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset:offset + 8])
    end = offset + 16 + length
    out.write(data[offset:offset + 10]); time.sleep(pause)
    out.write(data[offset + 10:end]); time.sleep(pause)
    offset = end
"""


def learner_config(outside_tmp, ingest, events, pause):
    state = os.path.join(outside_tmp, "job", "attempt-1", "learner-0", "state")
    return write_agent_config(
        outside_tmp, ingest, command=f"python3 writer.py {pause}", files={"writer.py": WRITER, "events.bin": events},
        tensorboard_dir="$LOG_DIR/tb",
        env={"TRAINYARD_JOB_ID": "training-test0001", "LEARNER_ID": "0", "JOB_STATE_DIR": state,
             "LOG_DIR": os.path.join(state, "logs")})


def framed(count):
    return b"".join(tfevents.frame(scalar_event("loss", i / 10, i).SerializeToString()) for i in range(count))


def event_records(ingest):
    return [r for r in ingest.stored() if r["kind"] == "tfevent"]


def test_the_agent_ships_every_event_before_exited(outside_tmp, ingest):
    config = learner_config(outside_tmp, ingest, framed(40), 0.001)
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    stored = ingest.stored()
    events = [r for r in stored if r["kind"] == "tfevent"]
    assert [event_pb2.Event.FromString(base64.b64decode(r["data"])).step for r in events] == list(range(40))
    assert all(r["file"] == "train/events.out.tfevents.1.host" for r in events)
    assert stored[-1]["state"] == "exited" and stored.index(events[-1]) < len(stored) - 1


def test_an_agent_restarted_mid_file_ships_each_record_exactly_once(outside_tmp, ingest):
    # The platform acks some records, then nothing: the agent is SIGKILLed with events spooled and
    # half a record in the file. A second agent delivers the spool and reads on from the kept offset.
    count = 400
    config = learner_config(outside_tmp, ingest, framed(count), 0.004)
    agent = subprocess.Popen(agent_command(config), env=agent_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(event_records(ingest)) > 20, timeout=30)
        ingest.status_override = 503
        time.sleep(1.5)  # the tailer spools more the platform does not ack
        agent.send_signal(signal.SIGKILL)
        agent.wait()
    finally:
        stop_process(agent)
    acked_before = len(event_records(ingest))
    ingest.status_override = None
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    events = event_records(ingest)
    path = os.path.join(outside_tmp, "job", "attempt-1", "learner-0", "state", "logs", "tb", "train",
                        "events.out.tfevents.1.host")
    in_file = list(RawEventFileLoader(path).Load())  # what tensorboard reads from the file as it was left
    assert len(events) > acked_before and len(in_file) < count  # the learner died mid-run, after the kill
    assert [base64.b64decode(r["data"]) for r in events] == in_file  # each once, in order, none missing
    offsets = [r["offset"] for r in events]
    assert offsets == sorted(set(offsets))
    assert ingest.stored()[-1]["exit_code"] == 137
