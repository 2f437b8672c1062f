"""Shipping a learner's TensorBoard event files to the platform while it runs (FfDL's
`evaluation_metrics: {type: tensorboard}`).

Where the parsing happens, and why: the agent stays standard-library only, so it knows only the
file format's framing, TFRecord (a length, its masked CRC-32C, the bytes, their masked CRC-32C),
which is a dozen lines and fully checked here. What is inside a record (an `Event` protobuf, a
`Summary` whose scalars come in three historical encodings: `simple_value`, a TF2 tensor with the
`scalars` plugin's metadata on the first write of a tag only, a `DATA_CLASS_SCALAR` tensor) is read on
the platform by the `tensorboard` package itself (`jobs.tensorboard`), the maintained reader, so
Trainyard reads exactly what TensorBoard would show. The agent ships each whole record, base64, as a
`tfevent` record numbered like every other (the ingest protocol, DEVELOPERS.md).

Exactly once: each file's read offset is kept in `tfevents.offsets` beside the spool and written
only after the records read up to it are in the spool (handed to the kernel, which is what surviving
the agent's death takes). An agent killed between the two reads those records again; the platform
drops a record whose offset in its file it has already stored, as it drops a seq it already has.

Hostile files cannot hurt the agent (it may run as root; the folder is the learner's): the folder is
walked from the learner's trusted root one component at a time without following a symlink, only
regular files are opened (never a FIFO or a device), at most MAX_FILES files MAX_DEPTH deep, a
record over MAX_RECORD_BYTES is stepped over unread (graphs and images; scalars are ~100 bytes), a
bad length checksum ends the file (nothing after it can be trusted) and a bad data checksum drops the
record; each problem gets one `system` line in the job's log.
"""
import base64
import itertools
import json
import logging
import os
import stat
import struct
import threading
import time

from learner_agent.files import read_json_object, write_atomically

log = logging.getLogger(__name__)

OFFSETS_FILE = "tfevents.offsets"
DEFAULT_DIR = "$LOG_DIR/tb"  # FfDL's convention; its manifests name "$JOB_STATE_DIR/logs/tb"
# Variables a manifest's `in` may start with: the learner's own state folder (jobs.lifecycle sets them).
ROOT_VARIABLES = ("JOB_STATE_DIR", "LOG_DIR")
EVENT_FILE_MARK = ".tfevents"  # TensorBoard reads files whose name contains it; so do we
MAX_FILES = 256
MAX_DEPTH = 4  # tb/<run>/<sub-run>/...: keras writes train/ and validation/, FfDL's example tb/test
# Names looked at per poll, in all the folders: the agent's own CPU is no learner's to spend, and a
# learner can fill its folder with a million files (a real run has a handful of event files).
MAX_ENTRIES = 10_000
MAX_RECORD_BYTES = 64 * 1024
# Bytes checksummed per pass. The CRC is pure Python and slow, so this bounds the CPU a pass takes
# beside the learner; scalar records are small, so it is still many of them.
MAX_READ_PER_POLL = 256 * 1024
POLL_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 60.0  # reading what is left once the learner ended, before `exited`
_HEADER = 12  # uint64 length + uint32 masked crc of it
_FOOTER = 4  # uint32 masked crc of the data


class PathError(ValueError):
    """An `evaluation_metrics.in` the agent will not read."""


def split_dir(raw):
    """(root variable or None for the working directory, [parts]) of a manifest's `in`.

    `$JOB_STATE_DIR/logs/tb`, `${LOG_DIR}/tb` and relative paths (`logs/tb`, under the learner's
    working directory) are accepted; absolute paths elsewhere, other variables and `..` are not: the
    agent reads only the learner's own folders."""
    text = (raw or DEFAULT_DIR).strip()
    root, rest = None, text
    if text.startswith("$"):
        head, _, rest = text[1:].partition("/")
        name = head[1:-1] if head.startswith("{") and head.endswith("}") else head
        if name not in ROOT_VARIABLES:
            raise PathError(f"{text!r} starts with ${name}; use $JOB_STATE_DIR, $LOG_DIR or a path relative "
                            "to the working directory")
        root = name
    elif text.startswith("/"):
        raise PathError(f"{text!r} is an absolute path; use $JOB_STATE_DIR/..., $LOG_DIR/... or a path "
                        "relative to the working directory")
    parts = [part for part in rest.split("/") if part not in ("", ".")]
    if ".." in parts or any("$" in part or "\0" in part for part in parts):
        raise PathError(f"{text!r} may not contain '..' or further variables")
    return root, parts


