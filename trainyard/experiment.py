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
from dataclasses import dataclass

from trainyard.manifest import ManifestError, ManifestProblems, Manifest, load_fields, parse_fields

SEARCHERS = ("grid", "random", "asha", "tpe")
TYPES = ("const", "int", "double", "log", "categorical")
MAX_HYPERPARAMETERS = 32
MAX_CHOICES = 100
MAX_GRID_COUNT = 100
MAX_TRIALS = 10_000
MAX_CONCURRENT_TRIALS = 256
MAX_LENGTH = 10**9
MAX_LISTED = 1000  # whole numbers in an int range listed one by one (a finite space: trainyard.experiment)
NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
PLACEHOLDER = re.compile(r"\{\{\s*hparams\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
SEARCHER_FIELDS = ("name", "metric", "smaller_is_better", "max_trials", "max_concurrent_trials", "max_length",
                   "divisor", "min_length", "max_gpu_hours", "seed")
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


@dataclass(frozen=True)
class Searcher:
    name: str
    metric: str
    smaller_is_better: bool = False
    max_trials: int = 16
    max_concurrent_trials: int = 4
    max_length: int | None = None
    divisor: int = 3
    min_length: int = 1
    max_gpu_hours: float | None = None
    seed: int = 0

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

    def better(self, a, b):
        """Whether metric value a beats b."""
        return a < b if self.smaller_is_better else a > b


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

    def grid_size(self):
        return math.prod(len(hp.grid_points()) for hp in self.varied())

    def finite_space(self):
        """{name: every value} when every varied hyperparameter has a listable set of values, else None."""
        points = {hp.name: hp.all_points() for hp in self.varied()}
        return None if any(values is None for values in points.values()) else points

    def to_json(self):
        """What the server stores for the experiment (and reads back with from_json)."""
        return {"fields": self.fields, "hyperparameters": [_hp_json(hp) for hp in self.hyperparameters],
                "searcher": {name: getattr(self.searcher, name) for name in SEARCHER_FIELDS}}


def parse_experiment(text):
    """Parse and validate an experiment manifest given as YAML text; raise ManifestError naming every
    rule it breaks."""
    data = load_fields(text)
    problems = []
    hp_data, searcher_data = data.pop("hyperparameters", None), data.pop("searcher", None)
    hyperparameters = searcher = manifest = None
    for run in (lambda: _hyperparameters(hp_data), lambda: _searcher(searcher_data)):
        try:
            result = run()
        except ManifestError as exc:
            problems += exc.problems
            continue
        if isinstance(result, Searcher):
            searcher = result
        else:
            hyperparameters = result
    try:
        manifest = parse_fields(data)
    except ManifestError as exc:
        problems += exc.problems
    problems += _cross_checks(manifest, hyperparameters, searcher)
    if problems:
        raise problems[0] if len(problems) == 1 else ManifestProblems(problems)
    return Experiment(name=manifest.name, manifest=manifest, fields=data, hyperparameters=hyperparameters,
                      searcher=searcher)


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


def _hp_json(hp):
    return {"name": hp.name, "type": hp.type, "minval": hp.minval, "maxval": hp.maxval, "count": hp.count,
            "vals": list(hp.vals)}


# --- the rules --------------------------------------------------------------------------------------
def _hyperparameters(data):
    if data is None:
        raise ManifestError("hyperparameters", "is required in an experiment: the values its trials vary")
    if not isinstance(data, dict) or not data:
        raise ManifestError("hyperparameters", "must be a mapping of names to ranges, choices or constants")
    if len(data) > MAX_HYPERPARAMETERS:
        raise ManifestError("hyperparameters", f"has {len(data)} entries; at most {MAX_HYPERPARAMETERS}")
    found, problems = [], []
    for name, spec in data.items():
        try:
            found.append(_hyperparameter(name, spec))
        except ManifestError as exc:
            problems += exc.problems
    if problems:
        raise problems[0] if len(problems) == 1 else ManifestProblems(problems)
    return tuple(found)


def _hyperparameter(name, spec):
    path = f"hyperparameters.{name}"
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ManifestError(path, "names must be letters, digits and _ (not first), at most 64 characters")
    if not isinstance(spec, dict):
        _scalar(spec, path)
        return Hyperparameter(name, "const", vals=(spec,))
    kind = spec.get("type")
    if kind not in TYPES:
        raise ManifestError(f"{path}.type", f"{kind!r} is not one of {', '.join(TYPES)}")
    unknown = sorted(set(spec) - set(RANGE_FIELDS[kind]))
    if unknown:
        raise ManifestError(f"{path}.{unknown[0]}", f"is not a field of a {kind} hyperparameter (it has "
                                                    f"{', '.join(RANGE_FIELDS[kind][1:])})")
    if kind == "const":
        _scalar(spec.get("val"), f"{path}.val")
        return Hyperparameter(name, "const", vals=(spec.get("val"),))
    if kind == "categorical":
        vals = spec.get("vals")
        if not isinstance(vals, list) or not vals or len(vals) > MAX_CHOICES:
            raise ManifestError(f"{path}.vals", f"must be a list of 1..{MAX_CHOICES} choices")
        for index, value in enumerate(vals):
            _scalar(value, f"{path}.vals[{index}]")
        if len({json.dumps(value) for value in vals}) != len(vals):
            raise ManifestError(f"{path}.vals", "lists a choice twice")
        return Hyperparameter(name, "categorical", vals=tuple(vals))
    whole = kind == "int"
    low, high = (_number(spec.get(key), f"{path}.{key}", whole=whole) for key in ("minval", "maxval"))
    if not low < high:
        raise ManifestError(path, f"minval ({low}) must be less than maxval ({high})")
    if kind == "log" and low <= 0:
        raise ManifestError(f"{path}.minval", f"{low} must be above 0 for a log-scaled range")
    count = spec.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or not 1 <= count <= MAX_GRID_COUNT):
        raise ManifestError(f"{path}.count", f"{count!r} is not a whole number in 1..{MAX_GRID_COUNT}")
    return Hyperparameter(name, kind, minval=low, maxval=high, count=count)


