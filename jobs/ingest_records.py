"""What each field of an ingest record may hold (DEVELOPERS.md, "The ingest protocol"). Django-free.

`problem(record)` names what is wrong with one record, or returns None. jobs.ingest stores the
records of a batch that have none, refuses the others by name in its answer, and acks past them
either way: one bad record (a metric with `"step": 1e300` made every post of its learner fail with
an OverflowError, so nothing more of it was stored and the job never ended) must cost that record
only, never the rest of the batch or of the job.

Every bound is the storage's own, so a record that passes can always be written: steps are the
BigIntegerField's int64, exit codes the IntegerField's int32, times what a datetime (and a
PostgreSQL timestamptz) holds, names and reasons their columns' lengths. Anything a stored record
cannot be is refused rather than coerced, with two exceptions: a log line's length is jobs.logcap's
(LOG_MAX_LINE_BYTES: longer is cut and marked there; the agent already cuts at 64 KiB of bytes,
learner_agent.learner), and a reason longer than MAX_REASON is cut.
"""
import sys

MAX_REASON = 2000  # characters of an exit reason; longer is cut
MAX_NAME = 100  # MetricPoint.name
INT64 = (-2**63, 2**63 - 1)  # MetricPoint.step: BigIntegerField
INT32 = (-2**31, 2**31 - 1)  # Learner.exit_code: IntegerField
# Unix seconds: 1970-01-01 up to the end of year 9999, the last a datetime can hold.
MAX_TIME = 253402300799.0
AGENT_STREAMS = ("stdout", "stderr", "system")
STATES = ("preparing", "running", "exited")
# `tfevent`: one record of a TensorBoard event file (learner_agent.tfevents, jobs.tensorboard), whose
# own fields jobs.tensorboard checks (a malformed one is noted in the job's log there).
# `resource`: what the learner used (learner_agent.telemetry), stored as a ResourceSample.
KINDS = ("log", "metric", "status", "tfevent", "resource")
MAX_GPUS = 64  # GPUs in one resource sample: more than any machine gives one learner
MAX_CORES = 100_000.0  # CPU cores of one learner: beyond any machine, so only nonsense is refused
GPU_NUMBERS = {"utilization": 100.0, "power_watts": 1_000_000.0}  # what each may be at most
GPU_BYTES = ("memory_used_bytes", "memory_total_bytes", "learner_memory_bytes")
_MAX_FLOAT = sys.float_info.max  # an int beyond it (JSON has no limit) is no float either


def problem(record, *, text_checked=True):
    """What is wrong with `record` (a dict with a valid seq), as "field: what it must be"; None if nothing.

    `text_checked`: its strings are known to be valid UTF-8 (orjson refuses a body with lone
    surrogates, so only a batch read by the lenient fallback, jobs.ingest.decode, needs them checked)."""
    kind = record.get("kind")
    if kind not in KINDS:
        return f"kind: must be one of {', '.join(KINDS)}"
    if (wrong := _time_problem(record.get("time"))) is not None:
        return wrong
    if kind == "log":
        line = record.get("line", "")
        if type(line) is not str:
            return "line: must be a string"
        if not text_checked and not _utf8(line):
            return "line: must be valid UTF-8 text"
        return None
    if kind == "metric":
        return _metric_problem(record)
    if kind == "status":
        return _status_problem(record, text_checked)
    if kind == "resource":
        return _resource_problem(record)
    return None


def _time_problem(value):
    # Absent: the platform's clock (the agent always sends one; an old or hand-made record may not).
    if value is None:
        return None
    if not _number(value) or not 0 <= value <= MAX_TIME:  # also refuses NaN: no comparison holds
        return f"time: must be Unix seconds between 0 and {MAX_TIME:.0f}"
    return None


