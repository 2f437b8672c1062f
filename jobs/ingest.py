"""Storing what learner agents send (DEVELOPERS.md, "The ingest protocol").

Exactly-once and in order: each learner's records carry a gap-free sequence number, the learner's
row remembers the highest one stored, and a batch is applied under the job's row lock. A resend is
dropped, a gap is refused with 409 so the agent rewinds, and log lines get a dense job-wide `seq`.

Each record is checked on its own (jobs.ingest_records): a bad one is refused and named in the
answer (`rejected`) while the rest of its batch is stored, and the learner's seq moves past it, so an
agent never resends it and nothing after it waits on it.

Who may post is settled first (`authenticate`, one indexed query), before the body is parsed. One
credential must not hold up the others: a status record costs queries only when it moves its learner
forward, and the job's lock is waited for at most LOCK_WAIT_S (then 503, and the agent retries) rather
than holding one of the web process's few ingest threads. What a learner sends past its log and metric
caps is counted, not stored (jobs.logcap).
"""
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone as dt_timezone

import orjson
from django.conf import settings
from django.db import OperationalError, connection, transaction

from jobs import (bulk, credentials, elastic_timeline, ingest_records, lifecycle, live, logcap, prometheus_series,
                  tensorboard)
from jobs.ingest_records import AGENT_STREAMS, MAX_REASON
from jobs.models import Job, Learner, MetricPoint, ResourceSample, Status
from jobs.serializers import metric_json
from learner_agent import batch_changes

MAX_RECORDS = 20000
MAX_SEQ = 2**63 - 1  # Learner.acked_seq: BigIntegerField
MAX_REJECTED_LISTED = 100  # refused records named in one answer; the rest are counted
# How far a resource sample's time may be from its arrival: behind, a spool sent after an outage;
# ahead, an agent's clock running fast.
SAMPLE_BACKLOG_S, SAMPLE_AHEAD_S = 3600.0, 300.0
# A post waits this long for its job's lock (another post of the job, a worker's change), then is
# answered 503 with Retry-After RETRY_AFTER_S; PostgreSQL only (SQLite posts take turns in one thread).
LOCK_WAIT_S, RETRY_AFTER_S = 2.0, 1
MAX_REFUSED_NOTES = 20  # per learner: a `system` line for each post with refused records, up to this
# How far each status moves a learner; one that would not move it further is acked and not applied.
_STATUS_STEP = {"preparing": 1, "running": 2, "exited": 3}
_STATE_STEP = {Learner.State.DEPLOYING: 0, Learner.State.RUNNING: 2, Learner.State.EXITED: 3, Learner.State.LOST: 3}


class IngestError(Exception):
    def __init__(self, status, detail, acked=None):
        super().__init__(detail)
        self.status, self.detail, self.acked = status, detail, acked


@dataclass
class Batch:
    attempt: int
    learner: int
    records: list


@dataclass
class Stored:
    """What a post achieved: everything up to `acked` is stored or refused; `rejected` names the
    refused records of this post ({"seq", "error"} each)."""
    acked: int
    rejected: list = field(default_factory=list)
    batch: dict | None = None  # a batch change asked of the learners (Job.batch_request)

    def answer(self):
        """The 200 answer's JSON: {"acked"}, with the refused records when there were any and the
        batch change the platform asks for while it waits to hear it applied."""
        answer = {"acked": self.acked}
        if self.batch is not None:
            answer["batch"] = self.batch
        if not self.rejected:
            return answer
        listed = self.rejected[:MAX_REJECTED_LISTED]
        answer["rejected"] = listed
        if len(self.rejected) > len(listed):
            answer["rejected_unlisted"] = len(self.rejected) - len(listed)
        return answer


def decode(body):
    """The posted JSON and whether its strings are known to be valid UTF-8.

    orjson first: a batch is up to 20,000 records and decoding speed counts. It refuses numbers
    beyond a double (`"step": 1e400`), NaN and lone surrogates, which would make the whole batch a
    400 and stop the agent for good; Python's own decoder reads those, so that only the records
    holding them are refused (jobs.ingest_records). ValueError when the body is not JSON at all."""
    try:
        return orjson.loads(body), True
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body), False
    except RecursionError:
        raise ValueError("body is nested too deeply") from None


