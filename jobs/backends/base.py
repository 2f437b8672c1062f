"""The interface every learner backend implements (local processes, Kubernetes pods).

The lifecycle manager speaks only this interface. Names are deterministic (job id + attempt +
learner index), so repeating a call after a crash is harmless: deploy skips what already runs,
delete ignores what is already gone.
"""
import json
import os
import stat
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

# Capacity is reported in the scheduler's own terms (allocatable totals per node), so the snapshot
# takes it as it is. gpu_scheduler is pure Python and imports nothing of the project.
from gpu_scheduler import Node  # noqa: F401 - part of this interface
from jobs.ingest_records import INT32, MAX_REASON


class BackendError(Exception):
    """A backend call failed. `permanent` errors fail the job; the others are retried."""

    def __init__(self, message, *, permanent=False):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class LearnerSpec:
    index: int
    env: dict  # the learner's own variables (SPEC §6), on top of the job's
    gpu_ids: tuple = ()
    node: str = ""  # the node the scheduler placed it on; container backends pin the learner there
    # This learner's own ingest credential (jobs.credentials): only its agent may hold it.
    ingest_token: str = field(default="", repr=False)


@dataclass(frozen=True)
class DeploySpec:
    job_id: str
    attempt: int
    tenant: str
    command: str
    code_archive: str
    job_dir: str
    learners: tuple  # of LearnerSpec
    cpus: float
    memory_bytes: int
    gpus: int
    env: dict
    metric_regexes: dict
    checkpoint_signal: str
    grace_seconds: int
    ingest_url: str
    framework: str = "custom"
    framework_version: str = ""
    image: str = ""  # the learner image on container backends (from the framework registry)
    tensorboard_dir: str = ""  # the manifest's TensorBoard folder (learner_agent.tfevents), "" for none
    # The job's disk caps (jobs.disk: results, checkpoints, work, tmp in bytes); empty: none enforced.
    disk: dict = field(default_factory=dict)
    # The job's own number for its learners' uid (jobs.models.LearnerUid); None: one from its id's hash.
    uid_number: int | None = None


def agent_config_base(spec, learner):
    """What every backend puts alike in a learner agent's config (learner_agent.config)."""
    job_dir = Path(spec.job_dir)
    return {"job_id": spec.job_id, "attempt": spec.attempt, "learner": learner.index, "command": spec.command,
            "code_archive": spec.code_archive, "readonly_dirs": [str(job_dir / "data"), str(job_dir / "checkpoints")],
            "metric_regexes": spec.metric_regexes, "tensorboard_dir": spec.tensorboard_dir, "cpus": spec.cpus,
            "memory_bytes": spec.memory_bytes, "checkpoint_signal": spec.checkpoint_signal,
            "grace_seconds": spec.grace_seconds, "uid_number": spec.uid_number}


class LearnerState(str, Enum):
    PENDING = "pending"  # being created, not yet running
    RUNNING = "running"
    EXITED = "exited"  # finished; exit_code says how
    MISSING = "missing"  # the backend has no trace of it (lost node, killed agent, never deployed)


@dataclass(frozen=True)
class LearnerStatus:
    index: int
    state: LearnerState
    exit_code: int | None = None
    reason: str = ""


EXIT_RECORD = "exit.json"  # what the agent writes in its learner's folder when the command has ended
EXIT_RECORD_MAX_BYTES = 64 * 1024


def read_exit_record(folder):
    """The exit record in a learner's folder as {"exit_code": int or None, "reason": str}, or None when
    there is none or it is not one. The learner may write in that folder (on Kubernetes the agent
    runs as its user), so what lies there is anyone's: a named pipe (whose read never ends), a link
    to /dev/zero (endless), an exit code past the column's int32, a NUL or megabytes in the reason.
    It is opened without following a link or waiting for a writer, read only as a small regular
    file, and its fields kept only within what ingest takes of the same record."""
    try:
        fd = os.open(os.path.join(folder, EXIT_RECORD), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, EXIT_RECORD_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        record = json.loads(data) if len(data) <= EXIT_RECORD_MAX_BYTES else None
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    code, reason = record.get("exit_code"), record.get("reason")
    if code is not None and (type(code) is not int or not INT32[0] <= code <= INT32[1]):
        return None
    reason = reason.replace("\0", "")[:MAX_REASON] if isinstance(reason, str) else ""
    return {"exit_code": code, "reason": reason}


@dataclass(frozen=True)
class Capacity:
    nodes: tuple = field(default_factory=tuple)

    @property
    def gpus(self):
        return sum(n.gpus for n in self.nodes)

    @property
    def cpus(self):
        return sum(n.cpus for n in self.nodes)

    @property
    def memory_bytes(self):
        return sum(n.memory_bytes for n in self.nodes)


class Backend(Protocol):
    name: str

    def deploy(self, spec: DeploySpec) -> None: ...

    def status(self, *, tenant: str, job_id: str, attempt: int, learners: int) -> list[LearnerStatus]: ...

    def halt(self, *, tenant: str, job_id: str, attempt: int, learners: int) -> None: ...

    def delete(self, *, tenant: str, job_id: str, attempt: int, learners: int) -> None: ...

    def capacity(self) -> Capacity: ...