def _scalar(value, path):
    if isinstance(value, bool) or value is None:
        if value is None:
            raise ManifestError(path, "needs a value (text, a number or true/false)")
        return
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ManifestError(path, f"{value!r} is not a finite number")
        return
    if not isinstance(value, str) or len(value) > 200:
        raise ManifestError(path, "must be text of at most 200 characters, a number or true/false")


def _number(value, path, *, whole):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ManifestError(path, f"{value!r} is not {'a whole number' if whole else 'a number'}")
    if whole and not isinstance(value, int):
        raise ManifestError(path, f"{value!r} is not a whole number")
    if abs(value) > 1e15:
        raise ManifestError(path, f"{value!r} is out of range")
    return value


def _searcher(data):
    if not isinstance(data, dict):
        raise ManifestError("searcher", "is required in an experiment: a mapping with name and metric")
    unknown = sorted(set(data) - set(SEARCHER_FIELDS))
    if unknown:
        raise ManifestError(f"searcher.{unknown[0]}", f"is not a searcher field ({', '.join(SEARCHER_FIELDS)})")
    name = data.get("name")
    if name not in SEARCHERS:
        raise ManifestError("searcher.name", f"{name!r} is not one of {', '.join(SEARCHERS)}")
    metric = data.get("metric")
    if not isinstance(metric, str) or not NAME_PATTERN.match(metric.replace(".", "_").replace("-", "_")):
        raise ManifestError("searcher.metric", "is required: the name of the metric the trials report")
    smaller = data.get("smaller_is_better", False)
    if not isinstance(smaller, bool):
        raise ManifestError("searcher.smaller_is_better", "must be true or false")
    max_trials = _whole(data, "max_trials", 16, 1, MAX_TRIALS)
    concurrent = _whole(data, "max_concurrent_trials", 4, 1, MAX_CONCURRENT_TRIALS)
    max_length = data.get("max_length")
    if max_length is not None:
        max_length = _whole(data, "max_length", None, 1, MAX_LENGTH)
    elif name == "asha":
        raise ManifestError("searcher.max_length", "is required for asha: the steps a trial trains at most")
    divisor = _whole(data, "divisor", 3, 2, 100)
    min_length = _whole(data, "min_length", 1, 1, MAX_LENGTH)
    if name == "asha" and min_length >= max_length:
        raise ManifestError("searcher.min_length", f"{min_length} must be below max_length ({max_length})")
    budget = data.get("max_gpu_hours")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not math.isfinite(budget) or not 0 < budget <= 10**6):
        raise ManifestError("searcher.max_gpu_hours", f"{budget!r} is not a number of GPU-hours above 0")
    seed = _whole(data, "seed", 0, 0, 2**31 - 1)
    return Searcher(name=name, metric=metric, smaller_is_better=smaller, max_trials=max_trials,
                    max_concurrent_trials=concurrent, max_length=max_length, divisor=divisor,
                    min_length=min_length, max_gpu_hours=budget, seed=seed)


def _whole(data, key, default, low, high):
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ManifestError(f"searcher.{key}", f"{value!r} is not a whole number in {low}..{high}")
    return value


def _cross_checks(manifest, hyperparameters, searcher):
    """What only the parts together can say (of those that passed their own rules)."""
    problems = []
    if hyperparameters is None:
        return problems
    names = {hp.name for hp in hyperparameters}
    for match in PLACEHOLDER.finditer(manifest.command if manifest else ""):
        if match.group(1) not in names:
            problems.append(ManifestError("framework.command", f"uses {{{{hparams.{match.group(1)}}}}}, which is "
                                                               "not among the hyperparameters"))
    if not any(not hp.constant for hp in hyperparameters):
        problems.append(ManifestError("hyperparameters", "are all constants: an experiment varies at least one"))
    if searcher is not None and searcher.name == "grid":
        for hp in hyperparameters:
            if hp.type in ("double", "log") and hp.count is None:
                problems.append(ManifestError(f"hyperparameters.{hp.name}.count",
                                              "is required for a grid search over a continuous range"))
    return problems
