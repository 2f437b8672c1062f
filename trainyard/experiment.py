"""An experiment's manifest: a job manifest plus `hyperparameters` and a `searcher` (SPEC §2).

Django-free, like trainyard.manifest: `trainyard validate` checks an experiment offline with the same
rules the server applies. Every trial of an experiment is a job whose manifest is the experiment's with
the trial's hyperparameters filled in (`trial_fields`).

    hyperparameters:
      lr: {type: log, minval: 0.0001, maxval: 0.1, count: 3}    # count: its points in a grid
      width: {type: int, minval: 16, maxval: 64, count: 3}
      batch_size: {type: categorical, vals: [16, 32, 64]}
      dropout: {type: double, minval: 0.1, maxval: 0.5}
      epochs: 9                                                  # a constant
    searcher:
      name: asha              # grid | random | asha | tpe
      metric: val_acc
      smaller_is_better: false
      max_trials: 27
      max_concurrent_trials: 3
      max_length: 9           # asha: the steps (of the metric) a trial trains at most
      divisor: 3              # asha: one in `divisor` trials of a rung goes on to the next
      min_length: 1           # asha: the steps of the first rung
      max_gpu_hours: 10       # optional: no new trial starts once the trials have used this much

A trial sees its hyperparameters three ways: `{{hparams.NAME}}` in `framework.command` is replaced by
the value (shell-quoted), each is in the environment as TRAINYARD_HP_<NAME>, and all of them are in
$TRAINYARD_HPARAMS as JSON.
"""
import json
import math
import re
import shlex
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from pydantic import (BeforeValidator, ConfigDict, Field, PlainValidator, ValidationError, WithJsonSchema,
                      WrapValidator, field_validator, model_validator)

from trainyard.manifest import (MAX_MANIFEST_BYTES, Broken, Choice, Document, Manifest, ManifestError, ManifestProblems,
                                Section, Whole, load_fields, parse_fields, read_fields, shown)

