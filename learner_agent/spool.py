"""The agent's records on disk until the platform has acked them, so an agent crash loses none.

Layout (inside the agent's private folder, `learner-<i>/spool/`, mode 0700, files 0600):
- segments `<first seq, 16 digits>.seg`: the encoded records (`{"seq":N,...}`), one per line, in seq
  order and without gaps. JSON never holds a raw newline, so a line is a record; a torn last line
  (the agent killed mid-write) is cut off when the spool is opened again.
- `acked`: the highest seq the platform has acked, rewritten (write + rename) on each ack. A stale
  value only means resending records the platform drops as duplicates; it matters for numbering
  once the segments holding the last records are deleted, so it is written before any deletion.

A segment is deleted whole once every record in it is acked; the one being written is closed at
`segment_bytes` and a new one started. The bound (`max_bytes`) counts every segment on disk plus what
is still buffered; the shipper asks `has_room` before it adds output (see Shipper.wait_for_room).

Durability: `append` only buffers. `flush` hands the buffer to the kernel (one write), which is all
surviving an agent SIGKILL takes; the shipper flushes before it reads each batch back (so nothing
is ever sent that is not in the file: a restarted agent can never reuse an acked seq), and its
flusher within FLUSH_INTERVAL_S of any add (it sleeps while nothing is added). `sync` (fsync) only
guards against the machine itself going down; it runs at most once a second off the hot path,
because an fsync per batch would cap ingest at the disk's flush rate while the learner dies with
the machine anyway.

A write the disk refuses (full) loses nothing and breaks nothing: the file keeps only the whole
records that went, the rest stays buffered for the next flush (the shipper retries with backoff),
and `write_error` says so; meanwhile `append` still takes records (into memory: `has_room` bounds
that to MAX_UNWRITTEN_BYTES, so the learner is held back beyond it) and never starts a segment.
"""
import bisect
import contextlib
import json
import logging
import os
import shutil
import tempfile

from learner_agent.files import write_atomically

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 2**20
SEGMENT_SUFFIX = ".seg"
CURSOR = "acked"
WRITE_BUFFER_BYTES = 256 * 1024  # flushed at once beyond this, whatever the timer says
MAX_UNWRITTEN_BYTES = 16 * WRITE_BUFFER_BYTES  # held in memory while the disk refuses writes


class SpoolError(RuntimeError):
    """The spool cannot be used (unreadable folder, a segment that contradicts the others)."""


