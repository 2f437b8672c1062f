"""Job physics read from Pollux's measured traces (../shared/pollux/, its README describes the files).

What the traces say, and how this module reads them:
- Step time: `placements.csv` measures a step per placement (GPUs per node, e.g. "22") and local batch,
  `scalability.csv` per (nodes, GPUs) for 6-16 nodes. A placement is looked up by its multiset of
  per-node GPU counts (the files list some orders of one multiset, e.g. "1212" and "1122": their mean);
  a shape without a measured multiset is interpolated linearly between the measured (nodes, GPUs)
  shapes around it. Between measured local batches step time is linear; below the smallest it is the
  smallest's (a step cannot get cheaper than the fixed cost measured there). A local batch above the
  largest measured on one GPU does not fit in memory: it runs as gradient accumulation, k micro-steps
  of local/k samples, each paying the compute part (step - sync) and the last one the sync.
- Progress: `validation-<batch>.csv` rows give, per interval of training, the progress reached (in
  steps at the smallest traced batch B0, which is what makes runs at different batches comparable),
  the iterations it took, and the squared gradient norm and variance over that interval. Progress
  per step at a traced batch is the trace's own (progress gained / iterations, per interval); it
  equals Pollux's gain s*(phi + 1)/(phi + s) at batch M = s*B0, phi = var/sqr (the noise scale in
  units of B0), except in the first interval or two, where the statistics logged at the interval's
  end are not its average. Between traced batches the gain is interpolated in log-log. phi is what
  a job measures (`measured_phi`): it grows over training, as the traces show.
- A job is done when its progress reaches the B0 run's final progress (the whole training run).
- Batch bounds: B0 to the largest traced batch.
"""
import bisect
import csv
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LOADS = ("0.5", "1.0", "1.5", "2.0")
WORKLOADS = tuple(range(1, 9))
PUBLISHED_POLICIES = ("pollux", "tiresias", "optimus")


def data_dir():
    """The shared data folder: POLLUX_DATA, or ../shared/pollux beside the checkout."""
    configured = os.environ.get("POLLUX_DATA")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[3] / "shared" / "pollux"


def available(root=None):
    return (Path(root) if root else data_dir()).joinpath("traces", "cifar10", "placements.csv").exists()


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@dataclass(frozen=True, eq=False)
class Curve:
    """Step and sync time against local batch for one shape."""
    local: np.ndarray
    step: np.ndarray
    sync: np.ndarray

    def at(self, local):
        """(step, sync) at this local batch: linear between points, flat below, extrapolated above."""
        xs, step, sync = self.local, self.step, self.sync
        if local <= xs[0] or len(xs) == 1:
            return float(step[0]), float(sync[0])
        if local >= xs[-1]:
            slope = (step[-1] - step[-2]) / (xs[-1] - xs[-2])
            return float(step[-1] + slope * (local - xs[-1])), float(sync[-1])
        return float(np.interp(local, xs, step)), float(np.interp(local, xs, sync))


def _curve(rows):
    """Mean step/sync per local batch over rows (several orders of one placement)."""
    by_local = {}
    for row in rows:
        by_local.setdefault(int(row["local_bsz"]), []).append((float(row["step_time"]), float(row["sync_time"])))
    xs = sorted(by_local)
    return Curve(np.array(xs, dtype=float), np.array([np.mean([s for s, _ in by_local[x]]) for x in xs]),
                 np.array([np.mean([y for _, y in by_local[x]]) for x in xs]))


