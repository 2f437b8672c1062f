"""Storing what learner agents send (DEVELOPERS.md, "The ingest protocol").

Exactly-once and in order: each learner's records carry a gap-free sequence number, the learner's
row remembers the highest one stored, and a batch is applied under the job's row lock. A resend is
dropped, a gap is refused with 409 so the agent rewinds, and log lines get a dense job-wide `seq`.

Who may post is settled first (`authenticate`, one indexed query on the learner's credential), before
the body is read or parsed: a caller without a valid credential costs the platform no JSON decoding.
"""
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone

from django.db import transaction

from jobs import bulk, credentials, lifecycle, live, metrics, tensorboard
from jobs.models import Job, Learner, MetricPoint
from jobs.serializers import metric_json

MAX_RECORDS = 20000
MAX_LINE = 64 * 1024
AGENT_STREAMS = ("stdout", "stderr", "system")
# `tfevent`: one record of a TensorBoard event file (learner_agent.tfevents, jobs.tensorboard).
RECORD_KINDS = ("log", "metric", "status", "tfevent")


class IngestError(Exception):
    def __init__(self, status, detail, acked=None):
        super().__init__(detail)
        self.status, self.detail, self.acked = status, detail, acked


@dataclass
class Batch:
    attempt: int
    learner: int
    records: list


def parse_batch(payload):
    if not isinstance(payload, dict):
        raise IngestError(400, "body must be a JSON object")
    attempt, learner, records = payload.get("attempt"), payload.get("learner"), payload.get("records")
    if not isinstance(attempt, int) or not isinstance(learner, int) or learner < 0:
        raise IngestError(400, "attempt and learner must be integers")
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        raise IngestError(400, f"records must be a list of at most {MAX_RECORDS}")
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("seq"), int) or record["seq"] < 1:
            raise IngestError(400, "every record needs an integer seq >= 1")
        if record.get("kind") not in RECORD_KINDS:
            raise IngestError(400, f"record {record['seq']}: kind must be one of {', '.join(RECORD_KINDS)}")
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


def ingest(grant, payload):
    """Apply one batch posted with `grant` (from authenticate); return the highest sequence number
    stored for this learner."""
    batch = parse_batch(payload)
    if batch.attempt != grant.attempt or batch.learner != grant.learner:
        raise IngestError(401, f"ingest credential was issued for attempt {grant.attempt} learner "
                               f"{grant.learner}, not attempt {batch.attempt} learner {batch.learner}")
    with transaction.atomic():
        # The job's row only (`of`): a lock on a join locks the joined rows too, and every job of a
        # tenant shares its tenant row, so each tenant's ingests ran one at a time and waited, with
        # its submissions and admissions, for each other's transactions (bench controlplane: 0.26 s
        # a batch). NO KEY: rows that only refer to the job (events, outbox rows) need not wait.
        job = Job.objects.select_for_update(of=("self",), no_key=True).select_related("tenant").filter(
            pk=grant.job_id).first()
        if job is None:
            raise IngestError(404, "no such job")
        # Checked again under the job's lock: the attempt may have ended since authenticate(), and
        # nothing is stored once it has (a halted, finished or superseded attempt has no say).
        if credentials.attempt_over(status=job.status, current_attempt=job.attempt, attempt=grant.attempt):
            raise IngestError(410, f"job is {job.status} (attempt {job.attempt}); stop the learner")
        if batch.learner >= job.learners:
            raise IngestError(400, f"learner {batch.learner} does not exist (job has {job.learners})")
        # Locked as read (one query): what the batch writes to the row must not undo a worker's change.
        learner, _ = Learner.objects.select_for_update().get_or_create(job=job, attempt=grant.attempt,
                                                                       index=batch.learner)
        fresh = _fresh_records(batch.records, learner.acked_seq)
        lines, points = _store(job, learner, fresh)
    live.publish_records_on_commit(job.id, lines, points)
    metrics.ingested(job.tenant.slug, lines=len(lines), oldest_time=_oldest_time(fresh))
    return learner.acked_seq


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


def _store(job, learner, records):
    """Insert the records in order; status records apply between the rows before and after them.

    Returns the stored log lines and metric points as the JSON the websockets send.
    """
    stored_lines, stored_points, rows, points = [], [], [], []

    def flush():
        bulk.insert_log_lines(rows)
        MetricPoint.objects.bulk_create(points)
        stored_points.extend(metric_json(p) for p in points)
        rows.clear()
        points.clear()

    job_pk, attempt, index = job.pk, learner.attempt, learner.index
    events = tensorboard.LearnerEvents(learner.tensorboard)

    def system_line(text):
        job.log_seq += 1
        iso = _time(None).isoformat()
        rows.append((job_pk, job.log_seq, attempt, index, "system", iso, text))
        stored_lines.append({"seq": job.log_seq, "learner": index, "stream": "system", "time": iso, "line": text})

    for record in records:
        if record["kind"] == "tfevent":
            try:
                points.extend(_event_points(job, events, record, learner))
            except tensorboard.MalformedEvent as e:
                if (note := events.note(str(e))) is not None:
                    system_line(note)
            continue
        if record["kind"] == "log":
            # The hot path (one learner may send tens of thousands a second): no datetime objects.
            job.log_seq += 1
            # `system`: the agent's own notices (a full spool); the learner's output is only ever
            # stdout or stderr, so a learner cannot pass its lines off as the platform's.
            stream = record.get("stream")
            stream = stream if stream in AGENT_STREAMS else "stdout"
            line = record.get("line", "")
            line = (line if type(line) is str else str(line))[:MAX_LINE]
            iso = _iso_time(record.get("time"))
            rows.append((job_pk, job.log_seq, attempt, index, stream, iso, line))
            stored_lines.append({"seq": job.log_seq, "learner": index, "stream": stream, "time": iso, "line": line})
            continue
        when = _time(record.get("time"))
        if record["kind"] == "metric":
            point = _metric(record, learner, when)
            if point is not None:
                point.job = job
                points.append(point)
        else:
            flush()
            Job.objects.filter(pk=job.pk).update(log_seq=job.log_seq)
            _apply_status(job, learner, record, when)
    flush()
    if records:
        learner.acked_seq = records[-1]["seq"]
        changed = {"acked_seq": learner.acked_seq}
        if events.changed:
            learner.tensorboard = changed["tensorboard"] = events.state
        Learner.objects.filter(pk=learner.pk).update(**changed)
        Job.objects.filter(pk=job.pk).update(log_seq=job.log_seq)
    return stored_lines, stored_points


def _metric(record, learner, when):
    try:
        value = float(record["value"])
        step = record.get("step")
        step = int(step) if step is not None else None
    except (KeyError, TypeError, ValueError):
        return None
    name = str(record.get("name", ""))[:100]
    if not name or value != value:  # NaN is dropped: it cannot be charted or compared
        return None
    return MetricPoint(attempt=learner.attempt, learner=learner.index, name=name, step=step, value=value, time=when)


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
        exit_code = record.get("exit_code")
        lifecycle.learner_exited(job, learner, exit_code=exit_code if isinstance(exit_code, int) else None,
                               reason=str(record.get("reason") or "")[:2000], when=when)


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
