"""The one home of an elastic job's batch arithmetic (trainyard.elasticity), table-driven."""
import math

import pytest

from trainyard.elasticity import BatchBounds, Elastic, global_batch, shape

BOUNDS = BatchBounds(base=64, low=32, high=256)


@pytest.mark.parametrize("learners, wanted, batch", [
    (1, None, 64), (2, None, 64), (3, None, 63),  # rounded down to a multiple of the learners
    (4, 512, 256), (4, 8, 32),  # clamped to the bounds first
    (3, 32, 33),  # 30 would be below min: up to the next multiple instead
    (64, None, 64), (5, 300, 255),
])
def test_it_rounds_the_global_batch_as_documented(learners, wanted, batch):
    assert global_batch(BOUNDS, learners, wanted) == batch


def test_it_says_none_when_no_multiple_fits():
    assert global_batch(BatchBounds(10, 5, 7), 4) is None
    assert global_batch(BatchBounds(10, 5, 7), 6) == 6


@pytest.mark.parametrize("scaling, factor", [("linear", 2.0), ("sqrt", math.sqrt(2.0)), ("none", 1.0)])
def test_it_scales_the_learning_rate_by_the_rule(scaling, factor):
    attempt = shape(Elastic(1, 4, BOUNDS, scaling), 4, 128)
    assert (attempt.global_batch, attempt.local_batch) == (128, 32)
    assert attempt.lr_scale == pytest.approx(factor)
    assert attempt.env() == {"TRAINYARD_GLOBAL_BATCH_SIZE": "128", "TRAINYARD_LOCAL_BATCH_SIZE": "32",
                             "TRAINYARD_LR_SCALE": repr(factor)}


def test_a_job_without_batch_bounds_gets_only_the_factor():
    attempt = shape(Elastic(1, 4, None), 3)
    assert attempt.env() == {"TRAINYARD_LR_SCALE": "1.0"} and attempt.describe() == "3 learners"


def test_it_round_trips_through_the_runtime_mapping():
    elastic = Elastic(1, 4, BOUNDS, "sqrt")
    assert Elastic.from_runtime(elastic.to_runtime()) == elastic
    assert Elastic.from_runtime(None) is None
