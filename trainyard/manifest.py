"""The job manifest: parsing and validation (SPEC §2).

Django-free on purpose: the CLI's offline `trainyard validate` and the REST API run this same code,
so a manifest that validates on a laptop is accepted by the server. It accepts every FfDL manifest.
"""
import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from learner_agent import tfevents
from trainyard import elasticity, frameworks, units

FRAMEWORKS = tuple(frameworks.REGISTRY)  # what jobs can run as (filters, forms); FfDL names map onto these
DATA_STORE_TYPES = ("s3_datastore", "mount_cos", "local")
# What a data store's `connection` may hold. auth_url and region are addresses; the rest are
# credentials (stored encrypted, never shown back: jobs.datastores).
CONNECTION_FIELDS = ("auth_url", "region", "user_name", "password", "access_key_id", "secret_access_key",
                     "session_token", "type")
PRIORITIES = ("low", "normal", "high")
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
METRIC_EXTRACTORS = ("regex_extractor", "tensorboard")
TOP_LEVEL_FIELDS = ("name", "description", "version", "learners", "gpus", "cpus", "memory",
                    "framework", "data_stores", "evaluation_metrics", "priority", "checkpoint",
                    "restart_policy", "elastic", "disk")
MAX_LEARNERS = 64
MAX_GPUS = 64  # per learner
MAX_CPUS = 1024  # per learner
MIN_MEMORY_BYTES = 10**6  # 1MB
MAX_MEMORY_BYTES = 16 * 2**40  # 16384GiB per learner: more than any node has
MAX_MANIFEST_BYTES = 64 * 1024
# The deepest real manifest (evaluation_metrics.groups.<g>.meta.<k>) nests 5 levels; the bound is checked
# while the YAML is composed, so a 20,000-deep `[[[[...]]]]` stops at level 21 instead of recursing.
MAX_DEPTH = 20
# Any number anywhere in a manifest: no field needs more, and the whole manifest is stored as JSON.
MAX_NUMBER = 10**15

# Unknown keys. At the top level and in Trainyard's own sections an unknown key is an error naming it: a
# typo (`gpu: 1`) must not silently run the job with the default. Inside FfDL's sections, keys that FfDL
# defined but Trainyard has no use for are accepted and reported as notes (SPEC §2: every FfDL manifest
# parses, and `trainyard validate` says what was ignored); anything else there is an error too.
SECTION_FIELDS = {
    "framework": (("name", "version", "command"), ("image_tag", "image_location")),
    "checkpoint": (("signal", "grace_seconds"), ()),
    "restart_policy": (("max_retries",), ()),
    "elastic": (("min_learners", "max_learners", "batch_size", "lr_scaling"), ()),
    "elastic_batch": (("global", "min", "max"), ()),
    "data_store": (("id", "type", "training_data", "training_results", "connection"), ()),
    "container": (("container",), ()),
    "evaluation_metrics": (("type", "groups"), ("in", "line_lookahead", "event_types", "eventTypes",
                                                "image_tag")),
    "metric_group": (("regex",), ("meta", "scalars", "etimes")),
    "disk": (("results", "checkpoints", "work", "tmp", "logs", "log_lines"), ()),
}
# The `disk` block's sizes (bytes); `log_lines` is a count. What each caps is jobs.disk's to say.
DISK_SIZES = ("results", "checkpoints", "work", "tmp", "logs")
MIN_DISK_BYTES = 10**6  # 1MB
MAX_DISK_BYTES = 1024 * 2**40  # 1PiB: the tenant's limit and the platform's default bound it in practice
MAX_LOG_LINES = 10**12


class ManifestError(ValueError):
    """A manifest broke a rule; `field` names where (dotted path), the message says which rule.
    `problems` is every rule it broke (this one alone, unless it is ManifestProblems)."""

    def __init__(self, field_name, rule):
        self.field = field_name
        self.rule = rule
        super().__init__(f"{field_name}: {rule}")

    @property
    def problems(self):
        return [self]


class ManifestProblems(ManifestError):
    """Several rules broken at once: each field is checked on its own, so one submission names them all.
    `field` and `rule` are the first's, for callers that show one."""

    def __init__(self, problems):
        self._problems = list(problems)
        first = self._problems[0]
        super().__init__(first.field, first.rule)
        self.args = (f"{len(self._problems)} problems: " + "; ".join(map(str, self._problems)),)

    @property
    def problems(self):
        return list(self._problems)


