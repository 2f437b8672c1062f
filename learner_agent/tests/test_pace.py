"""The pace of a learner's output: a token bucket, and a real agent slowing a learner that floods."""
import time

import pytest

from learner_agent.pace import Pace
from tests.support.agent_runs import run_agent, write_agent_config


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_a_burst_passes_at_once_and_the_rest_at_the_rate():
    clock = FakeClock()
    pace = Pace(1000, 5000, clock=clock, sleep=clock.sleep)
    assert [pace.take(1000) for _ in range(5)] == [0, 0, 0, 0, 0]
    assert pace.take(500) == pytest.approx(0.5)
    assert pace.take(2000) == pytest.approx(2.0)
    clock.now += 10  # an idle learner earns its burst back, no more
    assert pace.take(5000) == 0
    assert pace.take(1000) == pytest.approx(1.0)


def test_a_line_longer_than_the_burst_waits_its_own_time():
    clock = FakeClock()
    pace = Pace(1000, 100, clock=clock, sleep=clock.sleep)
    assert pace.take(3100) == pytest.approx(3.0)


@pytest.mark.parametrize("rate, burst", [(0, 10), (10, 0), (-1, 10)])
def test_it_refuses_a_pace_that_never_passes_anything(rate, burst):
    with pytest.raises(ValueError):
        Pace(rate, burst)


FLOOD = "python3 -c 'import sys\nfor i in range(40): sys.stdout.write(\"x\" * 10000 + \"\\n\")'"


def test_a_learner_printing_faster_than_the_pace_is_slowed_and_loses_nothing(outside_tmp, ingest):
    # 400 kB at 100 kB/s after a 100 kB burst: about 3 s; unpaced, well under one.
    config = write_agent_config(outside_tmp, ingest, command=FLOOD, log_bytes_per_second=100_000,
                                log_burst_bytes=100_000)
    started = time.monotonic()
    result = run_agent(config)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    logs = [r for r in ingest.stored() if r["kind"] == "log"]
    assert len([r for r in logs if r["stream"] == "stdout"]) == 40
    notices = [r["line"] for r in logs if r["stream"] == "system" and "slowed" in r["line"]]
    assert len(notices) == 1, notices
    assert elapsed >= 2.5, elapsed


def test_a_learner_within_the_pace_is_not_slowed(outside_tmp, ingest):
    config = write_agent_config(outside_tmp, ingest, command=FLOOD, log_bytes_per_second=100_000,
                                log_burst_bytes=1_000_000)
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    assert not [r for r in ingest.stored() if r["kind"] == "log" and r["stream"] == "system"]
