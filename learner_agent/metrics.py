"""Turning a learner's log lines into metric points.

Metrics reach the platform without code changes (SPEC §6): either the learner prints
`TRAINYARD_METRIC {"name": ..., "value": ..., "step": ...}` (what `learner_agent.report` does), or the
manifest's `evaluation_metrics` regexes (FfDL's regex_extractor) match ordinary log lines. Every line is
still shipped as a log line; this module only adds the points found in it.
"""
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time

from learner_agent import METRIC_PREFIX, sandbox

log = logging.getLogger(__name__)

# What the platform stores a step as (int64) and names as (at most 100 characters): a point beyond
# them would be refused there (jobs.ingest_records), so it is not made here.
STEP_RANGE = (-2**63, 2**63 - 1)
MAX_NAME = 100

# Named groups with these names say where in training a line is; they are the step, not metrics.
# When a regex captures several, the first in this order wins: a global counter beats an epoch, and an
# epoch beats a batch index that restarts every epoch.
STEP_FIELDS = ("global_step", "step", "iteration", "iter", "epoch", "batch")


# The longest the regexes may search one line, all groups together, before they are stopped.
SEARCH_TIMEOUT_S = 2.0


class MetricExtractor:
    """`extract(line)` → `[{"name", "value", "step"}, ...]` (step is an int or None).

    `searcher`: where the manifest's regexes run; by default here (RegexSearch), in the agent a
    RegexProcess."""

    def __init__(self, regexes=None, *, searcher=None):
        self._searcher = searcher or RegexSearch(regexes)

    def extract(self, line):
        if line.startswith(METRIC_PREFIX):
            # An explicit report is the whole truth about this line; regexes don't look at it, so a
            # loose regex can't count the same value twice.
            point = _parse_reported(line[len(METRIC_PREFIX):])
            return [point] if point else []
        return self._searcher.points(line)


class RegexSearch:
    """The points the manifest's regexes find in a line, searched in this process."""

    def __init__(self, regexes=None):
        self._groups = [(group, re.compile(regex)) for group, regex in (regexes or {}).items()]

    def points(self, line):
        points = []
        for group, regex in self._groups:
            match = regex.search(line)
            if match:
                points.extend(_points_from_match(group, match))
        return points


class RegexProcess:
    """RegexSearch in a child process (`python -m learner_agent.metrics`), one line at a time.

    The regexes are the researcher's, and one that backtracks catastrophically searches a short line
    for hours. Python's re holds the interpreter lock for a whole search, so in the agent it stopped
    every thread (shipping, halts, the watchdogs) and burnt a core outside the learner's quota. Here
    `started(pid)` puts the child in the learner's control group, so its CPU is the learner's own, and a
    line searched for longer than `timeout_s` has the child killed: from then on no line is searched
    (`stopped` says why, and so does `on_stop(reason)`; TRAINYARD_METRIC lines still count, read by
    the agent itself)."""

    def __init__(self, regexes, *, timeout_s=SEARCH_TIMEOUT_S, started=None, on_stop=None):
        self._regexes, self._timeout_s = dict(regexes), timeout_s
        self._started, self._on_stop = started, on_stop
        self._child = None
        self._unread = b""
        self._lock = threading.Lock()  # one line in the child at a time: stdout's and stderr's readers share it
        self.stopped = "" if self._regexes else "no regexes"

    def points(self, line):
        with self._lock:
            if self.stopped:
                return []
            try:
                if self._child is None:
                    self._start()
                os.write(self._child.stdin.fileno(), json.dumps(line).encode() + b"\n")
                return json.loads(self._answer())
            except TimeoutError:
                self._stop(f"a regex of evaluation_metrics searched one line for over {self._timeout_s:g} s")
            except (OSError, EOFError, ValueError) as e:  # the child died (killed, out of memory) or answered nonsense
                self._stop(f"the process searching the evaluation_metrics regexes failed ({e})")
            return []

    def close(self):
        with self._lock:
            if not self.stopped:
                self._stop("closed", quietly=True)

    def _start(self):
        self._child = subprocess.Popen(
            [sys.executable, "-S", "-m", "learner_agent.metrics"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={"PYTHONPATH": sandbox.PACKAGE_PARENT}, close_fds=True)
        if self._started is not None:
            self._started(self._child.pid)
        os.write(self._child.stdin.fileno(), json.dumps(self._regexes).encode() + b"\n")

    def _answer(self):
        """The child's next line, read within timeout_s."""
        deadline = time.monotonic() + self._timeout_s
        fd = self._child.stdout.fileno()
        while b"\n" not in self._unread:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError()
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("it ended")
            self._unread += chunk
        answer, self._unread = self._unread.split(b"\n", 1)
        return answer

    def _stop(self, reason, *, quietly=False):
        self.stopped = reason
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            for pipe in (self._child.stdin, self._child.stdout):
                pipe.close()
        if self._on_stop is not None and not quietly:
            self._on_stop(reason)


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


def serve(requests, answers):
    """RegexProcess's child: the regexes ({group: regex}) on the first line of `requests`, then one
    JSON line in, its points out, until `requests` ends."""
    searcher = RegexSearch(json.loads(requests.readline()))
    for request in requests:
        answers.write(json.dumps(searcher.points(json.loads(request))).encode() + b"\n")
        answers.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
