"""TensorBoard scalars from the event records learner agents ship (`evaluation_metrics: {type: tensorboard}`).

The agent frames and checksums the learner's event files (learner_agent.tfevents says why it stops
there); what a record means is read here, by the `tensorboard` package itself: its `Event` proto, its
`data_compat` (old `simple_value` summaries become tensors with the scalars plugin's metadata) and its
`tensor_util`. A time series is a scalar when the first value of its tag says so (plugin `scalars` or
`DATA_CLASS_SCALAR`): TF2 writers put the metadata on a tag's first value only, so what each run's tags
are is kept per learner (`Learner.ingest_state`), as TensorBoard keeps it per run.

Exactly once: a record's offset in its file is stored per file; one at or below it is a resend (an
agent restarted between spooling records and noting how far it had read) and is dropped.

Hostile records cost little and break nothing: each is at most MAX_RECORD_BYTES, a record that is not
an Event is dropped with a note in the job's log (at most MAX_NOTES per learner), a tensor is decoded
only when its shape holds one element, an event gives at most one value per tag (a writer repeating
a tag thousands of times in one event made a point of each), a tag or run whose name is not
printable is passed over as a metric record's name is refused (jobs.ingest_records), and the files
and tags (and their length) remembered per learner are bounded. The points themselves are capped
with the learner's other metric points (jobs.logcap.MetricMeter).
"""
import base64
import binascii
import math
from dataclasses import dataclass

from learner_agent import tfevents

MAX_RECORD_BYTES = tfevents.MAX_RECORD_BYTES
MAX_FILES = tfevents.MAX_FILES
MAX_TAGS = 2000  # per learner, over all its runs
MAX_NOTES = 20  # per learner: a broken writer must not flood the log
MAX_PATH = 512
MAX_TAG = 200  # characters; longer tags are not read (and not remembered: the JSON stays small)


class MalformedEvent(ValueError):
    """A record that is not a TensorBoard event; the message says why."""


@dataclass(frozen=True)
class Scalar:
    name: str  # "<run>/<tag>", or the tag for files directly in the folder
    step: int
    value: float
    wall_time: float


class LearnerEvents:
    """One learner's event records, applied in seq order under its row lock; `state` is the
    JSON kept in Learner.ingest_state (which holds the learner's other ingest counts beside it) and is
    updated in place."""

    def __init__(self, state):
        for key, value in {"offsets": {}, "tags": {}, "notes": 0}.items():
            state.setdefault(key, value)
        self.state = state
        self.changed = False

    def scalars(self, record):
        """The scalars in one `tfevent` record ([] for a resend or a non-scalar event). Raises
        MalformedEvent for a record that is not one (the caller notes it)."""
        path, offset, data = _fields(record)
        offsets = self.state["offsets"]
        if path in offsets and offset <= offsets[path]:
            return []
        if path not in offsets and len(offsets) >= MAX_FILES:
            raise MalformedEvent(f"{path}: more than {MAX_FILES} event files; not read")
        offsets[path] = offset
        self.changed = True
        run = path.rpartition("/")[0]
        if not run.isprintable():
            return []
        tags = self.state["tags"]
        try:
            decoded = decode(data, tags.setdefault(run, {}), room=MAX_TAGS - sum(map(len, tags.values())))
        except MalformedEvent as e:
            raise MalformedEvent(f"{path} byte {offset}: {e}; skipped") from None
        return [Scalar(name=f"{run}/{tag}" if run else tag, step=step, value=value, wall_time=wall_time)
                for tag, step, value, wall_time in decoded]

    def note(self, text):
        """The `system` log line for a dropped record, or None once MAX_NOTES were written."""
        if self.state["notes"] >= MAX_NOTES:
            return None
        self.state["notes"] += 1
        self.changed = True
        more = "" if self.state["notes"] < MAX_NOTES else f" (the last such note of the {MAX_NOTES} shown)"
        return f"TensorBoard: {text}{more}"


def decode(data, tags, *, room=MAX_TAGS):
    """[(tag, step, value, wall time)] of the scalar values in one serialized Event.

    `tags` ({tag: is a scalar}) is the run's memory of its tags' first metadata; new tags are added
    while `room` allows."""
    from google.protobuf.message import DecodeError
    from tensorboard import data_compat
    from tensorboard.compat.proto import event_pb2

    try:
        event = event_pb2.Event.FromString(data)
    except (DecodeError, RecursionError, ValueError) as e:
        raise MalformedEvent(f"not an Event protobuf ({e or type(e).__name__})") from None
    if event.WhichOneof("what") != "summary":
        return []
    event = data_compat.migrate_event(event)
    found, seen = [], set()
    for value in event.summary.value:
        # isprintable: as a metric record's name (no NUL either, which PostgreSQL stores in no name or JSON key).
        if len(value.tag) > MAX_TAG or not value.tag.isprintable() or value.tag in seen:
            continue
        seen.add(value.tag)
        scalar = tags.get(value.tag)
        if scalar is None:
            if room <= 0:
                continue
            scalar = tags[value.tag] = _declares_scalar(value.metadata)
            room -= 1
        number = _scalar_of(value) if scalar else None
        if number is not None and value.tag:
            found.append((value.tag, event.step, number, event.wall_time))
    return found


def _declares_scalar(metadata):
    from tensorboard.compat.proto import summary_pb2

    return (metadata.data_class == summary_pb2.DATA_CLASS_SCALAR
            or metadata.plugin_data.plugin_name == "scalars")


def _scalar_of(value):
    """The value's one finite number, or None. The shape is checked before tensor_util sees it: a
    claimed shape of 10^9 x 10^9 with one element would otherwise be expanded to it."""
    from tensorboard.util import tensor_util

    if not value.HasField("tensor"):
        return None
    tensor = value.tensor
    if any(dim.size != 1 for dim in tensor.tensor_shape.dim) or len(tensor.tensor_content) > 16:
        return None
    try:
        array = tensor_util.make_ndarray(tensor)
        number = float(array.reshape(-1)[0]) if array.size == 1 else None
    except (TypeError, ValueError, IndexError, KeyError, OverflowError):
        return None
    return number if number is not None and math.isfinite(number) else None


def _utf8(text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fields(record):
    path, offset, data = record.get("file"), record.get("offset"), record.get("data")
    # Text PostgreSQL can keep as a key of the learner's JSON: no NUL, no lone surrogate (a file name
    # that is not UTF-8, read by the agent with surrogateescape).
    if not isinstance(path, str) or not path or len(path) > MAX_PATH or "\x00" in path or not _utf8(path):
        raise MalformedEvent(f"a tfevent record needs its file's path: at most {MAX_PATH} characters of UTF-8, "
                             "no NUL")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise MalformedEvent(f"{path}: a tfevent record needs its offset in the file")
    if not isinstance(data, str) or len(data) > 4 * (MAX_RECORD_BYTES // 3 + 1):
        raise MalformedEvent(f"{path} byte {offset}: a record's data must be base64 of at most "
                             f"{MAX_RECORD_BYTES} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedEvent(f"{path} byte {offset}: the record's data is not base64") from None
    return path, offset, raw
