"""The bare side of an overhead ratio: the command alone, at the CPU limit its learner gets.

Through Trainyard a learner runs in a control group holding it to its manifest's `cpus`
(learner_agent.cgroups); a bare run without one may use every core, so the ratio would charge the
limit the researcher asked for to the platform. `cpu_limited(cpus)` gives the bare run the same
group. `measure_overhead` turns the two sides' runs into the ratio. Not a benchmark of its own
(excluded from `bench all`).
"""
import os
import random
import statistics
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from learner_agent import cgroups


@contextmanager
def cpu_limited(cpus):
    """A `preexec_fn` that moves the child into a fresh group of `cpus` CPUs, removed afterwards;
    raises cgroups.CgroupError where none can be made (the bench then says so, never runs unlimited)."""
    group = cgroups.create(f"bench-bare-{uuid.uuid4().hex[:10]}", memory_bytes=None, cpus=cpus, max_processes=4096)

    def join():
        for procs in group.procs_files:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    try:
        yield join
    finally:
        group.remove()


# --- the ratio ----------------------------------------------------------------------------------
# Runs alternate: bare, platform, (bare without the limit), bare, platform, ... bare. Each platform
# run is divided by the mean of the two bare runs either side of it, so a machine that drifts
# slower or faster over the minutes of a bench run (the same bare command moved 5.3 s → 5.7 s
# between runs minutes apart here) cancels out of each ratio, to first order; the headline is the
# median of those ratios. The ratio of the two sides' medians is reported beside it: it needs no
# pairing but a drift lands in it whole.
@dataclass(frozen=True)
class Overhead:
    ratio: float  # median of the bracketed ratios
    low: float  # 95% bootstrap interval of that median
    high: float
    ratio_of_medians: float
    ratios: list


def measure_overhead(through, bare, *, resamples=2000):
    """`through`: platform runs; `bare`: the bare runs around them, one more than `through`."""
    if len(bare) != len(through) + 1:
        raise ValueError(f"{len(through)} platform runs need {len(through) + 1} bare runs around them, not {len(bare)}")
    ratios = [t / ((before + after) / 2) for t, before, after in zip(through, bare, bare[1:])]
    rng = random.Random(0)  # the same runs give the same interval
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return Overhead(ratio=statistics.median(ratios), low=medians[int(0.025 * resamples)],
                    high=medians[int(0.975 * resamples) - 1],
                    ratio_of_medians=statistics.median(through) / statistics.median(bare), ratios=ratios)