def resolve_dir(raw, *, env, work_dir):
    """(trusted root folder, [parts below it]) for the agent: the root exists and is the platform's
    choice; the parts are the learner's and are walked without following symlinks."""
    root, parts = split_dir(raw)
    if root is None:
        return work_dir, parts
    base = os.path.normpath(env.get(root) or "")
    if not os.path.isabs(base):
        raise PathError(f"${root} is not set for this learner")
    # LOG_DIR lies inside JOB_STATE_DIR, which the learner owns: it could swap logs/ for a symlink,
    # so the walk starts at JOB_STATE_DIR (its parent is the platform's) and takes logs/ as a part.
    state = os.path.normpath(env.get("JOB_STATE_DIR") or "")
    if root != "JOB_STATE_DIR" and os.path.isabs(state) and base.startswith(state + os.sep):
        return state, [*os.path.relpath(base, state).split(os.sep), *parts]
    return base, parts


# --- the TFRecord framing ---

def _crc32c_table():
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    """TFRecord's checksum: CRC-32C rotated and offset, so a CRC of data holding CRCs stays strong."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data):
    """One TFRecord holding `data` (tests write event files with it)."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


class CorruptFile(Exception):
    """A record's length fails its checksum: nothing after `offset` can be framed."""

    def __init__(self, offset):
        super().__init__(f"the record length at byte {offset} fails its checksum")
        self.offset = offset


def read_records(fd, offset, *, size, budget):
    """Whole records from `offset` of an open file of `size` bytes, checksummed.

    Returns (records [(offset, data)], next offset, dropped [(offset, why)], bytes read). Stops at an
    incomplete record (the learner is still writing it) or once `budget` bytes were read; a record
    over MAX_RECORD_BYTES is stepped over without reading it. Raises CorruptFile."""
    records, dropped, read = [], [], 0
    while size - offset >= _HEADER and read < budget:
        header = os.pread(fd, _HEADER, offset)
        if len(header) < _HEADER:
            break
        length_bytes, (length_crc,) = header[:8], struct.unpack("<I", header[8:])
        if masked_crc32c(length_bytes) != length_crc:
            raise CorruptFile(offset)
        (length,) = struct.unpack("<Q", length_bytes)
        end = offset + _HEADER + length + _FOOTER
        if end > size:
            break  # not all written yet
        if length > MAX_RECORD_BYTES:
            dropped.append((offset, f"a {length}-byte record (over {MAX_RECORD_BYTES}: not a scalar)"))
            offset = end
            read += _HEADER  # its header was read: a file of nothing else must not hold the pass
            continue
        body = os.pread(fd, length + _FOOTER, offset + _HEADER)
        read += _HEADER + len(body)
        if len(body) < length + _FOOTER:
            break  # the file shrank under us; the next pass sees it
        data, (data_crc,) = body[:length], struct.unpack("<I", body[length:])
        if masked_crc32c(data) != data_crc:
            dropped.append((offset, "a record whose data fails its checksum"))
        else:
            records.append((offset, data))
        offset = end
    return records, offset, dropped, read


# --- the folder ---