def parse_batch(payload):
    if not isinstance(payload, dict):
        raise IngestError(400, "body must be a JSON object")
    attempt, learner, records = payload.get("attempt"), payload.get("learner"), payload.get("records")
    if not isinstance(attempt, int) or not isinstance(learner, int) or learner < 0:
        raise IngestError(400, "attempt and learner must be integers")
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        raise IngestError(400, f"records must be a list of at most {MAX_RECORDS}")
    for record in records:
        # Only a record without a usable seq fails the batch: nothing else can name it, or move past it.
        if not isinstance(record, dict) or type(record.get("seq")) is not int or not 1 <= record["seq"] <= MAX_SEQ:
            raise IngestError(400, f"every record needs an integer seq between 1 and {MAX_SEQ}")
    return Batch(attempt, learner, sorted(records, key=lambda r: r["seq"]))


def authenticate(job_id, token):
    """The Grant of a learner's credential for posting to `job_id`; refused with 401 if it is not one,
    410 if its attempt is over (the agent then stops its learner and exits)."""
    grant = credentials.check(token, job_id)
    if grant is None:
        raise IngestError(401, "ingest credential is not valid for this job")
    if grant.ended:
        raise IngestError(410, "this attempt is over; stop the learner")
    return grant


def ingest(grant, payload, *, text_checked=True):
    """Apply one batch posted with `grant` (from authenticate); returns what it Stored.
    `text_checked`: from decode()."""
    batch = parse_batch(payload)
    try:
        slot, learner, lines, points, good, rejected = _apply(grant, batch, text_checked)
    except OperationalError as exc:
        if not _lock_not_available(exc):
            raise
        raise IngestError(503, f"the job is busy; retry in {RETRY_AFTER_S}s") from None
    live.publish_records_on_commit(slot.job.id, lines, points)
    prometheus_series.ingested(slot.tenant_slug, lines=len(lines), oldest_time=_oldest_time(good))
    return Stored(learner.acked_seq, rejected, slot.job.batch_request)


def _apply(grant, batch, text_checked):
    """The batch applied in one transaction under the job's lock: (slot, learner, stored lines,
    stored points, the records stored, those refused)."""
    with transaction.atomic():
        slot = _lock(grant.job_id, grant.attempt, grant.learner)
        if slot is None:
            raise IngestError(404, "no such job")
        job, learner = slot.job, slot.learner
        # Checked under the job's lock: the attempt may have ended since authenticate() (or since a
        # grant it remembers was issued, jobs.credentials), and nothing is stored once it has (a
        # halted, finished or superseded attempt has no say, whatever its batch claims to be).
        if credentials.attempt_over(status=job.status, current_attempt=job.attempt, attempt=grant.attempt):
            raise IngestError(410, f"job is {job.status} (attempt {job.attempt}); stop the learner")
        if batch.attempt != grant.attempt or batch.learner != grant.learner:
            raise IngestError(401, f"ingest credential was issued for attempt {grant.attempt} learner "
                                   f"{grant.learner}, not attempt {batch.attempt} learner {batch.learner}")
        if batch.learner >= job.learners:
            raise IngestError(400, f"learner {batch.learner} does not exist (job has {job.learners})")
        if learner is None:  # deploy writes the learner rows; one missing is made here
            learner, _ = Learner.objects.select_for_update().get_or_create(job=job, attempt=grant.attempt,
                                                                           index=batch.learner)
        fresh = _fresh_records(batch.records, learner.acked_seq)
        good, rejected = _checked(fresh, text_checked, _SampleGate(job, learner))
        lines, points = _store(job, learner, good, through=fresh[-1]["seq"] if fresh else None, rejected=rejected)
    return slot, learner, lines, points, good, rejected


def _lock_not_available(exc):
    """Whether `exc` is PostgreSQL's answer to a lock not had within lock_timeout (SQLSTATE 55P03)."""
    return getattr(exc.__cause__, "pgcode", None) == "55P03"  # psycopg2's LockNotAvailable


def _checked(records, text_checked, samples):
    """(the records to store, [{"seq", "error"}] of those refused), each judged on its own; a
    resource record by `samples` (a _SampleGate) too."""
    good, rejected = [], []
    for record in records:
        error = ingest_records.problem(record, text_checked=text_checked)
        if error is None and record["kind"] == "resource":
            error = samples.problem(record)
        if error is None:
            good.append(record)
        else:
            rejected.append({"seq": record["seq"], "error": error})
    return good, rejected


