"""The job manifest: parsing and validation (SPEC §2).

Django-free on purpose: the CLI's offline `trainyard validate` and the REST API run this same code,
so a manifest that validates on a laptop is accepted by the server. It accepts every FfDL manifest.
"""
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

FRAMEWORKS = ("pytorch", "tensorflow", "keras", "jax", "sklearn", "custom")
FFDL_FRAMEWORKS = ("caffe", "caffe2", "horovod", "h2o3", "mxnet")
DATA_STORE_TYPES = ("s3_datastore", "mount_cos", "local")
PRIORITIES = ("low", "normal", "high")
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
METRIC_EXTRACTORS = ("regex_extractor", "tensorboard")
MEMORY_UNITS = {"MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30, "Gb": 10**9}
TOP_LEVEL_FIELDS = ("name", "description", "version", "learners", "gpus", "cpus", "memory",
                    "framework", "data_stores", "evaluation_metrics", "priority", "checkpoint",
                    "restart_policy")
MAX_LEARNERS = 64
MAX_MANIFEST_BYTES = 64 * 1024


class ManifestError(ValueError):
    """A manifest broke a rule; `field` names where (dotted path), the message says which rule."""

    def __init__(self, field_name, rule):
        self.field = field_name
        self.rule = rule
        super().__init__(f"{field_name}: {rule}")


@dataclass(frozen=True)
class Manifest:
    name: str
    command: str
    framework: str
    framework_version: str = ""
    description: str = ""
    version: str = ""
    learners: int = 1
    gpus: int = 0
    cpus: float = 1.0
    memory_bytes: int = 2 * 2**30
    priority: str = "normal"
    checkpoint_signal: str = "SIGTERM"
    grace_seconds: int = 60
    max_retries: int = 0
    data_stores: list = field(default_factory=list)
    evaluation_metrics: dict | None = None
    raw: dict = field(default_factory=dict)

    @property
    def metric_regexes(self):
        """{group: regex} when the manifest scrapes metrics from the log with regexes."""
        metrics = self.evaluation_metrics or {}
        if metrics.get("type") != "regex_extractor":
            return {}
        return {name: spec["regex"] for name, spec in (metrics.get("groups") or {}).items()}


def parse_memory(value, field_name="memory"):
    """'4GiB' -> bytes. Only MB, MiB, GB, GiB and Gb are accepted (SPEC §2)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", str(value))
    if not match or match.group(2) not in MEMORY_UNITS:
        raise ManifestError(field_name, f"{value!r} is not a memory size; write a number and one of "
                                        f"{', '.join(MEMORY_UNITS)} (e.g. 4GiB)")
    size = int(float(match.group(1)) * MEMORY_UNITS[match.group(2)])
    if size <= 0:
        raise ManifestError(field_name, "must be more than zero")
    return size


def parse_manifest(text):
    """Parse and validate a manifest given as YAML text; return a Manifest or raise ManifestError."""
    if isinstance(text, bytes):
        if len(text) > MAX_MANIFEST_BYTES:
            raise ManifestError("manifest", f"is larger than {MAX_MANIFEST_BYTES // 1024} KiB")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError("manifest", "is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ManifestError("manifest", f"is not valid YAML{line}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ManifestError("manifest", "must be a YAML mapping of fields (name, framework, ...)")
    return validate(data)


def validate(data: dict[str, Any]) -> Manifest:
    unknown = sorted(set(map(str, data)) - set(TOP_LEVEL_FIELDS))
    if unknown:
        raise ManifestError(unknown[0], f"unknown field; known fields are {', '.join(TOP_LEVEL_FIELDS)}")
    framework = _mapping(data, "framework", required=True)
    framework_name = _string(framework, "name", "framework.name", required=True).lower()
    if framework_name not in FRAMEWORKS + FFDL_FRAMEWORKS:
        raise ManifestError("framework.name", f"{framework_name!r} is not supported; use one of "
                                              f"{', '.join(FRAMEWORKS + FFDL_FRAMEWORKS)}")
    checkpoint = _mapping(data, "checkpoint")
    signal_name = _string(checkpoint, "signal", "checkpoint.signal") or "SIGTERM"
    if signal_name not in SIGNALS:
        raise ManifestError("checkpoint.signal", f"{signal_name!r} is not one of {', '.join(SIGNALS)}")
    restart = _mapping(data, "restart_policy")
    priority = _string(data, "priority", "priority") or "normal"
    if priority not in PRIORITIES:
        raise ManifestError("priority", f"{priority!r} is not one of {', '.join(PRIORITIES)}")
    memory = data.get("memory")
    return Manifest(
        name=_name(data),
        description=_string(data, "description", "description"),
        version=_string(data, "version", "version"),
        command=_command(framework),
        framework=framework_name,
        framework_version=_string(framework, "version", "framework.version"),
        learners=_integer(data, "learners", 1, minimum=1, maximum=MAX_LEARNERS),
        gpus=_integer(data, "gpus", 0, minimum=0, maximum=64),
        cpus=_cpus(data),
        memory_bytes=parse_memory(memory) if memory is not None else Manifest.memory_bytes,
        priority=priority,
        checkpoint_signal=signal_name,
        grace_seconds=_integer(checkpoint, "grace_seconds", 60, minimum=0, maximum=3600,
                               path="checkpoint.grace_seconds"),
        max_retries=_integer(restart, "max_retries", 0, minimum=0, maximum=100,
                             path="restart_policy.max_retries"),
        data_stores=_data_stores(data.get("data_stores")),
        evaluation_metrics=_evaluation_metrics(data.get("evaluation_metrics")),
        raw=data,
    )


def _name(data):
    name = _string(data, "name", "name", required=True)
    if len(name) > 200:
        raise ManifestError("name", "is longer than 200 characters")
    return name


def _command(framework):
    command = framework.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ManifestError("framework.command", "is required: the shell command that starts training")
    return command.strip()


def _cpus(data):
    value = data.get("cpus", 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or value > 1024:
        raise ManifestError("cpus", f"{value!r} is not a number of CPUs between 0 and 1024 (e.g. 2 or 0.5)")
    return float(value)


def _data_stores(value):
    if value is None:
        return []
    if not isinstance(value, list):
        raise ManifestError("data_stores", "must be a list of data stores")
    for index, store in enumerate(value):
        path = f"data_stores[{index}]"
        if not isinstance(store, dict):
            raise ManifestError(path, "must be a mapping with id and type")
        _string(store, "id", f"{path}.id", required=True)
        kind = _string(store, "type", f"{path}.type", required=True)
        if kind not in DATA_STORE_TYPES:
            raise ManifestError(f"{path}.type", f"{kind!r} is not one of {', '.join(DATA_STORE_TYPES)}")
        for key in ("training_data", "training_results", "connection"):
            if key in store and not isinstance(store[key], dict):
                raise ManifestError(f"{path}.{key}", "must be a mapping")
    return value


def _evaluation_metrics(value):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ManifestError("evaluation_metrics", "must be a mapping with a type")
    kind = value.get("type")
    if kind not in METRIC_EXTRACTORS:
        raise ManifestError("evaluation_metrics.type", f"{kind!r} is not one of {', '.join(METRIC_EXTRACTORS)}")
    if kind == "regex_extractor":
        groups = value.get("groups")
        if not isinstance(groups, dict) or not groups:
            raise ManifestError("evaluation_metrics.groups", "must map group names to {regex: ...}")
        for group, spec in groups.items():
            path = f"evaluation_metrics.groups.{group}.regex"
            regex = spec.get("regex") if isinstance(spec, dict) else None
            if not isinstance(regex, str):
                raise ManifestError(path, "is required")
            try:
                compiled = re.compile(regex)
            except re.error as exc:
                raise ManifestError(path, f"is not a valid regular expression: {exc}") from None
            if not compiled.groupindex:
                raise ManifestError(path, "has no named groups like (?P<loss>[\\d.]+) to take values from")
    return value


def _mapping(data, key, *, required=False):
    value = data.get(key)
    if value is None:
        if required:
            raise ManifestError(key, "is required")
        return {}
    if not isinstance(value, dict):
        raise ManifestError(key, "must be a mapping")
    return value


def _string(data, key, path, *, required=False):
    value = data.get(key)
    if value is None or value == "":
        if required:
            raise ManifestError(path, "is required")
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ManifestError(path, "must be text")
    return str(value).strip()


def _integer(data, key, default, *, minimum, maximum, path=None):
    path = path or key
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(path, f"{value!r} is not a whole number")
    if not minimum <= value <= maximum:
        raise ManifestError(path, f"{value} is outside {minimum}..{maximum}")
    return value
