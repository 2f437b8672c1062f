"""How much of a job's log the platform stores: caps per job and per learner, in lines and bytes,
and on one line's length.

A learner printing without pause would otherwise fill the database (and the log file written when
the job stores its output, which holds exactly the stored lines). Past a cap the lines are counted,
not stored: the job's log gets one `system` line when a learner reaches a cap and, when that learner
ends, one saying how many lines and bytes were not stored. The counts are on the learner's row and
summed on the job's (`log_dropped_lines`, `log_dropped_bytes`, shown in the job's API detail).

The job's caps are its `logs` and `log_lines` disk caps (jobs.disk, decided at submission); the
learner's are the platform's settings (LOG_MAX_*_PER_LEARNER), within the job's. A line longer than
LOG_MAX_LINE_BYTES is cut there and marked. The platform's own lines (these notices, data-store
progress) count too, but are never refused: there are a few per learner.

Metric points are capped the same way (MetricMeter): a learner of an attempt stores at most
METRIC_POINTS_PER_LEARNER of them and a job at most METRIC_NAMES_PER_JOB metric names; past them a
point is counted, not stored, and the job's log gets one `system` line when a learner first meets a cap.
"""
import threading
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction

from jobs import disk
from jobs.models import Job, MetricPoint
from trainyard.units import format_bytes

TRUNCATED = " …[line cut: {} bytes, over the platform's {}-byte limit]"
_CACHE_SIZE = 10_000


@dataclass(frozen=True)
class Caps:
    lines: int  # per job, all attempts
    bytes: int
    learner_lines: int  # per learner of an attempt
    learner_bytes: int

    def describe(self):
        return (f"{self.lines} lines / {format_bytes(self.bytes)} per job, {self.learner_lines} lines / "
                f"{format_bytes(self.learner_bytes)} per learner")


_caps = {}  # job id -> Caps: fixed at submission, so each process reads them once per job


def caps_of(job_id):
    caps = _caps.get(job_id)
    if caps is None:
        stored = Job.objects.filter(pk=job_id).values_list("runtime", flat=True).first() or {}
        job = disk.stored_caps(stored.get("disk"))
        caps = Caps(lines=job["log_lines"], bytes=job["logs"],
                    learner_lines=min(settings.LOG_MAX_LINES_PER_LEARNER, job["log_lines"]),
                    learner_bytes=min(settings.LOG_MAX_BYTES_PER_LEARNER, job["logs"]))
        if len(_caps) >= _CACHE_SIZE:
            _caps.clear()
        _caps[job_id] = caps
    return caps


def cut(line, limit=None):
    """`line` within `limit` bytes of UTF-8 (LOG_MAX_LINE_BYTES), marked when cut; and its size."""
    limit = limit or settings.LOG_MAX_LINE_BYTES
    if len(line) * 4 <= limit:  # the hot path: no encoding needed to know it fits
        return line, len(line.encode("utf-8", "replace")) if not line.isascii() else len(line)
    raw = line.encode("utf-8", "replace")
    if len(raw) <= limit:
        return line, len(raw)
    kept = raw[:limit].decode("utf-8", "ignore") + TRUNCATED.format(len(raw), limit)
    return kept, len(kept.encode("utf-8"))


class Meter:
    """One post's accounting for one learner: `admit` each line; the job's and the learner's rows
    (locked by the caller) carry the counts."""

    def __init__(self, job, learner, caps):
        self.job, self.learner, self.caps = job, learner, caps

    def admit(self, size):
        """True when a line of `size` bytes is stored; False when it is counted as dropped."""
        job, learner, caps = self.job, self.learner, self.caps
        if (learner.log_dropped_lines or job.log_seq >= caps.lines or job.log_bytes + size > caps.bytes
                or learner.log_lines >= caps.learner_lines or learner.log_bytes + size > caps.learner_bytes):
            learner.log_dropped_lines += 1
            learner.log_dropped_bytes += size
            job.log_dropped_lines += 1
            job.log_dropped_bytes += size
            return False
        self.stored(size)
        return True

    def stored(self, size, *, platform=False):
        """Count a stored line; the platform's own count on the job's total only."""
        if not platform:
            self.learner.log_lines += 1
            self.learner.log_bytes += size
        self.job.log_bytes += size

    def reached_notice(self):
        """The system line for the first line a learner could not store, or None after the first."""
        if self.learner.log_dropped_lines != 1:
            return None
        return (f"log cap reached for learner {self.learner.index} ({self.caps.describe()}): its further "
                "lines are counted, not stored")

    def summary_notice(self):
        """The system line for a learner's end when some of its lines were not stored, else None."""
        learner = self.learner
        if not learner.log_dropped_lines:
            return None
        return (f"… {learner.log_dropped_lines} lines / {format_bytes(learner.log_dropped_bytes)} of learner "
                f"{learner.index} not stored: log cap reached ({self.caps.describe()})")