class _SampleGate:
    """Which of one learner's resource records a batch may store. An agent samples its learner's own
    GPUs (learner_agent.telemetry) every TRAINYARD_RESOURCE_SAMPLE_S, and once more as the learner
    ends, so a sample is kept only where it names each of the job's GPUs per learner at most once,
    comes within SAMPLE_BACKLOG_S behind its arrival and SAMPLE_AHEAD_S ahead, no earlier than the
    learner's last sample kept, and with at most one other kept in the half period before it: what one
    credential can store grows with the time it runs, as a real agent's samples do, however fast it
    posts. The learner's row is locked (_lock), so the samples read here are still the last ones when
    the batch is stored."""

    def __init__(self, job, learner):
        self.job, self.learner = job, learner
        self.spacing = timedelta(seconds=settings.RESOURCE_SAMPLE_S / 2)
        self._recent = None  # the times of the learner's last two samples kept, oldest first

    def problem(self, record):
        if not settings.RESOURCE_SAMPLE_S:
            return "resource: this platform takes no resource samples (TRAINYARD_RESOURCE_SAMPLE_S is 0)"
        gpus = self.job.gpus
        indices = [gpu["index"] for gpu in record.get("gpus") or []]
        if indices and not gpus:
            return "gpus: the learner has no GPUs"
        if len(set(indices)) != len(indices) or any(index >= gpus for index in indices):
            return f"gpus: each of the learner's {gpus} GPUs at most once, by its index (0 to {gpus - 1})"
        when, now = _time(record.get("time")), datetime.now(tz=dt_timezone.utc)
        if not now - timedelta(seconds=SAMPLE_BACKLOG_S) <= when <= now + timedelta(seconds=SAMPLE_AHEAD_S):
            return (f"time: a resource sample is kept from {SAMPLE_BACKLOG_S:.0f} s before it arrives to "
                    f"{SAMPLE_AHEAD_S:.0f} s after")
        recent = self.recent()
        if recent and when < recent[-1]:
            return "time: before the learner's last resource sample"
        if len(recent) == 2 and when - recent[0] < self.spacing:
            return (f"time: a learner's resource samples come one per {settings.RESOURCE_SAMPLE_S:g} s; two "
                    "are kept already in the half period before this one")
        self._recent = [*recent, when][-2:]
        return None

    def recent(self):
        if self._recent is None:
            self._recent = list(reversed(ResourceSample.objects.filter(
                job_id=self.job.pk, attempt=self.learner.attempt, learner=self.learner.index)
                .order_by("-time").values_list("time", flat=True)[:2]))
        return self._recent


@dataclass
class _Slot:
    job: Job  # with only the columns a batch needs loaded; any other is read when first used
    learner: Learner | None  # None: no row yet
    tenant_slug: str


def _columns(model, names):
    """`names` in the model's field order, as Model.from_db takes a row with some columns deferred."""
    return tuple(f.attname for f in model._meta.concrete_fields if f.attname in names)


_LOG_COUNTS = {"log_bytes", "log_dropped_lines", "log_dropped_bytes"}  # jobs.logcap's, on both rows
_JOB_COLUMNS = _columns(Job, {"id", "status", "attempt", "learners", "gpus", "log_seq", "tenant_id", "batch_request",
                              *_LOG_COUNTS})
_LEARNER_COLUMNS = _columns(Learner, {"id", "job_id", "attempt", "index", "state", "acked_seq", "log_lines",
                                      "ingest_state", *_LOG_COUNTS})