class _Problems:
    """Collects what each independent check of a manifest finds, to raise them together."""

    def __init__(self):
        self.found = []

    def check(self, run, default=None):
        """run() or, when it breaks a rule, `default` with the problems noted."""
        try:
            return run()
        except ManifestError as exc:
            self.found += exc.problems
            return default

    def raise_any(self):
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ManifestProblems(self.found)


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
    # The elastic block (trainyard.elasticity.Elastic), or None for a job of a fixed size.
    elastic: elasticity.Elastic | None = None
    # The `disk` block as asked ({"results": bytes, ..., "log_lines": n}); caps not named take the
    # platform's defaults (jobs.disk, at submission).
    disk: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    framework_asked: str = ""  # the name the manifest used (an FfDL name maps onto `framework`)
    notes: tuple = ()  # the mappings applied to an FfDL manifest, for `trainyard validate`

    @property
    def metric_regexes(self):
        """{group: regex} when the manifest scrapes metrics from the log with regexes."""
        metrics = self.evaluation_metrics or {}
        if metrics.get("type") != "regex_extractor":
            return {}
        return {name: spec["regex"] for name, spec in (metrics.get("groups") or {}).items()}

    @property
    def tensorboard_dir(self):
        """Where the learner writes TensorBoard event files (`in`, default $LOG_DIR/tb) when the
        manifest asks for them to be read; "" otherwise."""
        metrics = self.evaluation_metrics or {}
        if metrics.get("type") != "tensorboard":
            return ""
        return str(metrics.get("in") or tfevents.DEFAULT_DIR).strip()


def parse_memory(value, field_name="memory"):
    """'4GiB' -> bytes, from 1MB to 16384GiB per learner (the syntax is trainyard.units')."""
    text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    try:
        size = units.parse_memory_size(text)
    except ValueError as exc:
        raise ManifestError(field_name, f"{_shown(value)} is not a memory size; {exc}") from None
    if not MIN_MEMORY_BYTES <= size <= MAX_MEMORY_BYTES:
        raise ManifestError(field_name, f"{_shown(value)} is outside 1MB..{MAX_MEMORY_BYTES // 2**30}GiB "
                                        "per learner")
    return size


def _safe_loader():
    """PyYAML's SafeLoader, with libyaml's scanner and parser (C) under PyYAML's own composer where
    PyYAML was built with libyaml: a manifest's events come several times faster, and the composer
    stays Python, so _ManifestLoader's checks still see every node before anything is built. libyaml words some syntax errors differently."""
    try:
        from yaml._yaml import CParser
    except ImportError:
        return yaml.SafeLoader

    class FastSafeLoader(Composer, CParser, SafeConstructor, Resolver):  # Composer first: compose_node in Python
        def __init__(self, stream):
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
    return FastSafeLoader


class _ManifestLoader(_safe_loader()):
    """SafeLoader that refuses anchors and aliases and bounds nesting as it composes, before anything is
    expanded or recursed into: a 413-byte "billion laughs" document never grows into gigabytes, and a
    20,000-deep document never reaches Python's recursion limit."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise ManifestError("manifest", f"uses a YAML anchor or alias (&name / *name){_line(event)}; "
                                            "write the values out instead")
        if self._depth >= MAX_DEPTH:
            raise ManifestError("manifest", f"nests deeper than {MAX_DEPTH} levels{_line(event)}")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        # Python refuses to read an int of more than 4,300 digits with a message about sys; say it plainly.
        if len(node.value) > 1000:
            raise ManifestError("manifest", f"has a number longer than 1000 characters{_line(node)}")
        return super().construct_yaml_int(node)


_ManifestLoader.add_constructor("tag:yaml.org,2002:int", _ManifestLoader.construct_yaml_int)


def _line(event):
    mark = getattr(event, "start_mark", None)
    return f" at line {mark.line + 1}" if mark else ""


def parse_manifest(text):
    """Parse and validate a manifest given as YAML text; return a Manifest or raise ManifestError."""
    return parse_fields(load_fields(text))


def parse_fields(data):
    """Validate a manifest's fields as load_fields() read them; return a Manifest or raise ManifestError."""
    manifest = validate(data)  # first, for its messages that give each field's own range
    _check_plain(data, "")  # then every other value, as `raw` is stored
    return manifest


