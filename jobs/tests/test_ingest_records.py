"""Each field of an ingest record, checked on its own (jobs.ingest_records)."""
import pytest

from jobs.ingest_records import MAX_NAME, MAX_TIME, problem


def metric(**fields):
    return {"seq": 1, "kind": "metric", "name": "loss", "value": 0.5, "step": 1, "time": 1763726400.0, **fields}


def status(**fields):
    return {"seq": 1, "kind": "status", "state": "exited", "exit_code": 0, "reason": "", "time": 1763726400.0, **fields}


@pytest.mark.parametrize("record", [
    metric(), metric(step=None), metric(step=2**63 - 1), metric(step=-2**63), metric(step=1e18), metric(value=7),
    metric(name="val/top-5 acc@1 ü"), metric(time=None), metric(time=0), metric(time=MAX_TIME),
    {"seq": 1, "kind": "log", "stream": "stdout", "line": "x", "time": 1.5},
    {"seq": 1, "kind": "log", "stream": "weird", "line": "tab\there"},  # an odd stream is stdout, not refused
    status(), status(exit_code=None), status(exit_code=-9), status(reason=None), status(reason="x" * 10**5),
    {"seq": 1, "kind": "status", "state": "running", "time": 2.0},
    {"seq": 1, "kind": "tfevent", "file": "x", "offset": 0, "data": ""},  # its own fields: jobs.tensorboard
])
def test_it_passes_what_can_be_stored(record):
    assert problem(record) is None


@pytest.mark.parametrize("record, field", [
    (metric(step=1e300), "step"), (metric(step=2**63), "step"), (metric(step=-2**63 - 1), "step"),
    (metric(step=10**400), "step"), (metric(step=1.5), "step"), (metric(step="3"), "step"), (metric(step=True), "step"),
    (metric(step=float("inf")), "step"), (metric(step=float("nan")), "step"),
    (metric(value=float("nan")), "value"), (metric(value=float("inf")), "value"), (metric(value=-float("inf")), "value"),
    (metric(value=10**400), "value"), (metric(value="0.5"), "value"), (metric(value=None), "value"),
    (metric(value=False), "value"),
    (metric(name=""), "name"), (metric(name="x" * (MAX_NAME + 1)), "name"), (metric(name="a\nb"), "name"),
    (metric(name="evil\u202egnp"), "name"), (metric(name="\udcff"), "name"), (metric(name=3), "name"),
    (metric(time=1e300), "time"), (metric(time=-1), "time"), (metric(time=float("nan")), "time"),
    (metric(time="soon"), "time"), (metric(time=MAX_TIME + 1), "time"), (metric(time=10**400), "time"),
    ({"seq": 1, "kind": "log", "line": 5}, "line"), ({"seq": 1, "kind": "log", "line": None}, "line"),
    (status(exit_code=2**31), "exit_code"), (status(exit_code=1e300), "exit_code"), (status(exit_code="0"), "exit_code"),
    (status(reason=["x"]), "reason"), (status(state="exploded"), "state"),
    ({"seq": 1, "kind": "surprise"}, "kind"), ({"seq": 1}, "kind"),
])
def test_it_names_the_field_that_is_wrong(record, field):
    assert problem(record).startswith(f"{field}: must be")


def test_the_step_error_says_the_range():
    assert problem(metric(step=1e300)) == "step: must be null or an integer between -2**63 and 2**63-1"


def test_text_from_the_lenient_decoder_must_be_utf8():
    line = {"seq": 1, "kind": "log", "stream": "stdout", "line": "bad \udcff byte", "time": 1.0}
    assert problem(line) is None  # orjson already refused lone surrogates
    assert problem(line, text_checked=False) == "line: must be valid UTF-8 text"
    assert problem(status(reason="\ud800"), text_checked=False) == "reason: must be valid UTF-8 text"