class Spool:
    """`anonymous`: segments have no name from the moment they exist, so nothing sharing the agent's
    uid can write into them (on Kubernetes the learner does, and sees the agent's folder); nothing
    survives the agent then, which is right where nothing ever starts an agent again."""

    def __init__(self, directory, *, max_bytes=DEFAULT_MAX_BYTES, segment_bytes=None, anonymous=False):
        self.directory = directory
        self.anonymous = anonymous
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or min(16 * 2**20, max(64 * 1024, max_bytes // 16))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self._segments = []  # first seqs, ascending; the last one is being written
        self._sizes = {}  # first seq -> bytes in the file (flushed)
        self._fds = {}  # first seq -> an open descriptor (read with pread, written at its end)
        self._buffer = bytearray()
        self._fd = None  # the segment being written
        self._unsynced = False
        self.write_error = None  # the OSError of the last flush while the disk refuses writes
        self._batch = None  # (segment, offset, first seq, line lengths) of the last read()
        self.torn_bytes = 0  # cut off the last segment when opened: a write a killed agent left half done
        self.acked = 0 if anonymous else _read_cursor(directory)
        self.last_seq = self.acked if anonymous else self._recover()

    # --- opening ---

    def _recover(self):
        """Find the segments, cut a torn tail off the last one; returns the highest seq spooled."""
        firsts = _segment_firsts(self.directory)
        self._segments = firsts
        for first in firsts:
            self._fds[first] = os.open(self._path(first), os.O_RDWR | os.O_APPEND)
            self._sizes[first] = os.fstat(self._fds[first]).st_size
        if not firsts:
            return self.acked
        last = firsts[-1]
        count = self._cut_torn_tail(last)
        if count == 0 and len(firsts) > 1:
            self._drop_segment(self._segments.pop())  # nothing whole in it: as if never started
            return max(self.acked, last - 1)
        return max(self.acked, last + count - 1)

    def _cut_torn_tail(self, first):
        """Keep the whole records of segment `first` that continue its seqs; returns how many."""
        path = self._path(first)
        data = os.pread(self._fds[first], self._sizes[first], 0)
        # A torn write leaves a prefix of what was written: the part after the last newline. After
        # the machine itself went down a file may also end in zeros; the seqs catch those.
        good, count = 0, 0
        while (end := data.find(b"\n", good)) >= 0 and _seq_of(data[good:end]) == first + count:
            good, count = end + 1, count + 1
        if count and not _is_json(data[data.rfind(b"\n", 0, good - 1) + 1:good - 1]):
            good, count = data.rfind(b"\n", 0, good - 1) + 1, count - 1
        if good != len(data):
            self.torn_bytes = len(data) - good
            log.warning("spool segment %s: cutting %d bytes after record %d (a write the agent did not "
                        "finish)", os.path.basename(path), len(data) - good, first + count - 1)
            os.ftruncate(self._fds[first], good)
            self._sizes[first] = good
        return count

    # --- writing ---

    def append(self, records):
        """Buffer encoded records [(seq, body)]; seqs must continue the spool's without a gap."""
        for seq, body in records:
            if seq != self.last_seq + 1:
                raise SpoolError(f"record {seq} does not continue the spool at {self.last_seq}")
            # While writes fail, no new segment: starting one needs the buffer written first.
            if self._fd is None or (self._current_size() >= self.segment_bytes and self.write_error is None):
                try:
                    self._start_segment(seq)
                except OSError as e:
                    if self._fd is None:  # nowhere to put them; only ever the first record: none taken
                        raise
                    log.warning("spool: cannot start a new segment (%s); the current one grows on", e)
            self._buffer += body
            self._buffer += b"\n"
            self.last_seq = seq
        if len(self._buffer) >= WRITE_BUFFER_BYTES and self.write_error is None:
            with contextlib.suppress(OSError):  # taken all the same: buffered, and written by a later flush
                self.flush()

    def _current_size(self):
        return self._sizes[self._segments[-1]] + len(self._buffer)

    def _start_segment(self, first):
        """Raises before changing anything but the flush, so a failure leaves the current one in use."""
        self.flush()
        if self._fd is not None and self._unsynced:
            self._unsynced = False  # not retried: after a failed fsync the kernel has no error to report
            os.fsync(self._fd)  # once per segment; the timer only syncs the one being written
        if self._segments and self._segments[-1] == first:  # an empty one from before a restart
            self._fd = self._fds[first]
            return
        fd = self._create(first)
        if self._segments and self._sizes[self._segments[-1]] == 0:
            self._drop_segment(self._segments.pop())  # an empty segment from before a restart
        self._segments.append(first)
        self._sizes[first] = 0
        self._fds[first] = self._fd = fd

    def _create(self, first):
        if not self.anonymous:
            return os.open(self._path(first), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:  # a file that never has a name
            return os.open(self.directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except (AttributeError, OSError):  # a filesystem without O_TMPFILE: nameless at once
            fd, path = tempfile.mkstemp(dir=self.directory, suffix=".spool")
            os.unlink(path)
            return fd

    def _drop_segment(self, first):
        os.close(self._fds.pop(first))
        del self._sizes[first]
        if not self.anonymous:
            os.unlink(self._path(first))

    def flush(self):
        """Hand the buffered records to the kernel: from now on they outlive this process."""
        if not self._buffer:
            return
        segment, written = self._segments[-1], 0
        try:
            # Views released even on an error (a traceback may keep the slice): while one exists
            # the buffer cannot be resized, and every later append would fail.
            with memoryview(self._buffer) as view:
                while written < len(view):
                    with view[written:] as rest:
                        written += os.write(self._fd, rest)
        except OSError as e:
            # A short write and then an error (a full disk): cut the file back to the last whole
            # record that went (truncating frees space, it takes none), so it only ever holds whole
            # records; the rest stays buffered and the next flush writes on from there, none twice.
            self.write_error = e
            whole = self._buffer.rfind(b"\n", 0, written) + 1
            if whole < written:
                os.ftruncate(self._fd, self._sizes[segment] + whole)
                written = whole
            raise
        finally:
            self._sizes[segment] += written
            del self._buffer[:written]
            self._unsynced = self._unsynced or written > 0
        self.write_error = None

    def dup_for_sync(self):
        """A descriptor of the segment being written to fsync without holding up writers, or None
        when nothing was written since the last one (the caller closes it)."""
        if not self._unsynced or self._fd is None:
            return None
        self._unsynced = False
        return os.dup(self._fd)

    # --- bound ---

    def has_room(self, nbytes):
        if self.write_error is not None and len(self._buffer) + nbytes > MAX_UNWRITTEN_BYTES:
            return False  # the disk refuses writes: hold output back rather than grow in memory
        return sum(self._sizes.values()) + len(self._buffer) + nbytes <= self.max_bytes

    # --- reading back and acking ---

    def read(self, after, *, max_records, max_bytes):
        """The flushed records after seq `after`, [(seq, body)], within the limits (at least one)."""
        target = after + 1
        if target > self.last_seq or not self._segments:
            return []
        segment = self._segment_of(target)
        if segment is None:
            raise SpoolError(f"record {target} is not in the spool (it starts at {self._segments[0]})")
        offset = self._offset_of(segment, target)
        end, fd = self._sizes[segment], self._fds[segment]
        data = os.pread(fd, min(max_bytes, end - offset), offset)
        cut = data.rfind(b"\n")
        if cut < 0 and offset + len(data) < end:  # one record longer than max_bytes: send it whole
            data = os.pread(fd, end - offset, offset)
            cut = data.find(b"\n")
        if cut < 0:
            return []
        lines = data[:cut].split(b"\n")[:max_records]
        self._batch = (segment, offset, target, [len(line) + 1 for line in lines])
        return [(target + i, line) for i, line in enumerate(lines)]

    def _segment_of(self, seq):
        index = bisect.bisect_right(self._segments, seq) - 1
        return self._segments[index] if index >= 0 else None

    def _offset_of(self, segment, seq):
        """Where record `seq` starts in `segment`: from the last batch when it is in (or right after)
        it, else by counting lines (after a restart, or an ack that went backwards)."""
        if self._batch is not None:
            batch_segment, offset, first, lengths = self._batch
            if batch_segment == segment and first <= seq <= first + len(lengths):
                return offset + sum(lengths[:seq - first])
        data = os.pread(self._fds[segment], self._sizes[segment], 0)
        offset = 0
        for _ in range(seq - segment):
            offset = data.index(b"\n", offset) + 1
        return offset

    def ack(self, seq):
        """The platform has everything up to `seq`: remember it, delete the segments it completes."""
        if seq <= self.acked:
            return
        self.acked = seq
        if seq > self.last_seq:  # the platform has seqs we lost: number on after them, in a new segment
            try:
                self.flush()
            except OSError:  # the platform has these already; the file need not
                self._buffer.clear()
            self.last_seq = seq
            self._fd = None  # the next record starts a segment of its own
        if not self.anonymous:
            try:
                write_atomically(os.path.join(self.directory, CURSOR), f"{seq}\n")
            except OSError as e:  # a full disk: delete nothing until a later ack's cursor is written
                log.warning("spool: cannot write the acked cursor (%s); acked segments kept for now", e)
                return
        while len(self._segments) > 1 and self._segments[1] - 1 <= seq:
            self._drop_segment(self._segments.pop(0))

    def close(self):
        try:
            self.flush()
        except OSError as e:  # never sent (only the file is read back), so a later agent reuses their seqs
            log.error("spool: %d bytes of records the disk refused are lost (%s)", len(self._buffer), e)
            self._buffer.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._fd = None

    def destroy(self):
        """Everything in it is delivered (or can never be): remove the folder."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- what a restarted agent wants to know ---

    def last_record(self):
        """The last spooled record as a dict, or None (nothing spooled, or all of it deleted)."""
        self.flush()
        if not self._segments or self.last_seq < self._segments[-1]:
            return None
        segment = self._segments[-1]
        data = os.pread(self._fds[segment], self._sizes[segment], 0)
        start = data.rfind(b"\n", 0, len(data) - 1) + 1
        return json.loads(data[start:-1])

    def _path(self, first):
        return _segment_path(self.directory, first)


def has_undelivered(directory):
    """Whether a spool folder holds records its cursor does not cover; read-only, for whoever
    decides to start an agent again (the local backend)."""
    try:
        firsts = _segment_firsts(directory)
    except OSError:
        return False
    if not firsts:
        return False
    with open(_segment_path(directory, firsts[-1]), "rb") as f:
        last = firsts[-1] + f.read().count(b"\n") - 1
    return last > _read_cursor(directory)


def _segment_firsts(directory):
    return sorted(int(name[:-len(SEGMENT_SUFFIX)]) for name in os.listdir(directory)
                  if name.endswith(SEGMENT_SUFFIX) and name[:-len(SEGMENT_SUFFIX)].isdigit())


def _segment_path(directory, first):
    return os.path.join(directory, f"{first:016d}{SEGMENT_SUFFIX}")


def _read_cursor(directory):
    try:
        with open(os.path.join(directory, CURSOR), encoding="ascii") as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as e:
        log.warning("spool cursor unreadable (%s); resending from the oldest spooled record", e)
        return 0


def _seq_of(line):
    if not line.startswith(b'{"seq":'):
        return None
    end = line.find(b",", 7)
    if end < 0:
        end = line.find(b"}", 7)
    try:
        return int(line[7:end])
    except ValueError:
        return None


def _is_json(line):
    try:
        json.loads(line)
        return True
    except ValueError:
        return False