def _metric_problem(record):
    name = record.get("name")
    if type(name) is not str or not name or len(name) > MAX_NAME or not name.isprintable():
        # isprintable: no control, format (bidi overrides), separator-but-space or surrogate characters.
        return f"name: must be 1 to {MAX_NAME} printable characters"
    value = record.get("value")
    if not _number(value) or not -_MAX_FLOAT <= value <= _MAX_FLOAT:  # NaN fails every comparison
        return "value: must be a finite number (NaN and infinities are refused)"
    if (wrong := _integer_problem(record.get("step"), INT64, "step", optional=True)) is not None:
        return wrong
    return None


def _status_problem(record, text_checked):
    state = record.get("state")
    if state not in STATES:
        return f"state: must be one of {', '.join(STATES)}"
    if state != "exited":
        return None
    if (wrong := _integer_problem(record.get("exit_code"), INT32, "exit_code", optional=True)) is not None:
        return wrong
    reason = record.get("reason")
    if reason is not None and type(reason) is not str:
        return "reason: must be a string"
    if reason and not text_checked and not _utf8(reason):
        return "reason: must be valid UTF-8 text"
    return None


def _resource_problem(record):
    cores = record.get("cpu_cores")
    if not _number(cores) or not 0 <= cores <= MAX_CORES:
        return f"cpu_cores: must be a number between 0 and {MAX_CORES:.0f}"
    for field in ("memory_bytes", "memory_peak_bytes", "memory_limit_bytes"):
        optional = field == "memory_limit_bytes"
        if (wrong := _integer_problem(record.get(field), (0, INT64[1]), field, optional=optional)) is not None:
            return wrong
    gpus = record.get("gpus", [])
    if type(gpus) is not list or len(gpus) > MAX_GPUS:
        return f"gpus: must be a list of at most {MAX_GPUS} GPUs"
    for position, gpu in enumerate(gpus):
        if (wrong := _gpu_problem(gpu)) is not None:
            return f"gpus[{position}].{wrong}"
    return None


def _gpu_problem(gpu):
    """What is wrong with one GPU of a resource sample (its field name first), or None."""
    if type(gpu) is not dict:
        return "index: each GPU must be an object with an index"
    if (wrong := _integer_problem(gpu.get("index"), (0, MAX_GPUS - 1), "index", optional=False)) is not None:
        return wrong
    for field, most in GPU_NUMBERS.items():
        value = gpu.get(field)
        if value is not None and (not _number(value) or not 0 <= value <= most):
            return f"{field}: must be null or a number between 0 and {most:.0f}"
    for field in GPU_BYTES:
        if (wrong := _integer_problem(gpu.get(field), (0, INT64[1]), field, optional=True)) is not None:
            return wrong
    return None


def resource_gpus(record):
    """The GPUs of a resource record that passed `problem`, with only the fields a sample keeps."""
    def kept(gpu):
        numbers = {field: None if gpu.get(field) is None else float(gpu[field]) for field in GPU_NUMBERS}
        return {"index": integer(gpu["index"]), **numbers, **{field: integer(gpu.get(field)) for field in GPU_BYTES}}
    return [kept(gpu) for gpu in record.get("gpus") or []]


def _integer_problem(value, bounds, field, *, optional):
    """None if `value` is an integer (or a float with an integer value: JSON decoders read big ones as
    floats) within `bounds`, or None and `optional`."""
    if value is None and optional:
        return None
    low, high = bounds
    if type(value) is float and value.is_integer():  # inf and NaN are not
        value = int(value)
    if type(value) is not int or not low <= value <= high:
        return f"{field}: must be {'null or ' if optional else ''}an integer between {_power(low)} and {_power(high)}"
    return None


def integer(value):
    """The int of a value that passed `problem` (a step or an exit code), or None."""
    return None if value is None else int(value)


def _number(value):
    return type(value) in (int, float)  # not bool: True is no metric value, time or step


def _utf8(text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\udcff" escape
        return False
    return True


def _power(bound):
    return {-2**63: "-2**63", 2**63 - 1: "2**63-1", -2**31: "-2**31", 2**31 - 1: "2**31-1"}.get(bound, str(bound))