def _lock_statements():
    """{vendor: the statement _lock runs}, built once from the models; params (job id, attempt, index)."""
    job_table, learner_table = Job._meta.db_table, Learner._meta.db_table
    tenant_table = Job._meta.get_field("tenant").related_model._meta.db_table
    job_columns, learner_columns = (", ".join(f'"{c}"' for c in columns) for columns in (_JOB_COLUMNS, _LEARNER_COLUMNS))
    learner_fields = ", ".join(f'learner."{c}"' for c in _LEARNER_COLUMNS)
    select = f"SELECT job.*, tenant.slug, {learner_fields} FROM "
    return {
        "postgresql": (
            f'WITH job AS MATERIALIZED (SELECT {job_columns} FROM "{job_table}" WHERE id = %s FOR NO KEY UPDATE) '
            f'{select}job JOIN "{tenant_table}" tenant ON tenant.id = job.tenant_id LEFT JOIN LATERAL ('
            f'SELECT {learner_columns} FROM "{learner_table}" WHERE job_id = job.id AND attempt = %s '
            f'AND "index" = %s FOR UPDATE) learner ON true'),
        # SQLite: the transaction holds the database's one write lock instead of row locks.
        "sqlite": (
            f'{select}(SELECT {job_columns} FROM "{job_table}" WHERE id = %s) job '
            f'JOIN "{tenant_table}" tenant ON tenant.id = job.tenant_id LEFT JOIN "{learner_table}" learner '
            f'ON learner.job_id = job.id AND learner.attempt = %s AND learner."index" = %s'),
    }


_LOCK_STATEMENTS = _lock_statements()
_BATCH_REQUEST = Job._meta.get_field("batch_request")
_LEARNER_MEMO = Learner._meta.get_field("ingest_state")


