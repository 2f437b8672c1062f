"""A job trace: what was submitted when, and how long it runs once all its learners are placed.

CSV format (one header line, then one job per line; extra columns are ignored):

| column                 | meaning                                                    | default |
|------------------------|------------------------------------------------------------|---------|
| job_id                 | unique id                                                  | required |
| arrival_s              | submission time, seconds from the start of the trace (>=0) | required |
| tenant                 | tenant name                                                | required |
| user                   | user name inside the tenant                                | tenant  |
| learners               | learners (1 = single, >1 = distributed, gang-scheduled)    | 1       |
| gpus_per_learner       | integer >= 0                                               | required |
| cpus_per_learner       | number >= 0                                                | 4 per GPU, 2 without GPUs |
| memory_gib_per_learner | number >= 0, in GiB                                        | 16 per GPU, 8 without GPUs |
| duration_s             | run time once every learner is placed (> 0)                | required |
| priority               | low, normal or high                                        | normal  |
| preemptible            | true/false: can it be halted through a checkpoint          | true    |
"""
import csv
from dataclasses import dataclass

from gpu_scheduler.model import PRIORITY_RANK

GIB = 2**30
COLUMNS = ("job_id", "arrival_s", "tenant", "user", "learners", "gpus_per_learner", "cpus_per_learner",
           "memory_gib_per_learner", "duration_s", "priority", "preemptible")
REQUIRED = ("job_id", "arrival_s", "tenant", "gpus_per_learner", "duration_s")


class TraceError(ValueError):
    """A trace line is malformed; the message names the line and the column."""


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    arrival_s: float
    tenant: str
    user: str
    learners: int
    gpus: int  # per learner
    cpus: float  # per learner
    memory_bytes: int  # per learner
    duration_s: float
    priority: str = "normal"
    preemptible: bool = True

    def __post_init__(self):
        problems = []
        if not self.job_id or not self.tenant:
            problems.append("job_id and tenant must not be empty")
        if self.arrival_s < 0:
            problems.append(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.learners < 1:
            problems.append(f"learners must be >= 1, got {self.learners}")
        if self.gpus < 0 or self.cpus < 0 or self.memory_bytes < 0:
            problems.append("gpus, cpus and memory per learner must be >= 0")
        if self.gpus == 0 and self.cpus == 0 and self.memory_bytes == 0:
            problems.append("a learner must ask for some GPUs, CPUs or memory")
        if not self.duration_s > 0:
            problems.append(f"duration_s must be > 0, got {self.duration_s}")
        if self.priority not in PRIORITY_RANK:
            problems.append(f"priority must be low, normal or high, got {self.priority!r}")
        if problems:
            raise TraceError(f"job {self.job_id!r}: " + "; ".join(problems))

    @property
    def gpu_seconds(self):
        return self.learners * self.gpus * self.duration_s


def read_csv(path):
    """The jobs of a CSV trace, sorted by arrival; a TraceError names the first bad line and column."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
        jobs, seen = [], set()
        for line, row in enumerate(reader, start=2):
            job = _parse_row(row, f"{path} line {line}")
            if job.job_id in seen:
                raise TraceError(f"{path} line {line}: job_id {job.job_id!r} appears twice")
            seen.add(job.job_id)
            jobs.append(job)
    return sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))


def write_csv(jobs, path):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for job in jobs:
            writer.writerow([job.job_id, f"{job.arrival_s:.3f}", job.tenant, job.user, job.learners, job.gpus,
                             f"{job.cpus:g}", f"{job.memory_bytes / GIB:g}", f"{job.duration_s:.3f}",
                             job.priority, "true" if job.preemptible else "false"])


def _parse_row(row, where):
    def value(column, convert, default=None):
        text = (row.get(column) or "").strip()
        if not text:
            if default is None:
                raise TraceError(f"{where}: column {column!r} is empty")
            return default
        try:
            return convert(text)
        except ValueError:
            raise TraceError(f"{where}: column {column!r} must be {convert.__name__}, got {text!r}") from None

    gpus = value("gpus_per_learner", int)
    preemptible = value("preemptible", str, "true").lower()
    if preemptible not in ("true", "false", "1", "0", "yes", "no"):
        raise TraceError(f"{where}: column 'preemptible' must be true or false, got {preemptible!r}")
    try:
        return TraceJob(
            job_id=value("job_id", str), arrival_s=value("arrival_s", float), tenant=value("tenant", str),
            user=value("user", str, (row.get("tenant") or "").strip() or "user"),
            learners=value("learners", int, 1), gpus=gpus,
            cpus=value("cpus_per_learner", float, 4.0 * gpus if gpus else 2.0),
            memory_bytes=int(value("memory_gib_per_learner", float, 16.0 * gpus if gpus else 8.0) * GIB),
            duration_s=value("duration_s", float), priority=value("priority", str, "normal"),
            preemptible=preemptible in ("true", "1", "yes"))
    except TraceError as error:
        raise TraceError(f"{where}: {error}") from None
