"""The learner agent, and the one helper learners import from it: `report`.

Learners run with this package's parent on PYTHONPATH, so `from learner_agent import report` works
in any job without installing anything. That is why this module stays tiny and cheap to import: it
must not start threads or pull in the agent's machinery (which lives in the submodules and is only
imported by `python -m learner_agent`).
"""
import json
import sys

__all__ = ["report"]

METRIC_PREFIX = "TRAINYARD_METRIC "


def report(name=None, value=None, *, step=None, **named):
    """Report metrics to the platform: `report("loss", 0.3, step=10)` or `report(loss=0.3, step=10)`.

    Prints one `TRAINYARD_METRIC {...}` line per metric to stdout and flushes, so the agent beside the
    learner picks it up from the log stream in order with the learner's other output. Values are
    converted with float() (numpy scalars and one-element tensors work); non-finite values are
    printed but the agent drops them.
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
    lines = []
    for metric_name, metric_value in metrics:
        point = {"name": str(metric_name), "value": float(metric_value)}
        if step is not None:
            point["step"] = int(step)
        lines.append(METRIC_PREFIX + json.dumps(point) + "\n")
    # One write keeps a multi-metric call together even when the learner prints from threads.
    sys.stdout.write("".join(lines))
    sys.stdout.flush()
