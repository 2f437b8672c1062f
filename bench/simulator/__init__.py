"""Replays job traces through the real scheduling core (see engine.py), with a CSV trace format
(trace.py), a seeded synthetic generator shaped like FfDL's usage (synthetic.py) and the figures the
bench reports (metrics.py)."""
from bench.simulator.engine import JobRecord, Simulation, SimulationResult, equal_quotas
from bench.simulator.metrics import jain_index, percentile, summarise
from bench.simulator.synthetic import synthetic_trace
from bench.simulator.trace import TraceError, TraceJob, read_csv, write_csv

__all__ = ["JobRecord", "Simulation", "SimulationResult", "TraceError", "TraceJob", "equal_quotas", "jain_index",
           "percentile", "read_csv", "summarise", "synthetic_trace", "write_csv"]
