"""The arithmetic of an elastic job's shape: for a number of learners, which global batch, local batch
and learning-rate factor an attempt runs with. The one home of these rules: manifest validation
(trainyard.manifest), the deploy environment (jobs.lifecycle) and the autoscaler (jobs.autoscaler) all ask here.

Django-free, like trainyard.manifest, so the CLI's offline `trainyard validate` applies the same rules.

Rules (docs/elastic.md, "Elastic jobs"):
- the global batch of an attempt with n learners is the wanted batch clamped to [min, max], then
  rounded down to a multiple of n (never below n); if that falls below min, it is rounded up to the
  next multiple of n instead, which must not pass max (a manifest where no multiple of some n in
  [min_learners, max_learners] lies in [min, max] is refused);
- local batch = global / n;
- learning-rate factor against the manifest's `batch_size.global`: linear = global / base,
  sqrt = its square root, none = 1.
"""
import math
from dataclasses import dataclass

LR_SCALINGS = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class BatchBounds:
    base: int  # the manifest's batch_size.global: the batch the job's learning rate is chosen for
    low: int
    high: int


@dataclass(frozen=True)
class Elastic:
    """A job's elastic block, as stored in Job.runtime["elastic"]."""
    min_learners: int
    max_learners: int
    batch: BatchBounds | None  # None: the job declares no batch size (only its learners change)
    lr_scaling: str = "linear"

    @classmethod
    def from_runtime(cls, stored):
        """The Elastic of a stored runtime block, or None for a job without one."""
        if not stored:
            return None
        batch = stored.get("batch")
        return cls(min_learners=stored["min_learners"], max_learners=stored["max_learners"],
                   batch=BatchBounds(batch["global"], batch["min"], batch["max"]) if batch else None,
                   lr_scaling=stored.get("lr_scaling", "linear"))

    def to_runtime(self):
        batch = self.batch
        return {"min_learners": self.min_learners, "max_learners": self.max_learners,
                "batch": {"global": batch.base, "min": batch.low, "max": batch.high} if batch else None,
                "lr_scaling": self.lr_scaling}


@dataclass(frozen=True)
class Shape:
    """What one attempt runs with."""
    learners: int
    global_batch: int | None
    local_batch: int | None
    lr_scale: float

    def env(self):
        """The variables an attempt of an elastic job gets on top of WORLD_SIZE, RANK, ..."""
        env = {"TRAINYARD_LR_SCALE": repr(self.lr_scale)}
        if self.global_batch is not None:
            env.update(TRAINYARD_GLOBAL_BATCH_SIZE=str(self.global_batch),
                       TRAINYARD_LOCAL_BATCH_SIZE=str(self.local_batch))
        return env

    def describe(self):
        """"2 learners, batch 128" (for events and reasons)."""
        learners = f"{self.learners} learner{'s' if self.learners != 1 else ''}"
        return learners if self.global_batch is None else f"{learners}, batch {self.global_batch}"


def of(job):
    """The Elastic of a job row (its stored runtime block), or None for a job of a fixed size."""
    return Elastic.from_runtime((job.runtime or {}).get("elastic"))


def global_batch(bounds, learners, wanted=None):
    """The global batch for `learners` (see the module's rules); None when no multiple fits."""
    target = min(max(bounds.base if wanted is None else wanted, bounds.low), bounds.high)
    batch = max(learners, target // learners * learners)
    if batch < bounds.low:
        batch = -(-bounds.low // learners) * learners  # the next multiple of n at or above min
    return batch if batch <= bounds.high else None


def lr_scale(elastic, batch):
    if elastic.batch is None or batch is None or elastic.lr_scaling == "none":
        return 1.0
    ratio = batch / elastic.batch.base
    return math.sqrt(ratio) if elastic.lr_scaling == "sqrt" else ratio


def shape(elastic, learners, wanted_batch=None):
    """The Shape of an attempt at `learners`, for a wanted global batch (default: the manifest's)."""
    if elastic.batch is None:
        return Shape(learners, None, None, 1.0)
    batch = global_batch(elastic.batch, learners, wanted_batch)
    if batch is None:  # validation refuses such bounds; say so plainly if one slips through
        raise ValueError(f"no multiple of {learners} lies in batch_size [{elastic.batch.low}, {elastic.batch.high}]")
    return Shape(learners, batch, batch // learners, lr_scale(elastic, batch))


def learner_counts_without_batch(bounds, min_learners, max_learners):
    """The learner counts in [min, max] for which no global batch fits the bounds (validation)."""
    return [n for n in range(min_learners, max_learners + 1) if global_batch(bounds, n) is None]
