"""The learner agent, and the helpers learners import from it: `report` and `batch_config`.

Learners run with this package's parent on PYTHONPATH, so `from learner_agent import report` works
in any job without installing anything. That is why this module stays tiny and cheap to import: it
must not start threads or pull in the agent's machinery (which lives in the submodules and is only
imported by `python -m learner_agent`).
"""
import json
import math
import os
import sys
from dataclasses import dataclass

__all__ = ["BatchConfig", "batch_config", "report"]

METRIC_PREFIX = "TRAINYARD_METRIC "
# The global batch `batch_config()` falls back to when the platform sets none (a job without an
# `elastic` block, or a bare run) and the caller names no default.
DEFAULT_GLOBAL_BATCH = 64


def report(name=None, value=None, *, step=None, **named):
    """Report metrics to the platform: `report("loss", 0.3, step=10)` or `report(loss=0.3, step=10)`.

    Prints one `TRAINYARD_METRIC {...}` line per metric to stdout and flushes, so the agent beside the
    learner picks it up from the log stream in order with the learner's other output. Values are
    converted with float() (numpy scalars and one-element tensors work); non-finite values are
    printed but the agent drops them.

    Progress of an elastic job: rank 0 calls `report(samples=N)` now and then, where N is the number
    of training samples the whole job has processed so far, counted across attempts (so a resumed
    attempt restores N from its checkpoint and keeps counting). The platform measures the throughput
    of each allocation from the metric named `samples`.
    """
    metrics = []
    if name is not None:
        if value is None:
            raise TypeError("report(name, value): value is required when a name is given")
        metrics.append((name, value))
    elif value is not None:
        raise TypeError("report(name, value): name is required when a value is given")
    metrics.extend(named.items())
    if not metrics:
        raise TypeError("report() needs a metric: report('loss', 0.3) or report(loss=0.3)")
    if step is not None:
        step = int(step)
        if not -2**63 <= step < 2**63:  # the platform stores steps as int64 and would refuse the point
            raise ValueError(f"report(step={step}): a step must be an integer between -2**63 and 2**63-1")
    lines = []
    for metric_name, metric_value in metrics:
        point = {"name": str(metric_name), "value": float(metric_value)}
        if step is not None:
            point["step"] = step
        lines.append(METRIC_PREFIX + json.dumps(point) + "\n")
    # One write keeps a multi-metric call together even when the learner prints from threads.
    sys.stdout.write("".join(lines))
    sys.stdout.flush()


@dataclass(frozen=True)
class BatchConfig:
    """What this attempt of the job should run with (see `batch_config`)."""
    global_batch: int    # samples per optimizer step over all learners; = local_batch * world_size
    local_batch: int     # samples per step on this learner
    lr_scale: float      # multiply the learning rate chosen for the manifest's batch_size.global by this
    world_size: int
    rank: int
    resume_from: str | None  # the checkpoint to continue from, or None for a fresh start


def batch_config(default_global_batch=None):
    """This attempt's batch sizes, learning-rate factor, world size, rank and checkpoint, from the environment.

    Trainyard sets TRAINYARD_GLOBAL_BATCH_SIZE, TRAINYARD_LOCAL_BATCH_SIZE and TRAINYARD_LR_SCALE
    for jobs with an `elastic` block; they change when the platform resizes the job, which it does
    by a checkpoint and a restart, so read them once at start. Unset (a fixed job, a bare run), the
    global batch is `default_global_batch` (else DEFAULT_GLOBAL_BATCH) rounded down to a multiple of
    WORLD_SIZE, as the platform rounds, and the factor is 1. WORLD_SIZE and RANK default to 1 and 0
    (a one-learner job gets neither). A malformed or inconsistent value raises ValueError naming
    the variable.
    """
    world_size = _positive_int("WORLD_SIZE", 1)
    rank = _int("RANK", 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}), got {rank}")
    fallback = DEFAULT_GLOBAL_BATCH if default_global_batch is None else int(default_global_batch)
    if fallback < 1:
        raise ValueError(f"default_global_batch must be a positive integer, got {default_global_batch!r}")
    global_batch = _positive_int("TRAINYARD_GLOBAL_BATCH_SIZE", max(world_size, fallback // world_size * world_size))
    local_batch = _positive_int("TRAINYARD_LOCAL_BATCH_SIZE", global_batch // world_size)
    if local_batch * world_size != global_batch:
        raise ValueError(f"TRAINYARD_LOCAL_BATCH_SIZE ({local_batch}) x WORLD_SIZE ({world_size}) must equal "
                         f"TRAINYARD_GLOBAL_BATCH_SIZE ({global_batch})")
    lr_scale = _env("TRAINYARD_LR_SCALE")
    try:
        lr_scale = 1.0 if lr_scale is None else float(lr_scale)
    except ValueError:
        lr_scale = math.nan
    if not (math.isfinite(lr_scale) and lr_scale > 0):
        raise ValueError(f"TRAINYARD_LR_SCALE must be a positive number, got {_env('TRAINYARD_LR_SCALE')!r}")
    return BatchConfig(global_batch=global_batch, local_batch=local_batch, lr_scale=lr_scale,
                       world_size=world_size, rank=rank, resume_from=_env("RESUME_FROM"))


def _env(name):
    """The variable's value, or None when it is unset or empty (an empty value means "not set")."""
    return os.environ.get(name) or None


def _int(name, default):
    raw = _env(name)
    if raw is None:
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _positive_int(name, default):
    value = _int(name, default)
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {_env(name)!r}")
    return value
