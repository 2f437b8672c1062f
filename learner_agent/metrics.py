"""Turning a learner's log lines into metric points.

Metrics reach the platform without code changes (SPEC §6): either the learner prints
`TRAINYARD_METRIC {"name": ..., "value": ..., "step": ...}` (what `learner_agent.report` does), or the
manifest's `evaluation_metrics` regexes (FfDL's regex_extractor) match ordinary log lines. Every line is
still shipped as a log line; this module only adds the points found in it.
"""
import json
import math
import re

from learner_agent import METRIC_PREFIX

# What the platform stores a step as (int64) and names as (at most 100 characters): a point beyond
# them would be refused there (jobs.ingest_records), so it is not made here.
STEP_RANGE = (-2**63, 2**63 - 1)
MAX_NAME = 100

# Named groups with these names say where in training a line is; they are the step, not metrics.
# When a regex captures several, the first in this order wins: a global counter beats an epoch, and an
# epoch beats a batch index that restarts every epoch.
STEP_FIELDS = ("global_step", "step", "iteration", "iter", "epoch", "batch")


class MetricExtractor:
    """`extract(line)` → `[{"name", "value", "step"}, ...]` (step is an int or None)."""

    def __init__(self, regexes=None):
        self._groups = [(group, re.compile(regex)) for group, regex in (regexes or {}).items()]

    def extract(self, line):
        if line.startswith(METRIC_PREFIX):
            # An explicit report is the whole truth about this line; regexes don't look at it, so a
            # loose regex can't count the same value twice.
            point = _parse_reported(line[len(METRIC_PREFIX):])
            return [point] if point else []
        points = []
        for group, regex in self._groups:
            match = regex.search(line)
            if match:
                points.extend(_points_from_match(group, match))
        return points


def _parse_reported(payload):
    """The point in a TRAINYARD_METRIC line, or None when it is malformed (then it is just a log line)."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):  # RecursionError: `[[[[…` a thousand deep
        return None
    if not isinstance(data, dict):
        return None
    name, value, step = data.get("name"), data.get("value"), data.get("step")
    if not isinstance(name, str) or not _valid_name(name.strip()):
        return None
    value = _finite_number(value)
    if value is None:
        return None
    if step is not None:
        step = _integer(step)
        if step is None:
            return None
    return {"name": name.strip(), "value": value, "step": step}


def _points_from_match(group, match):
    fields = {name: text for name, text in match.groupdict().items() if text is not None}
    step = None
    for name in STEP_FIELDS:
        if name in fields:
            step = _integer(fields[name].strip())
            if step is not None:
                break
    points = []
    for name, text in fields.items():
        if name in STEP_FIELDS:
            continue
        value = _finite_number(text.strip())
        if value is not None and _valid_name(f"{group}.{name}"):
            points.append({"name": f"{group}.{name}", "value": value, "step": step})
    return points


def _valid_name(name):
    """1 to MAX_NAME printable characters (no control or bidi-override characters)."""
    return 0 < len(name) <= MAX_NAME and name.isprintable()


def _finite_number(value):
    """A float, or None for anything else: booleans, text that isn't a number, NaN and infinities
    (which JSON cannot carry and a chart cannot draw)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        value = float(value)
    except (ValueError, OverflowError):  # OverflowError: an int beyond any float (JSON integers have no limit)
        return None
    return value if math.isfinite(value) else None


def _integer(value):
    """An int within STEP_RANGE for 12, "12", 12.0 or "12.0"; None otherwise (1e300 is no step)."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, int):
        number = _finite_number(value)
        if number is None or not number.is_integer():
            return None
        value = int(number)
    low, high = STEP_RANGE
    return value if low <= value <= high else None
