"""The learner's gradient noise scale (learner_agent.goodput): the estimator McCandlish et al. give,
averaged over steps, reported with the job's progress."""
import contextlib
import io
import json
import random

import pytest

from learner_agent.goodput import GradientNoiseScale, squared_grad_norm


def expected_sq_norm(true_sq, trace, batch):
    """E|G_b|^2 = |G|^2 + tr(Sigma) / b."""
    return true_sq + trace / batch


@pytest.mark.parametrize("true_sq,trace", [(1.0, 500.0), (0.01, 40.0), (4.0, 4000.0)])
def test_it_recovers_the_noise_scale_from_expected_norms(true_sq, trace):
    noise = GradientNoiseScale()
    for _ in range(3):
        noise.update(16, expected_sq_norm(true_sq, trace, 16), 64, expected_sq_norm(true_sq, trace, 64))
    assert noise.value == pytest.approx(trace / true_sq)


def test_it_averages_noisy_steps_to_the_true_noise_scale():
    """Per-sample gradients g = G + noise in 20 dimensions: B = tr(Sigma)/|G|^2 = 20 * 4 / 0.8 = 100."""
    rng = random.Random(3)
    mean, sigma = [0.2] * 20, 2.0

    def mean_gradient(batch):
        return [m + sum(rng.gauss(0, sigma) for _ in range(batch)) / batch for m in mean]

    noise = GradientNoiseScale(smoothing=0.99)
    for _ in range(1500):
        half = [mean_gradient(16) for _ in range(2)]
        whole = [(a + b) / 2 for a, b in zip(*half)]
        noise.update(16, sum(x * x for x in half[0]), 32, sum(x * x for x in whole))
    assert noise.value == pytest.approx(100.0, rel=0.3)


def test_it_has_no_value_until_the_estimate_is_positive():
    noise = GradientNoiseScale()
    assert noise.value is None
    noise.update(16, 1.0, 64, 2.0)  # the big batch's norm above the small one's: noise, no estimate
    assert noise.value is None
    noise.update(32, 1.0, 32, 0.5)  # the same size twice tells nothing
    assert noise.steps == 1


def reported(noise, **metrics):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        noise.report(**metrics)
    return [json.loads(line.split(" ", 1)[1]) for line in printed.getvalue().splitlines()]


def test_it_reports_the_noise_scale_with_the_progress_once_it_has_one():
    noise = GradientNoiseScale()
    assert reported(noise, samples=640, step=10) == [{"name": "samples", "value": 640.0, "step": 10}]
    noise.update(16, expected_sq_norm(1.0, 300.0, 16), 64, expected_sq_norm(1.0, 300.0, 64))
    points = reported(noise, samples=1280, step=20)
    assert [p["name"] for p in points] == ["samples", "noise_scale"]
    assert points[1]["value"] == pytest.approx(300.0) and points[1]["step"] == 20


def test_a_resumed_attempt_goes_on_averaging_where_the_last_stopped():
    noise = GradientNoiseScale()
    noise.update(16, expected_sq_norm(1.0, 300.0, 16), 64, expected_sq_norm(1.0, 300.0, 64))
    resumed = GradientNoiseScale()
    resumed.load_state_dict(noise.state_dict())
    assert (resumed.value, resumed.steps) == (noise.value, 1)


def test_it_reads_the_squared_norm_of_pytorch_gradients():
    torch = pytest.importorskip("torch")
    weight, bias, frozen = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(3)), torch.zeros(1)
    (weight.sum() * 3 + bias.sum()).backward()
    assert squared_grad_norm([weight, bias, torch.nn.Parameter(frozen)]) == pytest.approx(4 * 9 + 3)
