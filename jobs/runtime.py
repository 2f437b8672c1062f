"""What the steps after submission need from a job's manifest, stored on the job at submission.

Deploy, finish and the data transfers read `Job.runtime` (with learners, gpus, cpus and memory_bytes,
which are columns), never the stored manifest: the manifest rules may be tightened after a job was
accepted, and a job accepted under the old rules must still run, finish and store its results.

The stored mapping carries `version`; `of()` reads every version it knows. Jobs submitted before this
existed got theirs from a data migration; one whose manifest no longer parsed then is marked with
`unreadable` (the parse error) and fails with that reason when a step needs it.
"""
from dataclasses import dataclass, field

from jobs import datastores, disk
from trainyard import elasticity

VERSION = 1


class RuntimeUnavailable(Exception):
    """The job has no usable runtime fields (an old job whose manifest no longer parses)."""


@dataclass(frozen=True)
class Runtime:
    command: str
    framework: str
    framework_version: str = ""
    checkpoint_signal: str = "SIGTERM"
    grace_seconds: int = 60
    max_retries: int = 0
    metric_regexes: dict = field(default_factory=dict)
    tensorboard_dir: str = ""  # where the learners write TensorBoard event files to read ("": none)
    # The manifest's data stores with every credential redacted (the credentials are sealed beside the job).
    data_stores: tuple = ()
    # The manifest's elastic block (trainyard.elasticity.Elastic); None for a job of a fixed size.
    elastic: elasticity.Elastic | None = None
    # The job's disk caps (jobs.disk: results, checkpoints, work, tmp, logs, log_lines).
    disk: dict = field(default_factory=dict)
    # An experiment's trial: its hyperparameters ({name: value}) and {"id": experiment, "trial": number}.
    hyperparameters: dict = field(default_factory=dict)
    experiment: dict | None = None

    def stores_with(self, section):
        """The data stores that have `section` (training_data or training_results)."""
        return [store for store in self.data_stores if section in store]


def from_manifest(manifest, *, disk_caps=None):
    """The mapping stored in Job.runtime for a parsed trainyard.manifest.Manifest; `disk_caps` as
    jobs.disk.caps_for decided them for its tenant."""
    return {"version": VERSION, "command": manifest.command, "framework": manifest.framework,
            "framework_version": manifest.framework_version, "checkpoint_signal": manifest.checkpoint_signal,
            "grace_seconds": manifest.grace_seconds, "max_retries": manifest.max_retries,
            "metric_regexes": dict(manifest.metric_regexes), "tensorboard_dir": manifest.tensorboard_dir,
            "data_stores": datastores.redact({"data_stores": list(manifest.data_stores)})["data_stores"],
            "elastic": manifest.elastic.to_runtime() if manifest.elastic else None,
            "disk": dict(disk_caps or {})}


def unreadable(error):
    """The mapping stored for a job whose manifest could not be read when runtime fields were added."""
    return {"version": VERSION, "unreadable": str(error)}


def of(job):
    """The job's Runtime; RuntimeUnavailable says why there is none."""
    stored = job.runtime or {}
    if stored.get("unreadable"):
        raise RuntimeUnavailable(f"its stored manifest could not be read: {stored['unreadable']}")
    if stored.get("version") != VERSION:
        raise RuntimeUnavailable(f"its runtime fields have version {stored.get('version')!r}; this platform "
                                 f"reads version {VERSION}")
    return Runtime(command=stored["command"], framework=stored["framework"],
                   framework_version=stored.get("framework_version", ""),
                   checkpoint_signal=stored.get("checkpoint_signal", "SIGTERM"),
                   grace_seconds=stored.get("grace_seconds", 60), max_retries=stored.get("max_retries", 0),
                   metric_regexes=dict(stored.get("metric_regexes") or {}),
                   tensorboard_dir=stored.get("tensorboard_dir", ""),
                   data_stores=tuple(stored.get("data_stores") or ()),
                   elastic=elasticity.Elastic.from_runtime(stored.get("elastic")),
                   disk=disk.stored_caps(stored.get("disk")),
                   hyperparameters=dict(stored.get("hyperparameters") or {}), experiment=stored.get("experiment"))