def _lock(job_id, attempt, index):
    """The job and the learner's row, both locked, read in one round trip; None if the job is gone.

    The job's row only is locked, not its tenant's (a lock on a join locks the joined rows too, which
    made each tenant's ingests, submissions and admissions wait for one another). NO KEY: rows that
    only refer to the job (events, outbox rows) need not wait. The job is locked before the learner
    (the CTE is read first), in the order workers lock them; the learner's row is locked as read, so
    what the batch writes to it cannot undo a worker's change. On PostgreSQL the transaction's locks
    are waited for at most LOCK_WAIT_S."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{int(LOCK_WAIT_S * 1000)}ms"])
        cursor.execute(_LOCK_STATEMENTS[connection.vendor], [job_id, attempt, index])
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(_JOB_COLUMNS)
    job = Job.from_db(connection.alias, _JOB_COLUMNS, row[:split])
    job.batch_request = _BATCH_REQUEST.from_db_value(job.batch_request, None, connection)  # JSON as text here
    learner_row = row[split + 1:]
    learner = Learner.from_db(connection.alias, _LEARNER_COLUMNS, learner_row) if learner_row[0] is not None else None
    if learner is not None:
        learner.ingest_state = _LEARNER_MEMO.from_db_value(learner.ingest_state, None, connection) or {}
    return _Slot(job, learner, row[split])


def _oldest_time(records):
    """The earliest agent time (Unix seconds) among `records`, for the ingest lag; None if none has one."""
    times = [t for r in records if type(t := r.get("time")) in (int, float)]
    return min(times) if times else None


def _fresh_records(records, acked):
    """The records after `acked`, which must continue it without a gap."""
    fresh = [r for r in records if r["seq"] > acked]
    expected = acked + 1
    for record in fresh:
        if record["seq"] != expected:
            raise IngestError(409, f"expected seq {expected}, got {record['seq']}", acked)
        expected += 1
    return fresh


def _store(job, learner, records, *, through=None, rejected=()):
    """Insert the records in order; status records apply between the rows before and after them.
    The learner's acked seq becomes `through` (the last record of the post, stored or refused; the
    last of `records` when not given); `rejected` ({"seq", "error"}) is noted in the job's log.

    Returns the stored log lines and metric points as the JSON the websockets send.
    """
    stored_lines, stored_points, rows, points, samples = [], [], [], [], []
    batch_applied = []  # (change id, time) learner 0 reported (learner_agent.batch_changes)

    def flush(along=()):
        bulk.insert_log_lines(rows, along=along)
        MetricPoint.objects.bulk_create(points)
        ResourceSample.objects.bulk_create(samples)
        stored_points.extend(metric_json(p) for p in points)
        rows.clear()
        points.clear()
        samples.clear()
        # Once stored: the stretch a batch change ends counts the samples reported before it.
        for change_id, at in batch_applied:
            elastic_timeline.batch_applied(job, change_id, at)
        batch_applied.clear()

    job_pk, attempt, index = job.pk, learner.attempt, learner.index
    memo = learner.ingest_state  # the learner's TensorBoard files, metric counts and refused notes
    events = None  # the learner's TensorBoard files, read at its first tfevent record
    meter = logcap.Meter(job, learner, logcap.caps_of(job_pk))
    metrics = logcap.MetricMeter(job_pk, memo.setdefault("metrics", logcap.empty_metric_counts()))
    reached = _STATE_STEP.get(learner.state, 0)

    def system_line(text):
        meter.stored(len(text.encode("utf-8")), platform=True)
        job.log_seq += 1
        iso = _time(None).isoformat()
        rows.append((job_pk, job.log_seq, attempt, index, "system", iso, text))
        stored_lines.append({"seq": job.log_seq, "learner": index, "stream": "system", "time": iso, "line": text})

    def point(metric):
        if metrics.admit(metric.name):
            points.append(metric)
        elif (notice := metrics.reached_notice(index)) is not None:
            system_line(notice)

    for record in records:
        if record["kind"] == "tfevent":
            events = events or tensorboard.LearnerEvents(memo)
            try:
                for metric in _event_points(job, events, record, learner):
                    point(metric)
            except tensorboard.MalformedEvent as e:
                if (note := events.note(str(e))) is not None:
                    system_line(note)
            continue
        if record["kind"] == "log":
            # The hot path (one learner may send tens of thousands a second): no datetime objects.
            line, size = logcap.cut(record.get("line", ""))
            if not meter.admit(size):  # past a log cap: counted on the rows, not stored
                if (notice := meter.reached_notice()) is not None:
                    system_line(notice)
                continue
            job.log_seq += 1
            # `system`: the agent's own notices (a full spool); the learner's output is only ever
            # stdout or stderr, so a learner cannot pass its lines off as the platform's.
            stream = record.get("stream")
            stream = stream if stream in AGENT_STREAMS else "stdout"
            iso = _iso_time(record.get("time"))
            rows.append((job_pk, job.log_seq, attempt, index, stream, iso, line))
            stored_lines.append({"seq": job.log_seq, "learner": index, "stream": stream, "time": iso, "line": line})
            continue
        if record["kind"] == "status" and not _moves_forward(record, reached, job):
            continue  # a repeat or a step back: acked, and costs nothing
        when = _time(record.get("time"))
        if record["kind"] == "resource":
            samples.append(_resource_sample(record, job, learner, when))
            continue
        if record["kind"] == "metric":
            metric = _metric(record, learner, when)
            metric.job = job
            point(metric)
            # Heard whether or not the point is stored: it acknowledges the platform's batch change.
            if metric.name == batch_changes.APPLIED_METRIC and index == 0 and 0 < metric.value < 2**63:
                batch_applied.append((int(metric.value), when))
        else:
            reached = _STATUS_STEP[record["state"]]
            if record["state"] == "exited" and (notice := meter.summary_notice()) is not None:
                system_line(notice)
            flush(along=[_job_progress(job)])
            _apply_status(job, learner, record, when)
    if rejected and (note := _rejected_note(memo, index, rejected)) is not None:
        system_line(note)
    through = through if through is not None else (records[-1]["seq"] if records else None)
    if through is not None:
        learner.acked_seq = through
        memo_changed = metrics.changed or (events is not None and events.changed) or bool(rejected)
        flush(along=[_job_progress(job), _learner_progress(learner, memo_changed=memo_changed)])
        metrics.remember_on_commit()
    return stored_lines, stored_points


def _moves_forward(record, reached, job):
    """Whether a status record takes its learner further than `reached` (_STATUS_STEP). `preparing`
    moves a job that is still PENDING only: the learner's row does not record it."""
    step = _STATUS_STEP[record["state"]]
    if step <= reached:
        return False
    return record["state"] != "preparing" or job.status == Status.PENDING


def _rejected_note(memo, index, rejected, shown=3):
    """The `system` line that tells the job's readers which records of a post were refused; None past
    MAX_REFUSED_NOTES of them for the learner, whose refused records are then only counted."""
    refused = memo.setdefault("refused", {"notes": 0, "unnoted": 0})
    if refused["notes"] >= MAX_REFUSED_NOTES:
        refused["unnoted"] += len(rejected)
        return None
    refused["notes"] += 1
    named = "; ".join(f"seq {r['seq']}: {r['error']}" for r in rejected[:shown])
    more = f"; and {len(rejected) - shown} more" if len(rejected) > shown else ""
    last = (f" (the last such note of the {MAX_REFUSED_NOTES} shown for this learner)"
            if refused["notes"] == MAX_REFUSED_NOTES else "")
    return f"ingest: {len(rejected)} record(s) of learner {index} refused and not stored ({named}{more}){last}"


