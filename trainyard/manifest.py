"""The job manifest: parsing and validation (SPEC §2).

Django-free on purpose: the CLI's offline `trainyard validate` and the REST API run this same code,
so a manifest that validates on a laptop is accepted by the server. It accepts every FfDL manifest.

Two layers. The YAML is read by a SafeLoader that bounds size, depth and anchors while it composes
(PyYAML has no such limits of its own). The fields are then checked by the pydantic models below,
which are the manifest's schema: `json_schema()` (`trainyard schema`) publishes them for editors,
and every rule a model breaks becomes one ManifestError naming its field, so a submission hears of
every problem at once.
"""
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr, ValidationError, WithJsonSchema,
                      WrapValidator, field_validator, model_validator)
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from learner_agent import tfevents
from trainyard import elasticity, frameworks, units

FRAMEWORKS = tuple(frameworks.REGISTRY)  # what jobs can run as (filters, forms); FfDL names map onto these
DATA_STORE_TYPES = ("s3_datastore", "mount_cos", "local")
PRIORITIES = ("low", "normal", "high")
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
METRIC_EXTRACTORS = ("regex_extractor", "tensorboard")
MAX_LEARNERS = 64
MAX_GPUS = 64  # per learner
MAX_CPUS = 1024  # per learner
MIN_CPUS = 0.001  # a millicore, the least a Kubernetes CPU request or limit can say (less reads as none)
MIN_MEMORY_BYTES = 10**6  # 1MB
MAX_MEMORY_BYTES = 16 * 2**40  # 16384GiB per learner: more than any node has
MAX_MANIFEST_BYTES = 64 * 1024
# The deepest real manifest (evaluation_metrics.groups.<g>.meta.<k>) nests 5 levels; the bound is checked
# while the YAML is composed, so a 20,000-deep `[[[[...]]]]` stops at level 21 instead of recursing.
MAX_DEPTH = 20
# Any number anywhere in a manifest: no field needs more, and the whole manifest is stored as JSON.
MAX_NUMBER = 10**15
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


@dataclass(frozen=True)
class Manifest:
    """A valid manifest, resolved: the framework the job runs as, sizes in bytes, the elastic rules."""
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


def _safe_loader():
    """PyYAML's SafeLoader, with libyaml's scanner and parser (C) under PyYAML's own composer where
    PyYAML was built with libyaml: a manifest's events come several times faster, and the composer
    stays Python, so _ManifestLoader's checks still see every node before anything is built. libyaml
    words some syntax errors differently."""
    try:
        from yaml.cyaml import CParser
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
            raise ManifestError("manifest", f"uses a YAML anchor or alias (&name / *name){_line(event.start_mark)}; "
                                            "write the values out instead")
        if self._depth >= MAX_DEPTH:
            raise ManifestError("manifest", f"nests deeper than {MAX_DEPTH} levels{_line(event.start_mark)}")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        # YAML keeps the last of a repeated key; anything that reads the text itself (the redaction of
        # a data store's credentials, a person reading the manifest) may take the first. One meaning only.
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise ManifestError("manifest", f"has the key {shown(key.value)} twice in one mapping"
                                                    f"{_line(key.start_mark)}; give each key once")
                seen.add(key.value)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        # Python refuses to read an int of more than 4,300 digits with a message about sys; say it plainly.
        if len(node.value) > 1000:
            raise ManifestError("manifest", f"has a number longer than 1000 characters{_line(node.start_mark)}")
        return super().construct_yaml_int(node)


_ManifestLoader.add_constructor("tag:yaml.org,2002:int", _ManifestLoader.construct_yaml_int)


def _line(mark):
    return f" at line {mark.line + 1}" if mark else ""


def parse_manifest(text):
    """Parse and validate a manifest given as YAML text; return a Manifest or raise ManifestError."""
    return parse_fields(load_fields(text))


def parse_fields(data):
    """Validate a manifest's fields as load_fields() read them; return a Manifest or raise ManifestError."""
    return read_fields(data, Document)[1]