def load_fields(text):
    """A manifest's YAML text read into its mapping of fields, within the bounds every manifest keeps
    (size, depth, UTF-8, a mapping at the top); the fields themselves are not checked yet."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError("manifest", f"is larger than {MAX_MANIFEST_BYTES // 1024} KiB")
    try:
        text = text.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError("manifest", "is not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_ManifestLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        if "maximum nesting depth" in str(getattr(exc, "problem", "")):  # libyaml stops at its own limit first
            raise ManifestError("manifest", f"nests deeper than {MAX_DEPTH} levels{line}") from None
        raise ManifestError("manifest", f"is not valid YAML{line}: {getattr(exc, 'problem', exc)}") from None
    except ManifestError:
        raise
    except (ValueError, OverflowError) as exc:  # a scalar YAML recognises but cannot build: 2001-02-30
        raise ManifestError("manifest", f"has a value that cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ManifestError("manifest", "must be a YAML mapping of fields (name, framework, ...)")
    return data


def _check_plain(value, path):
    """Every value is JSON-safe text, a bounded finite number, true/false/null, a list or a mapping with text
    keys: the manifest is stored and shown back as JSON (depth is already bounded by the loader)."""
    where = path or "manifest"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(where, f"has the key {_shown(key)}; keys must be text")
            _check_plain(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif isinstance(value, bool) or value is None or isinstance(value, str):
        return
    elif isinstance(value, (int, float)):
        if not (isinstance(value, int) or math.isfinite(value)):
            raise ManifestError(where, f"{_shown(value)} is not a finite number")
        if abs(value) > MAX_NUMBER:
            raise ManifestError(where, f"{_shown(value)} is larger than any field allows (at most {MAX_NUMBER:.0e})")
    else:
        raise ManifestError(where, f"is a {type(value).__name__}; write text (quote dates and binary values), "
                                   "a number, true/false, a list or a mapping")


def _shown(value, limit=40):
    """A value as shown in an error message: its repr, cut short (a 400-digit number is not echoed back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validate(data: dict[str, Any]) -> Manifest:
    """The Manifest `data` describes, or ManifestError naming every field that breaks a rule (each
    field and section is checked on its own; a check that needs another field's value is skipped
    while that field is wrong)."""
    problems = _Problems()
    for key in sorted(set(map(str, data)) - set(TOP_LEVEL_FIELDS)):
        problems.found.append(ManifestError(key, _unknown_rule(key, TOP_LEVEL_FIELDS, "known fields are")))
    framework = problems.check(lambda: _mapping(data, "framework", required=True), {})
    ignored = problems.check(lambda: _known_keys(framework, "framework", "framework"), ())
    resolved = problems.check(lambda: _framework(framework))
    checkpoint = problems.check(lambda: _mapping(data, "checkpoint"), {})
    ignored += problems.check(lambda: _known_keys(checkpoint, "checkpoint", "checkpoint"), ())
    signal_name = problems.check(lambda: _choice(checkpoint, "signal", "checkpoint.signal", SIGNALS, "SIGTERM"))
    restart = problems.check(lambda: _mapping(data, "restart_policy"), {})
    ignored += problems.check(lambda: _known_keys(restart, "restart_policy", "restart_policy"), ())
    priority = problems.check(lambda: _choice(data, "priority", "priority", PRIORITIES, "normal"))
    memory = data.get("memory")
    learners = problems.check(lambda: _integer(data, "learners", 1, minimum=1, maximum=MAX_LEARNERS))
    data_stores = problems.check(lambda: _data_stores(data.get("data_stores")), [])
    ignored += problems.check(lambda: _data_store_ignored(data_stores), ())
    ignored += problems.check(lambda: _metric_ignored(data.get("evaluation_metrics")), ())
    fields = dict(
        name=problems.check(lambda: _name(data)),
        description=problems.check(lambda: _string(data, "description", "description")),
        version=problems.check(lambda: _string(data, "version", "version")),
        command=problems.check(lambda: _command(framework)),
        gpus=problems.check(lambda: _integer(data, "gpus", 0, minimum=0, maximum=MAX_GPUS)),
        cpus=problems.check(lambda: _cpus(data)),
        memory_bytes=problems.check(lambda: parse_memory(memory) if memory is not None else Manifest.memory_bytes),
        grace_seconds=problems.check(lambda: _integer(checkpoint, "grace_seconds", 60, minimum=0, maximum=3600,
                                                      path="checkpoint.grace_seconds")),
        max_retries=problems.check(lambda: _integer(restart, "max_retries", 0, minimum=0, maximum=100,
                                                    path="restart_policy.max_retries")),
        evaluation_metrics=problems.check(lambda: _evaluation_metrics(data.get("evaluation_metrics"))),
        elastic=problems.check(lambda: _elastic(data, learners)) if learners is not None else None,
        disk=problems.check(lambda: _disk(data)),
        notes=problems.check(lambda: _data_store_notes(data_stores) + _metric_notes(data.get("evaluation_metrics")),
                             ()),
    )
    problems.raise_any()
    return Manifest(
        **dict(fields, notes=resolved.notes + fields["notes"] + ignored),
        framework=resolved.name,
        framework_version=resolved.version,
        framework_asked=resolved.asked_as,
        learners=learners,
        priority=priority,
        checkpoint_signal=signal_name,
        data_stores=data_stores,
        raw=data,
    )


def _framework(section):
    try:
        return frameworks.resolve(_string(section, "name", "framework.name", required=True),
                                  _string(section, "version", "framework.version"))
    except frameworks.FrameworkError as exc:
        raise ManifestError(exc.field, exc.rule) from None


def _choice(section, key, path, choices, default):
    value = _string(section, key, path) or default
    if value not in choices:
        raise ManifestError(path, f"{value!r} is not one of {', '.join(choices)};{_did_you_mean(value, choices)}"
                                  .rstrip(";"))
    return value


def _unknown_rule(key, known, listing):
    suggestion = _did_you_mean(key, known)
    return f"unknown field;{suggestion}" if suggestion else f"unknown field; {listing} {', '.join(known)}"


def _did_you_mean(word, choices):
    """" did you mean 'gpus'?" for a near miss of one of `choices`; "" when nothing is close."""
    close = difflib.get_close_matches(str(word).lower(), [str(c).lower() for c in choices], n=1, cutoff=0.6)
    if not close:
        return ""
    original = next(c for c in choices if str(c).lower() == close[0])
    return f" did you mean {original!r}?"


def _disk(data):
    """`disk`: caps on what the job may write (sizes) and on its stored log lines (a count)."""
    section = _mapping(data, "disk")
    _known_keys(section, "disk", "disk")
    asked = {}
    for key in DISK_SIZES:
        if section.get(key) is not None:
            asked[key] = _size(section[key], f"disk.{key}", MIN_DISK_BYTES, MAX_DISK_BYTES)
    if section.get("log_lines") is not None:
        asked["log_lines"] = _integer(section, "log_lines", 1, minimum=1, maximum=MAX_LOG_LINES,
                                      path="disk.log_lines")
    return asked


def _size(value, path, low, high):
    text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    try:
        size = units.parse_memory_size(text)
    except ValueError as exc:
        raise ManifestError(path, f"{_shown(value)} is not a size; {exc}") from None
    if not low <= size <= high:
        raise ManifestError(path, f"{_shown(value)} is outside 1MB..{high // 2**40}TiB")
    return size


def _elastic(data, learners):
    """The `elastic` block: learner bounds around `learners`, optional batch bounds, the lr rule."""
    section = _mapping(data, "elastic")
    if "elastic" not in data or data["elastic"] is None:
        return None
    _known_keys(section, "elastic", "elastic")
    for key in ("min_learners", "max_learners"):
        if key not in section:
            raise ManifestError(f"elastic.{key}", "is required in an elastic block")
    low = _integer(section, "min_learners", 1, minimum=1, maximum=MAX_LEARNERS, path="elastic.min_learners")
    high = _integer(section, "max_learners", 1, minimum=1, maximum=MAX_LEARNERS, path="elastic.max_learners")
    if low > high:
        raise ManifestError("elastic.max_learners", f"{high} is below elastic.min_learners ({low})")
    if not low <= learners <= high:
        raise ManifestError("learners", f"{learners} is outside the elastic bounds {low}..{high} "
                                        "(learners is where an elastic job starts)")
    scaling = _string(section, "lr_scaling", "elastic.lr_scaling") or "linear"
    if scaling not in elasticity.LR_SCALINGS:
        raise ManifestError("elastic.lr_scaling", f"{scaling!r} is not one of {', '.join(elasticity.LR_SCALINGS)}")
    return elasticity.Elastic(min_learners=low, max_learners=high, batch=_elastic_batch(section, low, high),
                              lr_scaling=scaling)


def _elastic_batch(section, low, high):
    """`elastic.batch_size`: min <= global <= max, and for every learner count a global batch that
    splits evenly between the learners (trainyard.elasticity's rounding rule)."""
    if section.get("batch_size") is None:
        return None
    batch = section["batch_size"]
    if not isinstance(batch, dict):
        raise ManifestError("elastic.batch_size", "must be a mapping with global, min and max")
    _known_keys(batch, "elastic.batch_size", "elastic_batch")
    values = {}
    for key in ("global", "min", "max"):
        if key not in batch:
            raise ManifestError(f"elastic.batch_size.{key}", "is required in batch_size")
        values[key] = _integer(batch, key, 1, minimum=1, maximum=10**9, path=f"elastic.batch_size.{key}")
    if values["min"] > values["max"]:
        raise ManifestError("elastic.batch_size.max", f"{values['max']} is below batch_size.min ({values['min']})")
    if not values["min"] <= values["global"] <= values["max"]:
        raise ManifestError("elastic.batch_size.global", f"{values['global']} is outside batch_size.min..max "
                                                         f"({values['min']}..{values['max']})")
    bounds = elasticity.BatchBounds(values["global"], values["min"], values["max"])
    impossible = elasticity.learner_counts_without_batch(bounds, low, high)
    if impossible:
        n = impossible[0]
        raise ManifestError("elastic.batch_size", f"no multiple of {n} learners lies in {values['min']}..{values['max']}"
                                                  f"; every learner count in {low}..{high} needs a global batch that "
                                                  "splits evenly between its learners")
    return bounds


def _known_keys(section, path, kind):
    """Refuse a key neither Trainyard nor FfDL knows in a section (naming it); return a note for each FfDL key
    Trainyard accepts and ignores."""
    known, ffdl_only = SECTION_FIELDS[kind]
    problems = _Problems()
    problems.found = [ManifestError(f"{path}.{key}", _unknown_rule(key, known, f"{path} has"))
                      for key in section if key not in known and key not in ffdl_only]
    problems.raise_any()
    return tuple(f"{path}.{key} is an FfDL field Trainyard ignores" for key in section if key in ffdl_only)


def _data_store_ignored(stores):
    notes = ()
    for index, store in enumerate(stores):
        notes += _known_keys(store, f"data_stores[{index}]", "data_store")
        for key in ("training_data", "training_results"):
            notes += _known_keys(store.get(key) or {}, f"data_stores[{index}].{key}", "container")
    return notes


def _metric_ignored(metrics):
    if not isinstance(metrics, dict):
        return ()
    notes = _known_keys(metrics, "evaluation_metrics", "evaluation_metrics")
    if metrics.get("type") == "tensorboard":  # `in` is the folder read (see _metric_notes)
        notes = tuple(n for n in notes if not n.startswith("evaluation_metrics.in "))
    groups = metrics.get("groups")
    for group, spec in (groups.items() if isinstance(groups, dict) else ()):
        if isinstance(spec, dict):
            notes += _known_keys(spec, f"evaluation_metrics.groups.{group}", "metric_group")
    return notes


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
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or not 0 < value <= MAX_CPUS:  # `not 0 < nan` holds too; isfinite says it first
        raise ManifestError("cpus", f"{_shown(value)} is not a number of CPUs above 0 and at most {MAX_CPUS} "
                                    "(e.g. 2 or 0.5)")
    return float(value)


def _data_stores(value):
    if value is None:
        return []
    if not isinstance(value, list):
        raise ManifestError("data_stores", "must be a list of data stores")
    seen = set()
    for index, store in enumerate(value):
        path = f"data_stores[{index}]"
        if not isinstance(store, dict):
            raise ManifestError(path, "must be a mapping with id and type")
        store_id = _string(store, "id", f"{path}.id", required=True)
        if store_id in seen:
            raise ManifestError(f"{path}.id", f"{store_id!r} is used by an earlier data store; ids must be unique")
        seen.add(store_id)
        kind = _string(store, "type", f"{path}.type", required=True)
        if kind not in DATA_STORE_TYPES:
            raise ManifestError(f"{path}.type", f"{kind!r} is not one of {', '.join(DATA_STORE_TYPES)}")
        for key in ("training_data", "training_results", "connection"):
            if key in store and not isinstance(store[key], dict):
                raise ManifestError(f"{path}.{key}", "must be a mapping")
        for key in ("training_data", "training_results"):
            if key in store:
                _container(store[key], f"{path}.{key}.container", local=kind == "local")
        _connection(store.get("connection") or {}, f"{path}.connection", kind)
    return value


def _container(section, path, *, local):
    """`container`: a bucket, optionally with a key prefix (bucket/prefix); for `local`, a folder name."""
    container = _string(section, "container", path, required=True)
    parts = container.split("/")
    if container.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ManifestError(path, f"{container!r} must be a {'folder' if local else 'bucket'} name, optionally "
                                  "followed by /prefix, without '..' or empty parts")
    if not local and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,62}", parts[0]):
        raise ManifestError(path, f"{parts[0]!r} is not an S3 bucket name (3-63 letters, digits, '.', '_', '-')")
    return container


