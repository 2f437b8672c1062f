"""Metric points from log lines: TRAINYARD_METRIC lines and the manifest's regexes."""
import os
import signal
import time

import pytest

from learner_agent.metrics import MetricExtractor, RegexProcess

REGEXES = {
    "train": r"epoch (?P<epoch>\d+) loss (?P<loss>[\d.]+) acc (?P<acc>\S+)",
    "eval": r"eval step=(?P<step>\d+) .*accuracy=(?P<accuracy>[-\d.e]+)",
    "nostep": r"lr (?P<lr>[\d.e-]+)",
    "both": r"epoch (?P<epoch>\d+) batch (?P<batch>\d+) global_step (?P<global_step>\d+) l=(?P<l>[\d.]+)",
}


@pytest.mark.parametrize("line, expected", [
    ('TRAINYARD_METRIC {"name": "loss", "value": 0.3, "step": 10}', [("loss", 0.3, 10)]),
    ('TRAINYARD_METRIC {"name": "loss", "value": 2}', [("loss", 2.0, None)]),
    ('TRAINYARD_METRIC {"name": "loss", "value": 0.5, "step": 4.0}', [("loss", 0.5, 4)]),
    ('TRAINYARD_METRIC {"name": "loss", "value": "0.5"}', [("loss", 0.5, None)]),
    ('TRAINYARD_METRIC {"name": "loss", "value": 0.3', []),  # broken JSON
    ('TRAINYARD_METRIC ["loss", 0.3]', []),
    ('TRAINYARD_METRIC {"value": 0.3}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": "high"}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": NaN}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": true}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": 1, "step": 1.5}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": 1, "step": "one"}', []),
    ('  TRAINYARD_METRIC {"name": "loss", "value": 1}', []),  # not at the start of the line
    # Nothing the platform would refuse (jobs.ingest_records): the line stays a log line only.
    ('TRAINYARD_METRIC {"name": "loss", "value": 1, "step": 1e300}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": 1, "step": 9223372036854775808}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": 1, "step": 9223372036854775807}', [("loss", 1.0, 2**63 - 1)]),
    ('TRAINYARD_METRIC {"name": "loss", "value": 1e999}', []),
    ('TRAINYARD_METRIC {"name": "loss", "value": 1' + '0' * 400 + '}', []),
    ('TRAINYARD_METRIC {"name": "' + 'x' * 101 + '", "value": 1}', []),
    ('TRAINYARD_METRIC {"name": "lo\\u0007ss", "value": 1}', []),
    ("epoch 99999999999999999999 loss 0.25 acc 0.5", [("train.loss", 0.25, None), ("train.acc", 0.5, None)]),
    ("epoch 3 loss 0.25 acc 0.9", [("train.loss", 0.25, 3), ("train.acc", 0.9, 3)]),
    ("epoch 3 loss 0.25 acc n/a", [("train.loss", 0.25, 3)]),  # non-numeric values are skipped
    ("[12:00] eval step=200 top1 accuracy=7.5e-1", [("eval.accuracy", 0.75, 200)]),
    ("lr 1e-3", [("nostep.lr", 0.001, None)]),
    ("epoch 2 batch 30 global_step 230 l=0.1", [("both.l", 0.1, 230)]),
    ("nothing to see here", []),
])
def test_it_extracts(line, expected):
    points = MetricExtractor(REGEXES).extract(line)
    assert [(p["name"], p["value"], p["step"]) for p in points] == expected


def test_it_does_not_apply_regexes_to_reported_lines():
    extractor = MetricExtractor({"g": r"value\": (?P<v>[\d.]+)"})
    assert extractor.extract('TRAINYARD_METRIC {"name": "loss", "value": 0.3}') == [
        {"name": "loss", "value": 0.3, "step": None}]


def test_it_matches_several_groups_on_one_line():
    extractor = MetricExtractor({"a": r"x=(?P<x>\d+)", "b": r"y=(?P<y>\d+)"})
    assert [p["name"] for p in extractor.extract("x=1 y=2")] == ["a.x", "b.y"]


def test_it_works_without_regexes():
    assert MetricExtractor().extract("epoch 1 loss 0.3") == []


def test_a_reported_metric_nested_past_the_decoders_depth_is_just_a_log_line():
    from learner_agent.metrics import MetricExtractor
    assert MetricExtractor([]).extract("TRAINYARD_METRIC " + "[" * 5000 + "]" * 5000) == []


# A regex that backtracks catastrophically: searching a line of 40 a's for it would take hours.
BACKTRACKING = {"slow": r"(?P<n>(a+)+)b"}
BACKTRACKED_LINE = "a" * 40 + "!"


def test_regexes_searched_in_a_child_process_find_what_they_find_here():
    lines = ["epoch 3 loss 0.25 acc 0.9", "[12:00] eval step=200 top1 accuracy=7.5e-1", "lr 1e-3",
             "epoch 2 batch 30 global_step 230 l=0.1", "nothing to see here", "caf\u00e9 \ud800 epoch 1 loss 2 acc 3"]
    here, child = MetricExtractor(REGEXES), RegexProcess(REGEXES)
    try:
        assert [MetricExtractor(searcher=child).extract(line) for line in lines] == [here.extract(line) for line in lines]
        assert child.stopped == ""
    finally:
        child.close()


def test_a_regex_searching_one_line_past_the_timeout_is_stopped_and_its_process_killed():
    told, pids = [], []
    child = RegexProcess({**REGEXES, **BACKTRACKING}, timeout_s=0.5, started=pids.append, on_stop=told.append)
    extractor = MetricExtractor(searcher=child)
    assert extractor.extract("epoch 1 loss 0.5 acc 0.75") == [
        {"name": "train.loss", "value": 0.5, "step": 1}, {"name": "train.acc", "value": 0.75, "step": 1}]
    began = time.monotonic()
    assert extractor.extract(BACKTRACKED_LINE) == []
    assert time.monotonic() - began < 3
    assert told == ["a regex of evaluation_metrics searched one line for over 0.5 s"] and child.stopped == told[0]
    with pytest.raises(ProcessLookupError):  # killed and reaped: it burns nothing more
        os.kill(pids[0], 0)
    # From then on lines are not searched, and reported metrics still count.
    assert extractor.extract("epoch 2 loss 0.25 acc 0.5") == []
    assert extractor.extract('TRAINYARD_METRIC {"name": "loss", "value": 0.3}') == [
        {"name": "loss", "value": 0.3, "step": None}]
    child.close()
    assert told == [told[0]]  # closing says nothing more


def test_a_child_that_dies_stops_the_search_and_says_so():
    told, pids = [], []
    child = RegexProcess(REGEXES, started=pids.append, on_stop=told.append)
    assert child.points("lr 1e-3") == [{"name": "nostep.lr", "value": 0.001, "step": None}]
    os.kill(pids[0], signal.SIGKILL)  # the kernel's out-of-memory killer, say
    assert child.points("lr 1e-3") == []
    assert len(told) == 1 and told[0].startswith("the process searching the evaluation_metrics regexes failed")
