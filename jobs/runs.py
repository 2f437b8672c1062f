"""What a run was asked to do, as people compare runs: its command, its manifest as stored (credentials
redacted), its hyperparameters and the experiment trial it belongs to, on the job page; and the jobs
list's chosen hyperparameter and metric columns (`?hp=lr,width&metric=val_acc`).

Hyperparameters and the experiment are read from `Job.runtime` ("hyperparameters": {name: value},
"experiment": {"id", "trial"}), which only experiment trials carry: a job without them shows none.
"""
import json
import math
from dataclasses import dataclass

from django.db.models import Max

from jobs import datastores
from jobs.listing import ListingError
from jobs.models import MetricPoint

MAX_COLUMNS = 8  # per kind: more would not fit beside the list's own columns
MAX_NAME_CHARS = 100  # a metric's name is at most this long (MetricPoint.name)
LONG_MANIFEST_LINES = 20  # a manifest longer than this starts folded on the job page


# --- one job ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunFacts:
    command: str
    manifest_yaml: str  # credentials redacted
    hyperparameters: list  # [(name, value as shown)], by name
    experiment: dict | None  # {"id", "trial"}

    @property
    def manifest_lines(self):
        return len(self.manifest_yaml.splitlines())

    @property
    def manifest_is_long(self):
        return self.manifest_lines > LONG_MANIFEST_LINES


def facts(job):
    """The job's RunFacts. The manifest is redacted again here, as the REST detail does, so no stored
    form (an older row, a manual edit) can show a credential."""
    stored = job.runtime or {}
    return RunFacts(command=str(stored.get("command") or ""),
                    manifest_yaml=datastores.redact_yaml(job.manifest_yaml or ""),
                    hyperparameters=[(name, shown(value)) for name, value in sorted(hyperparameters(job).items())],
                    experiment=experiment(job))


def hyperparameters(job):
    """{name: value} of the trial's hyperparameters; {} for a job that has none."""
    values = (job.runtime or {}).get("hyperparameters")
    return {str(name): value for name, value in values.items()} if isinstance(values, dict) else {}


def experiment(job):
    """{"id", "trial"} of the experiment the job is a trial of, or None."""
    found = (job.runtime or {}).get("experiment")
    if not isinstance(found, dict) or not found.get("id"):
        return None
    return {"id": str(found["id"]), "trial": found.get("trial")}


def shown(value):
    """A hyperparameter's or metric's value as a table cell: floats to 6 significant digits, text as it
    is, anything else as JSON; "—" for nothing (and for NaN and infinity, which are not figures)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "))


# --- the jobs list's columns -----------------------------------------------------------------------
@dataclass(frozen=True)
class Columns:
    """The hyperparameter and metric columns chosen for the jobs list."""
    hyperparameters: tuple = ()
    metrics: tuple = ()

    @classmethod
    def from_params(cls, params):
        return cls(hyperparameters=_names(params, "hp"), metrics=_names(params, "metric"))

    def __bool__(self):
        return bool(self.hyperparameters or self.metrics)

    @property
    def list_fields(self):
        """The Job fields a page's rows need loaded for these columns (the list loads only its own)."""
        return ("runtime",) if self.hyperparameters else ()

    def fill(self, rows):
        """Set `extra_cells` on each job of a page: its value of each hyperparameter, then its latest
        value of each metric. The metrics of the whole page are read in one query."""
        latest = latest_values([job.id for job in rows], self.metrics) if self.metrics and rows else {}
        for job in rows:
            values = hyperparameters(job) if self.hyperparameters else {}
            job.extra_cells = ([shown(values.get(name)) for name in self.hyperparameters]
                               + [shown(latest.get((job.id, name))) for name in self.metrics])


def latest_values(job_ids, names):
    """{(job id, metric name): value} of the most recent point of each named metric of each job, in one
    query: the newest point's id per job and name (the (job, name, id) index answers it), then its value."""
    newest = (MetricPoint.objects.filter(job_id__in=job_ids, name__in=names)
              .values("job_id", "name").annotate(newest=Max("id")).values("newest"))
    return {(job_id, name): value for job_id, name, value in
            MetricPoint.objects.filter(id__in=newest).values_list("job_id", "name", "value")}


def _names(params, key):
    """The comma-separated names of one parameter (repeated parameters add up), in order, once each.
    Refused as soon as there are too many, so an address of thousands of names costs no more than nine."""
    names = {}  # a dict: in order, and a repeat found without a search
    for text in params.getlist(key) if hasattr(params, "getlist") else [params.get(key, "")]:
        for name in (part.strip() for part in text.split(",")):
            if name:
                names[name] = None
            if len(names) > MAX_COLUMNS:
                raise ListingError(key, f"at most {MAX_COLUMNS} names; more given")
    if too_long := next((name for name in names if len(name) > MAX_NAME_CHARS), None):
        raise ListingError(key, f"{too_long[:40]!r}... is longer than {MAX_NAME_CHARS} characters")
    return tuple(names)