def read_fields(data, model):
    """(`data` as `model` read it, the Manifest of its job fields): `model` is Document, or a document
    that adds fields of its own to a job's (an experiment's); ManifestError names every broken rule."""
    document = checked(model, data)  # first, for its messages that give each field's own range
    fields = {key: value for key, value in data.items() if key in Document.model_fields}
    _check_plain(fields, "")  # then every other value, as `raw` is stored
    return document, _resolved(document, fields)


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
        line = _line(getattr(exc, "problem_mark", None))
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
                raise ManifestError(where, f"has the key {shown(key)}; keys must be text")
            if "\x00" in key:
                raise ManifestError(where, f"has the key {shown(key)}, which holds a NUL character")
            _check_plain(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif isinstance(value, str):
        if "\x00" in value:  # no database column stores it
            raise ManifestError(where, "holds a NUL character")
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, (int, float)):
        if not (isinstance(value, int) or math.isfinite(value)):
            raise ManifestError(where, f"{shown(value)} is not a finite number")
        if abs(value) > MAX_NUMBER:
            raise ManifestError(where, f"{shown(value)} is larger than any field allows (at most {MAX_NUMBER:.0e})")
    else:
        raise ManifestError(where, f"is a {type(value).__name__}; write text (quote dates and binary values), "
                                   "a number, true/false, a list or a mapping")


def shown(value, limit=40):
    """A value as shown in an error message: its repr, cut short (a 400-digit number is not echoed back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- the schema -----------------------------------------------------------------------------------
# Each field type below checks one value and words its own refusal (a Broken); checked() turns
# pydantic's report into ManifestErrors, adding the path of the field.

class Broken(ValueError):
    """A rule a value broke, raised inside a model; `at` is where, below the field or model it was
    raised for (e.g. ("max_learners",) from the elastic block's own check)."""

    def __init__(self, rule, *at):
        self.rule = rule
        self.at = at
        super().__init__(rule)


def _text(value):
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise Broken("must be text")
    return str(value).strip()


def _required_text(value):
    if not (text := _text(value)):
        raise Broken("is required")  # given empty; checked() words a missing one with its description
    return text


def _choice(choices, default):
    def check(value):
        if not (text := _text(value) or default):
            raise Broken("is required")
        if text not in choices:
            raise Broken(f"{text!r} is not one of {', '.join(choices)};{_did_you_mean(text, choices)}".rstrip(";"))
        return text
    return check


def _whole_number(low, high):
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, bool) or not isinstance(value, int):
                raise Broken(f"{shown(value)} is not a whole number in {low}..{high}") from None
            raise Broken(f"{shown(value)} is outside {low}..{high}") from None
    return check


def _cpus(value, handler):
    try:
        return handler(value)
    except ValidationError:
        raise Broken(f"{shown(value)} is not a number of CPUs from {MIN_CPUS:g} to {MAX_CPUS} "
                      "(e.g. 2 or 0.5)") from None


def _size(value, low, high, what):
    text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    try:
        size = units.parse_memory_size(text)
    except ValueError as exc:
        raise Broken(f"{shown(value)} is not a {what}; {exc}") from None
    if not low <= size <= high:
        within = f"{high // 2**30}GiB per learner" if what == "memory size" else f"{high // 2**40}TiB"
        raise Broken(f"{shown(value)} is outside 1MB..{within}")
    return size


def Whole(low, high):  # noqa: N802 - a type, read as one in the models
    return Annotated[int, Field(ge=low, le=high, strict=True), WrapValidator(_whole_number(low, high))]


def Choice(*choices, default=None):  # noqa: N802
    return Annotated[str, PlainValidator(_choice(choices, default)), WithJsonSchema({"enum": list(choices)})]


def Size(low, high, what="size"):  # noqa: N802
    return Annotated[int, PlainValidator(lambda value: _size(value, low, high, what)),
                     WithJsonSchema({"type": "string", "pattern": _SIZE_PATTERN, "examples": ["4GiB", "512Mi"]})]


_SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*(" + "|".join(units.MEMORY_UNITS) + r")\s*$"
Text = Annotated[str, PlainValidator(_text), WithJsonSchema({"type": ["string", "number", "null"]})]
RequiredText = Annotated[str, PlainValidator(_required_text), WithJsonSchema({"type": ["string", "number"]})]
CPUs = Annotated[float, Field(ge=MIN_CPUS, le=MAX_CPUS, strict=True, allow_inf_nan=False), WrapValidator(_cpus)]
# A key FfDL defined that Trainyard accepts and ignores; `trainyard validate` notes each one given.
Ignored = Annotated[Any, Field(default=None, description="FfDL's; accepted and ignored")]


class Section(BaseModel):
    """A mapping of a manifest: unknown keys refused; `ffdl_ignored` names FfDL's keys it accepts and ignores."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    ffdl_ignored: typing.ClassVar[tuple] = ()

    def ignored(self):
        return [key for key in self.ffdl_ignored if key in self.model_fields_set]


class Framework(Section):
    ffdl_ignored = ("image_tag", "image_location")
    name: RequiredText = Field(description="one of " + ", ".join(frameworks.names()))
    version: Text = ""
    command: RequiredText = Field(description="the shell command that starts training")
    image_tag: Ignored
    image_location: Ignored
    _resolved: Any = PrivateAttr()

    @model_validator(mode="after")
    def _resolve(self):
        try:
            self._resolved = frameworks.resolve(self.name, self.version)
        except frameworks.FrameworkError as exc:
            raise Broken(exc.rule, exc.field.rsplit(".", 1)[-1]) from None
        return self


MAX_GRACE_SECONDS = 3600


class Checkpoint(Section):
    signal: Choice(*SIGNALS, default="SIGTERM") = "SIGTERM"
    grace_seconds: Whole(0, MAX_GRACE_SECONDS) = 60


class RestartPolicy(Section):
    max_retries: Whole(0, 100) = 0


class BatchSize(Section):
    global_: Whole(1, 10**9) = Field(alias="global")
    min: Whole(1, 10**9)
    max: Whole(1, 10**9)

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise Broken(f"{self.max} is below batch_size.min ({self.min})", "max")
        if not self.min <= self.global_ <= self.max:
            raise Broken(f"{self.global_} is outside batch_size.min..max ({self.min}..{self.max})", "global")
        return self


class ElasticBlock(Section):
    min_learners: Whole(1, MAX_LEARNERS)
    max_learners: Whole(1, MAX_LEARNERS)
    batch_size: BatchSize | None = None
    lr_scaling: Choice(*elasticity.LR_SCALINGS, default="linear") = "linear"

    @model_validator(mode="after")
    def _bounds(self):
        low, high = self.min_learners, self.max_learners
        if low > high:
            raise Broken(f"{high} is below elastic.min_learners ({low})", "max_learners")
        if self.batch_size and (impossible := elasticity.learner_counts_without_batch(self.batches(), low, high)):
            batch = self.batch_size
            raise Broken(f"no multiple of {impossible[0]} learners lies in {batch.min}..{batch.max}; every learner "
                          f"count in {low}..{high} needs a global batch that splits evenly between its learners",
                          "batch_size")
        return self

    def batches(self):
        batch = self.batch_size
        return batch and elasticity.BatchBounds(batch.global_, batch.min, batch.max)


class Container(Section):
    container: RequiredText


class Connection(Section):
    """Where and how to reach an S3 store. auth_url and region are addresses; the rest are credentials
    (stored encrypted, never shown back: jobs.datastores)."""
    auth_url: Text = ""
    region: Text = ""
    user_name: Text = ""
    password: Text = ""
    access_key_id: Text = ""
    secret_access_key: Text = ""
    session_token: Text = ""
    type: Text = ""

    @field_validator("auth_url")
    @classmethod
    def _url(cls, url):
        if url and not re.match(r"https?://[^/\s]+", url):
            raise Broken(f"{url!r} is not an http(s) URL of an S3-compatible endpoint")
        return url

    def credentials(self):
        return any((self.user_name, self.password, self.access_key_id, self.secret_access_key))


class DataStore(Section):
    id: RequiredText
    type: Choice(*DATA_STORE_TYPES)
    training_data: Container | None = None
    training_results: Container | None = None
    connection: Connection | None = None

    @model_validator(mode="after")
    def _fits_its_type(self):
        local = self.type == "local"
        for key in ("training_data", "training_results"):
            if (section := getattr(self, key)) is not None:
                _check_container(section.container, local, key)
        if local and self.connection and self.connection.credentials():
            raise Broken("a local data store (a folder on the platform) takes no credentials", "connection")
        return self


def _check_container(container, local, key):
    """A bucket, optionally with a key prefix (bucket/prefix); for `local`, a folder name."""
    parts = container.split("/")
    if container.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise Broken(f"{container!r} must be a {'folder' if local else 'bucket'} name, optionally followed by "
                      "/prefix, without '..' or empty parts", key, "container")
    if not local and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,62}", parts[0]):
        raise Broken(f"{parts[0]!r} is not an S3 bucket name (3-63 letters, digits, '.', '_', '-')", key, "container")


class MetricGroup(Section):
    ffdl_ignored = ("meta", "scalars", "etimes")
    regex: Annotated[str, PlainValidator(lambda value: _regex(value)), WithJsonSchema({"type": "string"})]
    meta: Ignored
    scalars: Ignored
    etimes: Ignored


def _regex(value):
    if not isinstance(value, str):
        raise Broken("must be text: a regular expression with named groups")
    try:
        compiled = re.compile(value)
    except re.error as exc:
        raise Broken(f"is not a valid regular expression: {exc}") from None
    if not compiled.groupindex:
        raise Broken("has no named groups like (?P<loss>[\\d.]+) to take values from")
    return value


class Metrics(Section):
    type: Choice(*METRIC_EXTRACTORS)
    in_: Text = Field("", alias="in")  # tensorboard: the folder read; FfDL's, and ignored, for regexes
    groups: dict[str, MetricGroup] | None = None
    line_lookahead: Ignored
    event_types: Ignored
    eventTypes: Ignored  # noqa: N815 - FfDL's spelling
    image_tag: Ignored
    ffdl_ignored = ("line_lookahead", "event_types", "eventTypes", "image_tag")

    def ignored(self):
        return super().ignored() + (["in"] if self.type != "tensorboard" and "in_" in self.model_fields_set else [])

    @model_validator(mode="after")
    def _fits_its_type(self):
        if self.type == "tensorboard":
            try:
                tfevents.split_dir(self.in_ or None)
            except tfevents.PathError as exc:
                raise Broken(str(exc), "in") from None
        elif not self.groups:
            raise Broken("must map group names to {regex: ...}", "groups")
        return self


class Disk(Section):
    """Caps on what the job may write (sizes) and on its stored log lines (a count); what each caps is
    jobs.disk's to say."""
    results: Size(MIN_DISK_BYTES, MAX_DISK_BYTES) | None = None
    checkpoints: Size(MIN_DISK_BYTES, MAX_DISK_BYTES) | None = None
    work: Size(MIN_DISK_BYTES, MAX_DISK_BYTES) | None = None
    tmp: Size(MIN_DISK_BYTES, MAX_DISK_BYTES) | None = None
    logs: Size(MIN_DISK_BYTES, MAX_DISK_BYTES) | None = None
    log_lines: Whole(1, MAX_LOG_LINES) | None = None
    data: Size(MIN_DISK_BYTES, MAX_DISK_BYTES) | None = None


