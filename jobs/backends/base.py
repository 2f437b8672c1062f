"""The interface every learner backend implements (local processes, Kubernetes pods).

The lifecycle manager speaks only this interface. Names are deterministic (job id + attempt +
learner index), so repeating a call after a crash is harmless: deploy skips what already runs,
delete ignores what is already gone.
"""
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

# Capacity is reported in the scheduler's own terms (allocatable totals per node), so the snapshot
# takes it as it is. gpu_scheduler is pure Python and imports nothing of the project.
from gpu_scheduler import Node  # noqa: F401 - part of this interface


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

    def logs(self, *, tenant: str, job_id: str, attempt: int, index: int) -> str: ...

    def capacity(self) -> Capacity: ...