class EventFileTailer:
    """Reads new records from the event files under one folder and hands them to `ship`.

    `ship(records)` must put the records into the spool before it returns (Shipper.add_many with
    `spool_now`); `notice(text)` writes a `system` line. `poll()` is one pass, `drain()` reads
    everything there is (before `exited`), `run(stop)` polls every POLL_INTERVAL_S until `stop` is set.
    """

    def __init__(self, root, parts, *, state_dir, ship, notice):
        self._root, self._parts = root, list(parts)
        self._offsets_path = os.path.join(state_dir, OFFSETS_FILE)
        self._ship, self._notice = ship, notice
        self._lock = threading.Lock()  # one pass at a time (the timer's thread and the final drain)
        # relative path -> the offset reading continues from; the files not read further (corrupt, shrunk)
        self._offsets, self._ended = _read_state(self._offsets_path)
        self._too_many_noted = False
        self._crowded_noted = False
        self.skipped = 0  # records stepped over or dropped
        self._skipping = set()  # the files whose first skipped record agent.log names

    @property
    def label(self):
        return "/".join([self._root, *self._parts])

    def run(self, stop):
        while not stop.wait(POLL_INTERVAL_S):
            try:
                self.poll()
            except Exception:  # a bug here must never cost the learner its run
                log.exception("reading the TensorBoard event files failed")

    def drain(self, timeout=None):
        """Read until a pass finds nothing new (the learner has ended: the files no longer grow), for at
        most `timeout` seconds (DRAIN_TIMEOUT_S): a flood of event data must not hold `exited` back."""
        deadline = time.monotonic() + (DRAIN_TIMEOUT_S if timeout is None else timeout)
        while self.poll():
            if time.monotonic() > deadline:
                self._notice(f"TensorBoard: stopped reading {self.label} after {DRAIN_TIMEOUT_S:.0f}s once the "
                             "learner had ended; the rest of its event files is not read")
                return

    def poll(self):
        """One pass over the folder; returns True when it read anything (more may be left)."""
        with self._lock:
            folder = self._open_folder()
            if folder is None:
                return False
            try:
                files = self._event_files(folder, seen=[0])
            finally:
                os.close(folder)
            budget, progressed = MAX_READ_PER_POLL, False
            for relative, fd in files:
                try:
                    if budget > 0:
                        used, moved = self._read_file(relative, fd, budget)
                        budget -= used
                        progressed = progressed or moved
                finally:
                    os.close(fd)
            return progressed

    def _open_folder(self):
        """A descriptor of the folder, reached from the trusted root without following a symlink;
        None while it does not exist (the learner has not written yet)."""
        try:
            fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        for part in self._parts:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                os.close(fd)
                return None
            os.close(fd)
            fd = child
        return fd

    def _event_files(self, folder, prefix="", depth=0, *, seen):
        """[(relative path, open descriptor)] of the regular event files below `folder`, sorted, among
        the first MAX_ENTRIES names of the poll (`seen`: [names looked at so far])."""
        found, room = [], MAX_ENTRIES - seen[0]
        if room <= 0:
            return found
        try:
            with os.scandir(folder) as listing:
                entries = sorted(itertools.islice(listing, room + 1), key=lambda e: e.name)
        except OSError:
            return found
        if len(entries) > room:
            entries = entries[:room]
            if not self._crowded_noted:
                self._crowded_noted = True
                self._notice(f"more than {MAX_ENTRIES} files and folders under {self.label}; only some are "
                             "looked at for TensorBoard event files")
        seen[0] += len(entries)
        for entry in entries:
            relative = f"{prefix}{entry.name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    if depth + 1 < MAX_DEPTH:
                        sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      dir_fd=folder)
                        try:
                            found += self._event_files(sub, f"{relative}/", depth + 1, seen=seen)
                        finally:
                            os.close(sub)
                    continue
                if EVENT_FILE_MARK not in entry.name or relative in self._ended:
                    continue
                if relative not in self._offsets:
                    if len(self._offsets) >= MAX_FILES:
                        if not self._too_many_noted:
                            self._too_many_noted = True
                            self._notice(f"more than {MAX_FILES} TensorBoard event files under {self.label}; "
                                         f"{relative} and later new ones are not read")
                        continue
                    self._offsets[relative] = 0  # counted from now on, saved with the first records
                # O_NONBLOCK: a FIFO planted here must not hang the agent; fstat then refuses it.
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=folder)
            except OSError:
                continue  # a symlink (ELOOP), gone, unreadable: not ours to read
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                continue
            found.append((relative, fd))
        return found

    def _read_file(self, relative, fd, budget):
        """Ship what is new in one file; returns (bytes read, whether the offset moved)."""
        offset = self._offsets.get(relative, 0)
        size = os.fstat(fd).st_size
        if size < offset:
            self._end(relative, f"{relative} shrank below byte {offset} (rewritten?); not read further")
            return 0, False
        try:
            records, new_offset, dropped, used = read_records(fd, offset, size=size, budget=budget)
        except CorruptFile as e:
            self._end(relative, f"{relative} is not a TensorBoard event file past byte {e.offset} ({e}); "
                                "not read further")
            return 0, False
        # agent.log is on the platform's disk, outside every cap of the job's: the first record
        # skipped in each file is named there, the rest counted (and summed as the learner ends).
        for at, why in dropped:
            if relative not in self._skipping:
                self._skipping.add(relative)
                log.info("tfevents: %s byte %d: skipped %s (later ones in this file only counted)",
                         relative, at, why)
            self.skipped += 1
        if new_offset == offset:
            return used, False
        if records:
            self._ship([{"kind": "tfevent", "file": relative, "offset": at,
                         "data": base64.b64encode(data).decode("ascii")} for at, data in records])
        # Only now: the records are in the spool, so a later agent never skips one.
        self._offsets[relative] = new_offset
        self._save()
        return used, True

    def _end(self, relative, text):
        self._ended.add(relative)
        self._save()
        self._notice(f"TensorBoard: {text}")

    def _save(self):
        write_atomically(self._offsets_path, json.dumps({"offsets": self._offsets, "ended": sorted(self._ended)}))


def _read_state(path):
    """(offsets, ended) as saved by _save; none of either from a missing or damaged file."""
    data = read_json_object(path) or {}
    return ({k: v for k, v in (data.get("offsets") or {}).items() if isinstance(v, int) and v >= 0},
            {e for e in (data.get("ended") or []) if isinstance(e, str)})
