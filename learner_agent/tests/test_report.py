"""`from learner_agent import report`: what learners call to report metrics."""
import json
import subprocess
import sys

import pytest

from learner_agent import report
from learner_agent.metrics import MetricExtractor
from tests.support.agent_runs import PACKAGE_PARENT


def metric_lines(text):
    prefix = "TRAINYARD_METRIC "
    assert all(line.startswith(prefix) for line in text.splitlines())
    return [json.loads(line[len(prefix):]) for line in text.splitlines()]


def test_it_prints_one_metric_line(capsys):
    report("loss", 0.3, step=10)
    assert metric_lines(capsys.readouterr().out) == [{"name": "loss", "value": 0.3, "step": 10}]


def test_it_prints_one_line_per_named_metric(capsys):
    report(loss=0.3, accuracy=0.9, step=10)
    assert metric_lines(capsys.readouterr().out) == [
        {"name": "loss", "value": 0.3, "step": 10}, {"name": "accuracy", "value": 0.9, "step": 10}]


def test_it_leaves_out_a_missing_step(capsys):
    report("loss", 1)
    assert metric_lines(capsys.readouterr().out) == [{"name": "loss", "value": 1.0}]


def test_its_lines_are_what_the_agent_extracts(capsys):
    report("loss", 0.25, step=3)
    line = capsys.readouterr().out.rstrip("\n")
    assert MetricExtractor().extract(line) == [{"name": "loss", "value": 0.25, "step": 3}]


@pytest.mark.parametrize("args, kwargs", [((), {}), (("loss",), {}), ((None, 0.3), {})])
def test_it_refuses_a_call_without_a_metric(args, kwargs):
    with pytest.raises(TypeError):
        report(*args, **kwargs)


def test_its_import_is_cheap():
    code = ("import sys, threading; import learner_agent; "
            "print(threading.active_count(), sorted(m for m in sys.modules if m.startswith('learner_agent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": PACKAGE_PARENT}).stdout
    assert out.strip() == "1 ['learner_agent']"


@pytest.mark.parametrize("step", [1e300, 2**63, -2**63 - 1])
def test_it_refuses_a_step_the_platform_cannot_store(step, capsys):
    with pytest.raises(ValueError, match="between -2\\*\\*63 and 2\\*\\*63-1"):
        report("loss", 0.3, step=step)
    assert capsys.readouterr().out == ""