def _connection(connection, path, kind):
    unknown = sorted(set(map(str, connection)) - set(CONNECTION_FIELDS))
    if unknown:
        raise ManifestError(f"{path}.{unknown[0]}", f"unknown field; a connection has {', '.join(CONNECTION_FIELDS)}")
    for key, value in connection.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise ManifestError(f"{path}.{key}", "must be text")
    url = str(connection.get("auth_url") or "")
    if url and not re.match(r"https?://[^/\s]+", url):
        raise ManifestError(f"{path}.auth_url", f"{url!r} is not an http(s) URL of an S3-compatible endpoint")
    if kind == "local" and any(connection.get(k) for k in ("user_name", "password", "access_key_id",
                                                           "secret_access_key")):
        raise ManifestError(path, "a local data store (a folder on the platform) takes no credentials")


def _data_store_notes(stores):
    notes = []
    for store in stores:
        if store["type"] == "mount_cos":
            notes.append(f"data store {store['id']!r}: mount_cos is read as s3_datastore: its training_data is "
                         "downloaded into DATA_DIR before the learners start (no mount), and RESULT_DIR and "
                         "the checkpoints are uploaded to its training_results when the job stores results")
    return tuple(notes)


def _metric_notes(metrics):
    if isinstance(metrics, dict) and metrics.get("type") == "tensorboard":
        folder = str(metrics.get("in") or tfevents.DEFAULT_DIR).strip()
        return (f"evaluation_metrics: tensorboard scalar summaries are read from {folder} (each learner's own "
                "JOB_STATE_DIR) while the job runs and charted as <run>/<tag>; images, histograms and "
                "graphs are not read",)
    return ()


def _evaluation_metrics(value):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ManifestError("evaluation_metrics", "must be a mapping with a type")
    kind = value.get("type")
    if kind not in METRIC_EXTRACTORS:
        raise ManifestError("evaluation_metrics.type", f"{kind!r} is not one of {', '.join(METRIC_EXTRACTORS)}")
    if kind == "tensorboard":
        folder = value.get("in")
        if folder is not None and not isinstance(folder, str):
            raise ManifestError("evaluation_metrics.in", "must be a folder path like $JOB_STATE_DIR/logs/tb")
        try:
            tfevents.split_dir(folder)
        except tfevents.PathError as exc:
            raise ManifestError("evaluation_metrics.in", str(exc)) from None
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
        raise ManifestError(path, f"{_shown(value)} is not a whole number in {minimum}..{maximum}")
    if not minimum <= value <= maximum:
        raise ManifestError(path, f"{_shown(value)} is outside {minimum}..{maximum}")
    return value