def _job_progress(job):
    """The statement that records how many log lines (and bytes) the job has, and has not stored
    past its log caps: sent with the lines themselves."""
    return (f'UPDATE "{Job._meta.db_table}" SET log_seq = %s, log_bytes = %s, log_dropped_lines = %s, '
            'log_dropped_bytes = %s WHERE id = %s',
            [job.log_seq, job.log_bytes, job.log_dropped_lines, job.log_dropped_bytes, job.pk])


def _learner_progress(learner, *, memo_changed=False):
    """The statement that records what of the learner's records and log the platform has, and its
    TensorBoard files, metric counts and refused notes (Learner.ingest_state) when they changed."""
    memo = ", ingest_state = %s" if memo_changed else ""
    params = [learner.acked_seq, learner.log_lines, learner.log_bytes, learner.log_dropped_lines,
              learner.log_dropped_bytes, *([_LEARNER_MEMO.get_db_prep_save(learner.ingest_state, connection)]
                                           if memo_changed else []), learner.pk]
    return (f'UPDATE "{Learner._meta.db_table}" SET acked_seq = %s, log_lines = %s, log_bytes = %s, '
            f'log_dropped_lines = %s, log_dropped_bytes = %s{memo} WHERE id = %s', params)


def _metric(record, learner, when):
    """The point of a metric record that passed ingest_records.problem."""
    return MetricPoint(attempt=learner.attempt, learner=learner.index, name=record["name"],
                       step=ingest_records.integer(record.get("step")), value=float(record["value"]), time=when)


def _resource_sample(record, job, learner, when):
    """The sample of a resource record that passed ingest_records.problem."""
    integer = ingest_records.integer
    gpus = ingest_records.resource_gpus(record)
    readings = [gpu["utilization"] for gpu in gpus if gpu.get("utilization") is not None]
    return ResourceSample(job=job, attempt=learner.attempt, learner=learner.index, time=when,
                          cpu_cores=float(record["cpu_cores"]), memory_bytes=integer(record["memory_bytes"]),
                          memory_peak_bytes=integer(record["memory_peak_bytes"]),
                          memory_limit_bytes=integer(record.get("memory_limit_bytes")),
                          gpus=gpus, gpu_utilization=max(readings) if readings else None,
                          gpus_busy=round(sum(readings) / 100.0, 4) if readings else None)


def _event_points(job, events, record, learner):
    """The metric points of one `tfevent` record: its scalars, at the event's own time."""
    return [MetricPoint(job=job, attempt=learner.attempt, learner=learner.index, name=scalar.name[:100], step=scalar.step,
                        value=scalar.value, time=_time(scalar.wall_time))
            for scalar in events.scalars(record)]


def _apply_status(job, learner, record, when):
    state = record.get("state")
    if state == "preparing":
        lifecycle.learner_preparing(job)
    elif state == "running":
        lifecycle.learner_running(job, learner, when)
    elif state == "exited":
        lifecycle.learner_exited(job, learner, exit_code=ingest_records.integer(record.get("exit_code")),
                               reason=(record.get("reason") or "").replace("\x00", "")[:MAX_REASON], when=when)


def _time(value):
    try:
        return datetime.fromtimestamp(float(value), tz=dt_timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return datetime.now(tz=dt_timezone.utc)


_SECONDS = {}  # whole second -> "YYYY-MM-DDTHH:MM:SS" (UTC): lines arrive in runs within one second


def _iso_time(value):
    """The agent's Unix time as ISO 8601 UTC with microseconds, as `_time(value).isoformat()` but
    formatting each second once."""
    try:
        moment = float(value)
        second = int(moment)
        micro = round((moment - second) * 1_000_000)
    except (TypeError, ValueError, OverflowError):
        return _time(None).isoformat()
    if micro >= 1_000_000 or micro < 0 or moment < 0:
        return _time(value).isoformat()
    prefix = _SECONDS.get(second)
    if prefix is None:
        try:
            prefix = datetime.fromtimestamp(second, tz=dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        except (OverflowError, OSError, ValueError):
            return _time(None).isoformat()
        if len(_SECONDS) > 4096:
            _SECONDS.clear()
        _SECONDS[second] = prefix
    return f"{prefix}.{micro:06d}+00:00"
