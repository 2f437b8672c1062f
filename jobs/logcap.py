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
"""
from dataclasses import dataclass

from django.conf import settings

from jobs import disk
from jobs.models import Job
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
