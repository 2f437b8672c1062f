"""bench.baseline.measure_overhead: the overhead ratio from alternating runs, on made-up run times."""
import pytest

from bench.baseline import measure_overhead


def runs_on(machine, runs, *, cost):
    """Alternating runs on a machine whose bare time at half-step t is machine(t), of a platform
    that costs `cost` (a fraction): bare at t = 0, 2, 4, ..., the platform at 1, 3, 5, ..."""
    bare = [machine(2 * i) for i in range(runs + 1)]
    through = [machine(2 * i + 1) * (1 + cost) for i in range(runs)]
    return through, bare


def test_a_steady_drift_cancels_out_of_each_ratio():
    through, bare = runs_on(lambda t: 5.3 + 0.025 * t, 9, cost=0.01)
    measured = measure_overhead(through, bare)
    assert measured.ratios == pytest.approx([1.01] * 9, abs=1e-9)
    assert measured.ratio == pytest.approx(1.01, abs=1e-9)
    assert measured.low <= measured.ratio <= measured.high


def test_a_machine_that_slows_down_midway_moves_the_ratio_of_medians_but_not_the_ratio():
    through, bare = runs_on(lambda t: 5.3 if t < 9 else 5.7, 9, cost=0.01)
    measured = measure_overhead(through, bare)
    assert measured.ratio == pytest.approx(1.01, abs=1e-9)  # one ratio of nine straddles the step
    assert abs(measured.ratio_of_medians - 1.01) > 0.03


def test_the_interval_widens_with_the_spread_of_the_runs():
    steady = measure_overhead([5.5] * 9, [5.4] * 10)
    noisy = measure_overhead([5.5, 5.2, 5.9, 5.4, 5.7, 5.3, 5.6, 5.8, 5.1], [5.4] * 10)
    assert steady.low == steady.high == pytest.approx(5.5 / 5.4)
    assert noisy.high - noisy.low > 0.03


def test_every_platform_run_needs_a_bare_run_either_side():
    with pytest.raises(ValueError, match="3 platform runs need 4 bare runs around them, not 3"):
        measure_overhead([5.5] * 3, [5.4] * 3)