class Application:
    """One application's measured physics. Equality is identity: one instance per application."""

    def __init__(self, name, root=None):
        folder = (Path(root) if root else data_dir()) / "traces" / name
        self.name = name
        placements = _rows(folder / "placements.csv")
        by_multiset, by_shape = {}, {}
        for row in placements:
            counts = tuple(sorted(int(c) for c in row["placement"]))
            by_multiset.setdefault(counts, []).append(row)
            by_shape.setdefault((len(counts), sum(counts)), []).append(row)
        for row in _rows(folder / "scalability.csv"):
            by_shape.setdefault((int(row["num_nodes"]), int(row["num_replicas"])), []).append(row)
        self.exact = {counts: _curve(rows) for counts, rows in by_multiset.items()}
        self.shapes = {shape: _curve(rows) for shape, rows in by_shape.items()}
        self.node_levels = sorted({n for n, _ in self.shapes})
        self.max_local = int(self.exact[(1,)].local[-1])  # what fits in one GPU's memory
        self.traces = {}
        for path in folder.glob("validation-*.csv"):
            rows = _rows(path)
            ends = np.array([float(r["progress"]) for r in rows])
            # A zero squared norm (DeepSpeech2 logs some) is an infinite noise scale: perfect scaling.
            phi = np.array([float(r["grad_var"]) / float(r["grad_sqr"]) if float(r["grad_sqr"]) > 0 else math.inf
                            for r in rows])
            iterations = np.array([float(r["iteration"]) for r in rows])
            gain = np.diff(ends, prepend=0.0) / np.diff(iterations, prepend=0.0)
            self.traces[int(path.stem.split("-")[1])] = (ends, phi, gain)
        self.batches = tuple(sorted(self.traces))
        self.b0 = self.batches[0]
        self.max_batch = self.batches[-1]
        self.target = float(self.traces[self.b0][0][-1])

    def __repr__(self):
        return f"Application({self.name!r})"

    # --- step time --------------------------------------------------------------------------------
    def step_time(self, counts, batch):
        """Seconds per step of global `batch` on a placement given as GPUs per node."""
        return _step_time(self, tuple(sorted(c for c in counts if c)), int(batch))

    def _shape_step(self, nodes, gpus, local):
        """(step, sync) for an unmeasured multiset: interpolated over the measured (nodes, GPUs) shapes."""
        levels = self.node_levels
        low = max((n for n in levels if n <= nodes), default=levels[0])
        high = min((n for n in levels if n >= nodes), default=levels[-1])
        at_low = self._level_step(low, gpus, local)
        if high == low:
            return at_low
        at_high = self._level_step(high, gpus, local)
        w = (nodes - low) / (high - low)
        return tuple((1 - w) * a + w * b for a, b in zip(at_low, at_high))

    def _level_step(self, nodes, gpus, local):
        counts = sorted(g for n, g in self.shapes if n == nodes)
        j = bisect.bisect_left(counts, gpus)
        if j < len(counts) and counts[j] == gpus or j == 0 or j == len(counts):
            return self.shapes[(nodes, counts[min(j, len(counts) - 1)])].at(local)
        g0, g1 = counts[j - 1], counts[j]
        a, b = self.shapes[(nodes, g0)].at(local), self.shapes[(nodes, g1)].at(local)
        w = (gpus - g0) / (g1 - g0)
        return tuple((1 - w) * x + w * y for x, y in zip(a, b))

    # --- statistical efficiency ---------------------------------------------------------------------
    def segments(self, batch):
        """(ends, gain): progress per step is gain[i] until progress reaches ends[i] (the last holds on)."""
        return _segments(self, int(batch))

    def measured_phi(self, batch, progress):
        """What a job at this batch has measured by now: the last interval it has finished (None before
        the first): the platform averages gradient statistics over an interval, never ahead of it."""
        ends, phis = _interpolated(self, int(batch), 1)
        done = bisect.bisect_right(ends, progress)
        return float(phis[done - 1]) if done else None


@functools.lru_cache(maxsize=None)
def _step_time(app, counts, batch):
    gpus = sum(counts)
    local = batch / gpus
    micro_steps = max(1, math.ceil(local / app.max_local - 1e-9))
    micro = local / micro_steps
    curve = app.exact.get(counts)
    step, sync = curve.at(micro) if curve is not None else app._shape_step(len(counts), gpus, micro)
    return micro_steps * (step - sync) + sync


@functools.lru_cache(maxsize=None)
def _interpolated(app, batch, column):
    """(ends, values) of a trace column (1: phi, 2: gain) at this batch: the trace's own at a traced
    batch, else interpolated in log(batch) between the two traced batches around it (the gain in
    log-log), on the union of their interval ends."""
    if batch in app.traces:
        return app.traces[batch][0], app.traces[batch][column]
    batches = app.batches
    i = min(max(1, bisect.bisect_left(batches, batch)), len(batches) - 1)
    lo, hi = batches[i - 1], batches[i]
    w = min(1.0, max(0.0, (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))))
    ends = np.union1d(app.traces[lo][0], app.traces[hi][0])

    def at(b):
        trace_ends, values = app.traces[b][0], app.traces[b][column]
        values = values[np.minimum(np.searchsorted(trace_ends, ends, side="left"), len(trace_ends) - 1)]
        return np.log(values) if column == 2 else values

    mixed = (1 - w) * at(lo) + w * at(hi)
    return ends, np.exp(mixed) if column == 2 else mixed


@functools.lru_cache(maxsize=None)
def _segments(app, batch):
    return _interpolated(app, batch, 2)


@functools.lru_cache(maxsize=None)
def application(name, root=None):
    return Application(name, root)


# --- workloads and published results ----------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadJob:
    name: str
    arrival_s: float
    app: str
    gpus: int  # what the owner asked for (a non-adaptive scheduler runs it so)
    batch: int


def workload(number, load="1.0", root=None):
    folder = "workloads" if load == "1.0" else f"workloads-{load}"
    rows = _rows((Path(root) if root else data_dir()) / folder / f"workload-{number}.csv")
    return [WorkloadJob(r["name"], float(r["time"]), r["application"], int(r["num_replicas"]), int(r["batch_size"]))
            for r in rows]


def published(policy, load, root=None):
    """{workload number: {job name: JCT s}} as Pollux published them."""
    path = (Path(root) if root else data_dir()) / "results-jobload" / f"{policy}-{load}" / "summary.json"
    jcts = json.loads(path.read_text())["jcts"]
    return {int(w.split("-")[1]): jobs for w, jobs in jcts.items()}