# --- metric points -------------------------------------------------------------------------------
# The metric names of each job this process has seen stored: always a subset of the job's names, so a
# process that knows the cap's worth knows them all (nothing stores a name past the cap).
_job_names = {}
_job_names_lock = threading.Lock()
# The job's names in index order, one probe of the (job, name, id) index each, where DISTINCT would
# read every point of the job.
_NAMES_SQL = """
WITH RECURSIVE names(name) AS (
    SELECT MIN(name) FROM {table} WHERE job_id = %s
    UNION ALL
    SELECT (SELECT MIN(name) FROM {table} WHERE job_id = %s AND name > names.name) FROM names
    WHERE names.name IS NOT NULL
)
SELECT name FROM names WHERE name IS NOT NULL LIMIT %s
"""


def empty_metric_counts():
    """What a learner's metric counts start as: points stored and points counted past a cap."""
    return {"points": 0, "dropped": 0}


class MetricMeter:
    """One post's metric points for one learner of an attempt: `admit` each by its name. `counts`
    (empty_metric_counts) is kept on the learner's row, locked by the caller, and updated in place.

    Every post of a job is applied under the job's row lock, so the names read from its points here
    are exact: they are read once per post, and only when it brings a name this process has not seen
    while the job is below its cap."""

    def __init__(self, job_id, counts):
        self.job_id, self.counts = job_id, counts
        self.points_cap, self.names_cap = settings.METRIC_POINTS_PER_LEARNER, settings.METRIC_NAMES_PER_JOB
        self.names = set(_job_names.get(job_id, ()))
        self.read, self.added, self.changed = False, set(), False

    def admit(self, name):
        """True when a point named `name` is stored; False when it is counted as dropped."""
        fits = self.counts["points"] < self.points_cap and self._name_fits(name)
        self.counts["points" if fits else "dropped"] += 1
        self.changed = True
        return fits

    def _name_fits(self, name):
        if name in self.names:
            return True
        if len(self.names) < self.names_cap and not self.read:
            self.names |= _stored_names(self.job_id, self.names_cap)
            self.read = True
            _remember_names(self.job_id, frozenset(self.names))
            if name in self.names:
                return True
        if len(self.names) >= self.names_cap:
            return False
        self.names.add(name)
        self.added.add(name)
        return True

    def remember_on_commit(self):
        """This post's new names join what the process knows once they are stored."""
        if self.added:
            added = frozenset(self.added)
            transaction.on_commit(lambda: _remember_names(self.job_id, added))

    def reached_notice(self, index):
        """The system line for the first point learner `index` could not store, or None after the first."""
        if self.counts["dropped"] != 1:
            return None
        return (f"metric cap reached for learner {index} ({self.points_cap} points per learner, "
                f"{self.names_cap} metric names per job): its points past a cap are counted, not stored")


def _stored_names(job_id, limit):
    with connection.cursor() as cursor:
        cursor.execute(_NAMES_SQL.format(table=MetricPoint._meta.db_table), [job_id, job_id, limit])
        return {name for (name,) in cursor.fetchall()}


def _remember_names(job_id, names):
    with _job_names_lock:
        if job_id not in _job_names and len(_job_names) >= _CACHE_SIZE:
            _job_names.clear()
        _job_names[job_id] = frozenset(_job_names.get(job_id, ())) | names