class Document(Section):
    """A job manifest's fields (SPEC §2)."""
    model_config = ConfigDict(title="Trainyard job manifest")
    name: Annotated[str, PlainValidator(lambda value: _name(value)),
                    WithJsonSchema({"type": "string", "maxLength": 200})]
    description: Text = ""
    version: Text = ""
    learners: Whole(1, MAX_LEARNERS) = 1
    gpus: Whole(0, MAX_GPUS) = 0
    cpus: CPUs = 1.0
    memory: Size(MIN_MEMORY_BYTES, MAX_MEMORY_BYTES, "memory size") | None = None
    framework: Framework = Field(description="what the job runs: {name, version, command}")
    data_stores: list[DataStore] | None = None
    evaluation_metrics: Metrics | None = None
    priority: Choice(*PRIORITIES, default="normal") = "normal"
    checkpoint: Checkpoint | None = None
    restart_policy: RestartPolicy | None = None
    elastic: ElasticBlock | None = None
    disk: Disk | None = None

    @field_validator("data_stores")
    @classmethod
    def _unique_ids(cls, stores):
        seen, results = set(), None
        for index, store in enumerate(stores or ()):
            if store.id in seen:
                raise Broken(f"{store.id!r} is used by an earlier data store; ids must be unique", index, "id")
            seen.add(store.id)
            if store.training_results is not None:
                # Every results store gets a copy of the job's output: one copy per job.
                if results is not None:
                    raise Broken(f"data store {results!r} already takes the results; one data store may",
                                 index, "training_results")
                results = store.id
        return stores

    @model_validator(mode="after")
    def _starts_within_its_bounds(self):
        if self.elastic and not self.elastic.min_learners <= self.learners <= self.elastic.max_learners:
            raise Broken(f"{self.learners} is outside the elastic bounds {self.elastic.min_learners}.."
                          f"{self.elastic.max_learners} (learners is where an elastic job starts)", "learners")
        return self


