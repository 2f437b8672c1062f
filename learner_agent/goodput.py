"""The learner's half of goodput: measure the gradient noise scale where the gradients are, and report
it with the job's progress, so the platform's autoscaler (jobs/autoscaler.py) knows what a bigger
global batch is worth to this job (docs/elastic.md, "Measuring goodput").

The gradient noise scale B = tr(Sigma) / |G|^2 (McCandlish et al. 2018) says how large a batch still
trains nearly as well per sample as a small one: a batch of M samples is worth (B + M0) / (B + M) of
the samples at the job's own batch M0. It is estimated from the squared norm of the mean gradient at
two batch sizes, e.g. one learner's part of the batch before the all-reduce and the whole batch
after it: E|G_b|^2 = |G|^2 + tr(Sigma) / b, two equations in two unknowns (the unbiased estimators of
McCandlish's appendix A, the same as gpu_scheduler.throughput.noise_scale). One step's estimate is
noisy, so the numerator and the denominator are each averaged over steps (an exponential moving
average) before dividing.

Framework-free (the learner agent imports only the standard library): a learner passes in floats.
`squared_grad_norm` reads PyTorch-style parameters (`.grad`, `.pow`, `.sum`) without importing
PyTorch; other frameworks compute the two squared norms themselves (docs/elastic.md shows how).
"""
from learner_agent import report

__all__ = ["NOISE_SCALE_METRIC", "GradientNoiseScale", "squared_grad_norm"]

# The metric the autoscaler reads (jobs.autoscaler.NOISE_SCALE_METRIC).
NOISE_SCALE_METRIC = "noise_scale"


class GradientNoiseScale:
    """Accumulates the two estimators over steps; `value` is B in samples, or None while the
    estimate is not yet positive (early on, or too noisy)."""

    def __init__(self, *, smoothing=0.95):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError("smoothing must lie in [0, 1)")
        self.smoothing = smoothing
        self.steps = 0
        self._true_sq = 0.0  # |G|^2, averaged (not yet bias-corrected)
        self._trace = 0.0  # tr(Sigma), averaged

    def update(self, small_batch, small_sq_norm, big_batch, big_sq_norm):
        """One step's squared norms of the mean gradient over `small_batch` samples (e.g. one learner's
        part, averaged over the learners) and over `big_batch` samples (the whole step, all-reduced).
        A step where the sizes do not differ tells nothing and is skipped. Returns `value`."""
        small_batch, big_batch = float(small_batch), float(big_batch)
        if not 0 < small_batch < big_batch:
            return self.value
        true_sq = (big_batch * big_sq_norm - small_batch * small_sq_norm) / (big_batch - small_batch)
        trace = (small_sq_norm - big_sq_norm) / (1 / small_batch - 1 / big_batch)
        keep = self.smoothing
        self._true_sq = keep * self._true_sq + (1 - keep) * float(true_sq)
        self._trace = keep * self._trace + (1 - keep) * float(trace)
        self.steps += 1
        return self.value

    @property
    def value(self):
        if self.steps == 0 or self._true_sq <= 0 or self._trace <= 0:
            return None
        return self._trace / self._true_sq  # the bias corrections of both averages cancel

    def report(self, **metrics):
        """`learner_agent.report(noise_scale=B, **metrics)`: B left out while it is unknown, so a
        learner can call this where it reports its progress (`samples=N`)."""
        if self.value is not None:
            metrics[NOISE_SCALE_METRIC] = self.value
        if any(name != "step" for name in metrics):
            report(**metrics)

    def state_dict(self):
        """What a checkpoint keeps, so a resumed attempt goes on averaging where the last stopped."""
        return {"smoothing": self.smoothing, "steps": self.steps, "true_sq": self._true_sq, "trace": self._trace}

    def load_state_dict(self, state):
        self.smoothing, self.steps = state["smoothing"], int(state["steps"])
        self._true_sq, self._trace = float(state["true_sq"]), float(state["trace"])


def squared_grad_norm(parameters):
    """The squared L2 norm of the gradients of PyTorch parameters (those that have one), as a float."""
    return sum(float(p.grad.detach().pow(2).sum()) for p in parameters if p.grad is not None)