SEARCHERS = ("grid", "random", "asha", "tpe")
TYPES = ("const", "int", "double", "log", "categorical")
MAX_HYPERPARAMETERS = 32
MAX_CHOICES = 100
MAX_GRID_COUNT = 100
MAX_TRIALS = 10_000
MAX_CONCURRENT_TRIALS = 256
MAX_LENGTH = 10**9
MAX_LISTED = 1000  # whole numbers in an int range listed one by one (a finite space: trainyard.experiment)
MAX_GRID_POINTS = 100_000  # the points of a grid search: every one is a configuration the searcher lists
MAX_FLOAT_TEXT = 24  # the longest repr() of a float ("-1.2345678901234567e-308")
NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
PLACEHOLDER = re.compile(r"\{\{\s*hparams\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# A value goes into commands, environments and database rows: no NUL (no text column stores it) and no
# other control character, C0 or C1, but tab and line breaks.
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
RANGE_FIELDS = {"const": ("type", "val"), "int": ("type", "minval", "maxval", "count"),
                "double": ("type", "minval", "maxval", "count"), "log": ("type", "minval", "maxval", "count"),
                "categorical": ("type", "vals")}


@dataclass(frozen=True)
class Hyperparameter:
    name: str
    type: str  # one of TYPES
    minval: float | None = None
    maxval: float | None = None
    count: int | None = None  # the points a grid takes in the range
    vals: tuple = ()  # categorical choices; a constant's one value

    @property
    def constant(self):
        return self.type == "const"

    def grid_points(self):
        """The values a grid search tries: every choice, or `count` points spread over the range (evenly,
        or evenly in the logarithm for `log`), whole numbers for `int`."""
        if self.type in ("const", "categorical"):
            return list(self.vals)
        count = self.count or (2 if self.type != "int" else min(3, int(self.maxval - self.minval) + 1))
        if count == 1:
            points = [self.minval]
        elif self.type == "log":
            low, high = math.log(self.minval), math.log(self.maxval)
            points = [math.exp(low + (high - low) * i / (count - 1)) for i in range(count)]
        else:
            points = [self.minval + (self.maxval - self.minval) * i / (count - 1) for i in range(count)]
        if self.type == "int":
            return sorted({int(round(point)) for point in points})
        return [float(f"{point:.6g}") for point in points]

    def all_points(self):
        """Every value the hyperparameter can take when there are few enough to list (choices, a
        constant, a range of up to MAX_LISTED whole numbers); None for a continuous range."""
        if self.type in ("const", "categorical"):
            return list(self.vals)
        if self.type == "int" and self.maxval - self.minval < MAX_LISTED:
            return list(range(int(self.minval), int(self.maxval) + 1))
        return None


def _metric_name(value):
    if not isinstance(value, str) or not NAME_PATTERN.match(value.replace(".", "_").replace("-", "_")):
        raise Broken("is required: the name of the metric the trials report")
    return value


def _gpu_hours(value, handler):
    try:
        return handler(value)
    except ValidationError:
        raise Broken(f"{shown(value)} is not a number of GPU-hours above 0") from None


class Searcher(Section):
    """How an experiment chooses its trials' hyperparameters, and when it stops."""
    name: Choice(*SEARCHERS)
    metric: Annotated[str, PlainValidator(_metric_name), WithJsonSchema({"type": "string"})] = Field(
        description="the name of the metric the trials report")
    smaller_is_better: Annotated[bool, Field(strict=True)] = False
    max_trials: Whole(1, MAX_TRIALS) = 16
    max_concurrent_trials: Whole(1, MAX_CONCURRENT_TRIALS) = 4
    max_length: Whole(1, MAX_LENGTH) | None = Field(None, description="asha: the steps a trial trains at most")
    divisor: Whole(2, 100) = 3
    min_length: Whole(1, MAX_LENGTH) = 1
    max_gpu_hours: Annotated[float, Field(gt=0, le=10**6, strict=True, allow_inf_nan=False),
                             WrapValidator(_gpu_hours)] | None = None
    seed: Whole(0, 2**31 - 1) = 0

    @model_validator(mode="after")
    def _asha_lengths(self):
        if self.name == "asha" and self.max_length is None:
            raise Broken("is required for asha: the steps a trial trains at most", "max_length")
        if self.name == "asha" and self.min_length >= self.max_length:
            raise Broken(f"{self.min_length} must be below max_length ({self.max_length})", "min_length")
        return self

    @property
    def direction(self):
        return "minimize" if self.smaller_is_better else "maximize"

    def rungs(self):
        """ASHA's milestones: min_length, x divisor, ... below max_length, then max_length (a trial that
        gets there has finished)."""
        milestones, length = [], self.min_length
        while length < self.max_length:
            milestones.append(length)
            length *= self.divisor
        return milestones + [self.max_length]


@dataclass(frozen=True)
class Experiment:
    name: str
    manifest: Manifest  # the job manifest every trial's is made from (hyperparameters not filled in)
    fields: dict  # the job manifest's fields, as read, without `hyperparameters` and `searcher`
    hyperparameters: tuple  # Hyperparameter, in the manifest's order
    searcher: Searcher

    def varied(self):
        """The hyperparameters a searcher chooses (every one but the constants)."""
        return tuple(hp for hp in self.hyperparameters if not hp.constant)

    def constants(self):
        return {hp.name: hp.vals[0] for hp in self.hyperparameters if hp.constant}

    def finite_space(self):
        """{name: every value} when every varied hyperparameter has a listable set of values, else None."""
        points = {hp.name: hp.all_points() for hp in self.varied()}
        return None if any(values is None for values in points.values()) else points

    def to_json(self):
        """What the server stores for the experiment (and reads back with from_json)."""
        return {"fields": self.fields, "hyperparameters": [{**asdict(hp), "vals": list(hp.vals)}
                                                           for hp in self.hyperparameters],
                "searcher": self.searcher.model_dump()}


def parse_experiment(text):
    """Parse and validate an experiment manifest given as YAML text; raise ManifestError naming every
    rule it breaks."""
    data = load_fields(text)
    document, manifest = read_fields(data, ExperimentDocument)
    hyperparameters = tuple(spec.hyperparameter(name) for name, spec in document.hyperparameters.items())
    problems = _cross_checks(manifest, hyperparameters, document.searcher)
    if problems:
        raise problems[0] if len(problems) == 1 else ManifestProblems(problems)
    fields = {key: value for key, value in data.items() if key not in ("hyperparameters", "searcher")}
    return Experiment(name=manifest.name, manifest=manifest, fields=fields, hyperparameters=hyperparameters,
                      searcher=document.searcher)


def from_json(stored):
    """The Experiment stored with to_json(), validated again (the stored fields passed parse_experiment)."""
    hyperparameters = tuple(Hyperparameter(**{**item, "vals": tuple(item.get("vals") or ())})
                            for item in stored["hyperparameters"])
    searcher = Searcher(**stored["searcher"])
    manifest = parse_fields(json.loads(json.dumps(stored["fields"])))
    return Experiment(name=manifest.name, manifest=manifest, fields=stored["fields"],
                      hyperparameters=hyperparameters, searcher=searcher)


def trial_fields(experiment, params, number):
    """The job manifest fields of trial `number` with hyperparameters `params` (constants included by
    the caller or not: they are added here)."""
    values = {**experiment.constants(), **params}
    fields = json.loads(json.dumps(experiment.fields))
    fields["name"] = f"{experiment.name}-trial-{number}"[:200]
    framework = fields["framework"]
    framework["command"] = render_command(framework["command"], values)
    return fields


def render_command(command, values):
    """`{{hparams.NAME}}` replaced by the value, quoted for the shell."""
    return PLACEHOLDER.sub(lambda match: shlex.quote(_text(values[match.group(1)])), command)


def environment(values):
    """What a trial's learners find in their environment about its hyperparameters."""
    env = {f"TRAINYARD_HP_{name.upper()}": _text(value) for name, value in values.items()}
    env["TRAINYARD_HPARAMS"] = json.dumps(values, sort_keys=True)
    return env


def _text(value):
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- the rules ---------------------------------------------------------------------------------------
def _name(value):
    if not isinstance(value, str) or not NAME_PATTERN.match(value):
        raise Broken("names must be letters, digits and _ (not first), at most 64 characters")
    return value


def _scalar(value):
    if value is None:
        raise Broken("needs a value (text, a number or true/false)")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
        raise Broken(f"{value!r} is not a finite number")
    if not isinstance(value, (bool, int, float)) and (not isinstance(value, str) or len(value) > 200):
        raise Broken("must be text of at most 200 characters, a number or true/false")
    if isinstance(value, str) and (control := CONTROL_CHARACTER.search(value)):
        raise Broken(f"holds the control character {control.group()!r}: a value is printable text (tabs and "
                     "line breaks allowed)")
    return value


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Broken(f"{shown(value)} is not a number")
    if abs(value) > 1e15:
        raise Broken(f"{shown(value)} is out of range")
    return value


Scalar = Annotated[Any, PlainValidator(_scalar), WithJsonSchema({"type": ["string", "number", "boolean"]})]
Number = Annotated[float, PlainValidator(_number), WithJsonSchema({"type": "number"})]


class HyperparameterSpec(Section):
    """A range (int, double, log), choices (categorical) or a constant (const, or a bare value)."""
    type: Choice(*TYPES)
    val: Scalar = None
    vals: list[Scalar] | None = None
    minval: Number | None = None
    maxval: Number | None = None
    count: Whole(1, MAX_GRID_COUNT) | None = Field(None, description="the points a grid search takes in the range")

    @model_validator(mode="after")
    def _fits_its_type(self):
        kind = self.type
        if foreign := sorted(self.model_fields_set - set(RANGE_FIELDS[kind])):
            raise Broken(f"is not a field of a {kind} hyperparameter (it has {', '.join(RANGE_FIELDS[kind][1:])})",
                         foreign[0])
        if kind == "const" and self.val is None:
            raise Broken("needs a value (text, a number or true/false)", "val")
        if kind == "categorical":
            if not self.vals or len(self.vals) > MAX_CHOICES:
                raise Broken(f"must be a list of 1..{MAX_CHOICES} choices", "vals")
            if len({json.dumps(value) for value in self.vals}) != len(self.vals):
                raise Broken("lists a choice twice", "vals")
        if kind in ("int", "double", "log"):
            self._check_range()
        return self

    def _check_range(self):
        for key in ("minval", "maxval"):
            value = getattr(self, key)
            if value is None or (self.type == "int" and not isinstance(value, int)):
                raise Broken(f"{shown(value)} is not {'a whole number' if self.type == 'int' else 'a number'}", key)
        if not self.minval < self.maxval:
            raise Broken(f"minval ({self.minval}) must be less than maxval ({self.maxval})")
        if self.type == "log" and self.minval <= 0:
            raise Broken(f"{self.minval} must be above 0 for a log-scaled range", "minval")

    def hyperparameter(self, name):
        if self.type in ("const", "categorical"):
            return Hyperparameter(name, self.type, vals=(self.val,) if self.type == "const" else tuple(self.vals))
        return Hyperparameter(name, self.type, minval=self.minval, maxval=self.maxval, count=self.count)


class ExperimentDocument(Document):
    """An experiment manifest's fields: a job manifest's, the hyperparameters and the searcher."""
    model_config = ConfigDict(title="Trainyard experiment manifest")
    hyperparameters: dict[Annotated[str, PlainValidator(_name)], Annotated[
        HyperparameterSpec, BeforeValidator(lambda spec: spec if isinstance(spec, dict) else
                                            {"type": "const", "val": spec})]] = Field(
        description="the values its trials vary")
    searcher: Searcher = Field(description="a mapping with name and metric")

    @field_validator("hyperparameters")
    @classmethod
    def _some(cls, hyperparameters):
        if not hyperparameters:
            raise Broken("must be a mapping of names to ranges, choices or constants")
        if len(hyperparameters) > MAX_HYPERPARAMETERS:
            raise Broken(f"has {len(hyperparameters)} entries; at most {MAX_HYPERPARAMETERS}")
        seen = {}  # a trial's environment names each upper-cased (environment()): one would hide another
        for name in hyperparameters:
            if (other := seen.setdefault(name.upper(), name)) != name:
                raise Broken(f"is TRAINYARD_HP_{name.upper()} in a trial's environment, as {other} is: give "
                             "names that differ in more than case", name)
        return hyperparameters


def _cross_checks(manifest, hyperparameters, searcher):
    """What only the parts together can say (of those that passed their own rules)."""
    problems = []
    names = {hp.name for hp in hyperparameters}
    for match in PLACEHOLDER.finditer(manifest.command):
        if match.group(1) not in names:
            problems.append(ManifestError("framework.command", f"uses {{{{hparams.{match.group(1)}}}}}, which is "
                                                               "not among the hyperparameters"))
    if not any(not hp.constant for hp in hyperparameters):
        problems.append(ManifestError("hyperparameters", "are all constants: an experiment varies at least one"))
    if searcher.name == "grid":
        for hp in hyperparameters:
            if hp.type in ("double", "log") and hp.count is None:
                problems.append(ManifestError(f"hyperparameters.{hp.name}.count",
                                              "is required for a grid search over a continuous range"))
        if not problems and (points := math.prod(len(hp.grid_points()) for hp in hyperparameters)) > MAX_GRID_POINTS:
            problems.append(ManifestError("hyperparameters", f"make a grid of {points:,} points; a grid search "
                                                             f"takes at most {MAX_GRID_POINTS:,}"))
    if not problems:
        longest = {hp.name: _longest_text(hp) for hp in hyperparameters}
        rendered = len(PLACEHOLDER.sub(lambda match: "x" * longest[match.group(1)], manifest.command).encode())
        if rendered > MAX_MANIFEST_BYTES:
            problems.append(ManifestError("framework.command", f"becomes {rendered:,} bytes with the longest values "
                                                               f"of its hyperparameters; a trial's command may "
                                                               f"have {MAX_MANIFEST_BYTES:,}"))
    return problems


def _longest_text(hp):
    """The most characters `{{hparams.NAME}}` can become in a command (render_command) for `hp`."""
    if hp.vals:
        return max(len(shlex.quote(_text(value)).encode()) for value in hp.vals)
    if hp.type == "int":
        return max(len(str(int(hp.minval))), len(str(int(hp.maxval))))
    return MAX_FLOAT_TEXT