def _name(value):
    name = _required_text(value)
    if len(name) > 200:
        raise Broken("is longer than 200 characters")
    return name


def json_schema(model=None):
    """The JSON Schema (draft 2020-12) of a manifest (Document, or an experiment's), for editors and
    other tools; the rules it cannot say (sizes' ranges, the elastic arithmetic, framework versions)
    are checked by `trainyard validate`."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            **(model or Document).model_json_schema(by_alias=True)}


def checked(model, data):
    """`data` validated by `model`, or ManifestError naming every field that breaks a rule, in the
    order the manifest names them (each field and section is checked on its own; a check that needs
    another field's value is skipped while that field is wrong)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        written = {key: index for index, key in enumerate(data)}
        problems = sorted((_problem(error, model) for error in exc.errors()),
                          key=lambda problem: written.get(re.split(r"[.\[]", problem.field)[0], len(written)))
        raise problems[0] if len(problems) == 1 else ManifestProblems(problems) from None


def _resolved(document, data):
    """The Manifest of a valid document, read from `data`."""
    framework, checkpoint = document.framework, document.checkpoint or Checkpoint()
    resolved = framework._resolved
    return Manifest(
        name=document.name, description=document.description, version=document.version,
        command=framework.command, framework=resolved.name, framework_version=resolved.version,
        framework_asked=resolved.asked_as, learners=document.learners, gpus=document.gpus,
        cpus=float(document.cpus), priority=document.priority,
        memory_bytes=document.memory if document.memory is not None else Manifest.memory_bytes,
        checkpoint_signal=checkpoint.signal, grace_seconds=checkpoint.grace_seconds,
        max_retries=(document.restart_policy or RestartPolicy()).max_retries,
        data_stores=data.get("data_stores") or [], evaluation_metrics=data.get("evaluation_metrics"),
        elastic=document.elastic and elasticity.Elastic(
            min_learners=document.elastic.min_learners, max_learners=document.elastic.max_learners,
            batch=document.elastic.batches(), lr_scaling=document.elastic.lr_scaling),
        disk=(document.disk or Disk()).model_dump(exclude_none=True),
        notes=resolved.notes + _notes(document) + tuple(_ignored(document, "")),
        raw=data,
    )


def _problem(error, root):
    """One of pydantic's error reports on a `root` document as the ManifestError a user reads."""
    loc, cause = [part for part in error["loc"] if part != "[key]"], error.get("ctx", {}).get("error")
    if isinstance(cause, Broken):
        return ManifestError(_path(loc + list(cause.at)), cause.rule)
    kind = error["type"]
    if kind == "missing":
        rule = _required(loc, root)
    elif kind == "extra_forbidden":
        loc = list(error["loc"])  # ends with the unknown key as written, even one named "[key]"
        section = _section_at(loc, root)
        known = [f.alias or name for name, f in section.model_fields.items() if name not in section.ffdl_ignored]
        listing = "known fields are" if section is root else f"{_path(loc[:-1])} has"
        suggestion = _did_you_mean(loc[-1], known)
        rule = f"unknown field;{suggestion}" if suggestion else f"unknown field; {listing} {', '.join(known)}"
    else:
        rule = {"model_type": "must be a mapping", "dict_type": "must be a mapping", "list_type": "must be a list",
                "string_type": "must be text", "bool_type": "must be true or false"}.get(kind)
    return ManifestError(_path(loc), rule or error["msg"])


def _required(loc, root):
    """"is required", with what the field is where the schema describes it."""
    info = _field_at(loc, _section_at(loc, root))
    return f"is required: {info.description}" if info and info.description else "is required"


def _path(loc):
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "manifest"


def _section_at(loc, root):
    """The model the key at the end of `loc` was given in (to list the keys it does have)."""
    node = root
    for part in loc[:-1]:
        node = _unwrap(node)
        if typing.get_origin(node) in (list, dict):
            node = typing.get_args(node)[-1]
        elif (info := _field_at([part], node)) is not None:
            node = info.annotation
    return _unwrap(node)


def _field_at(loc, section):
    fields = section.model_fields if isinstance(section, type) and issubclass(section, BaseModel) else {}
    return next((info for name, info in fields.items() if (info.alias or name) == loc[-1]), None)


def _unwrap(annotation):
    """X, from X | None."""
    args = typing.get_args(annotation)
    return next(arg for arg in args if arg is not type(None)) if type(None) in args else annotation


def _ignored(model, path):
    """A note for each FfDL key given anywhere in the manifest that Trainyard accepts and ignores."""
    for key in model.ignored():
        yield f"{path}{key} is an FfDL field Trainyard ignores"
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        if isinstance(value, Section):
            yield from _ignored(value, f"{path}{info.alias or name}.")
        for key, item in items:
            where = f"{path}{info.alias or name}" + (f"[{key}]." if isinstance(key, int) else f".{key}.")
            yield from _ignored(item, where) if isinstance(item, Section) else ()


def _notes(document):
    notes = []
    for store in document.data_stores or ():
        if store.type == "mount_cos":
            notes.append(f"data store {store.id!r}: mount_cos is read as s3_datastore: its training_data is "
                         "downloaded into DATA_DIR before the learners start (no mount), and RESULT_DIR and "
                         "the checkpoints are uploaded to its training_results when the job stores results")
    metrics = document.evaluation_metrics
    if metrics and metrics.type == "tensorboard":
        folder = metrics.in_ or tfevents.DEFAULT_DIR
        notes.append(f"evaluation_metrics: tensorboard scalar summaries are read from {folder} (each learner's "
                     "own JOB_STATE_DIR) while the job runs and charted as <run>/<tag>; images, histograms and "
                     "graphs are not read")
    return tuple(notes)


def _did_you_mean(word, choices):
    """" did you mean 'gpus'?" for a near miss of one of `choices`; "" when nothing is close."""
    close = difflib.get_close_matches(str(word).lower(), [str(c).lower() for c in choices], n=1, cutoff=0.6)
    if not close:
        return ""
    original = next(c for c in choices if str(c).lower() == close[0])
    return f" did you mean {original!r}?"
