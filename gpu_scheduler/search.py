"""Hyperparameter search decisions: which configuration an experiment tries next, and, for ASHA, which
trials stop at a rung and which go on.

Pure, like the rest of this package: the caller passes every trial of the experiment as it stands
(`TrialView`, from its database rows) and applies the answer. Nothing is kept between calls, so the
platform's database is the searcher's only state and a process killed between two decisions loses
nothing.

Sampling is Optuna's (RandomSampler, TPESampler): each call builds an in-memory study and asks it for
one more configuration, TPE's from the trials so far (random search needs none of them). The sampler's
seed is the experiment's seed and the trial's number, so asking again for the same number (after a crash
before the trial was stored) gives the same configuration. A finite space (a grid; a small one searched at
random) is visited point by point as Optuna's GridSampler visits it (the same shuffled order from the
experiment's seed, the same `grid_id` per point), but read here: the sampler compares every trial's
copy of the whole space with its own and deep-copies it on each call, a cost that grows with trials
times points, paid in the scheduling loop every tenant waits on (gpu_scheduler/tests/test_search.py).

ASHA (asynchronous successive halving, Li et al., MLSys 2020) is the platform's own, since it is a
scheduling decision Optuna cannot take: Optuna's pruner can only stop a trial for good ("Optuna does
not support suspending or resuming ongoing trials"), while a platform that owns checkpoints can pause
one. A trial that reaches a rung goes on when it is among the best 1/divisor of the trials that reached
that rung, and is paused otherwise (halted through its checkpoint, its GPUs freed); when a trial slot is
free, a paused trial that has since come into the best 1/divisor of its rung is promoted (resumed from
its checkpoint) before a new configuration is tried.
"""
import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)

RUNNING, PAUSED, COMPLETED, STOPPED, FAILED = "running", "paused", "completed", "stopped", "failed"
MAX_ENUMERATED = 100_000  # a finite space up to this many points is sampled without replacement
# The trials TPE learns from, the latest of those that ended: each proposal rebuilds its study from
# them, in the scheduling loop every tenant waits on. TPE's model is of the better and the worse part of
# the history, so the latest few hundred keep it to where the search has got to.
TPE_HISTORY = 200
TPE_LEARNS_FROM = (COMPLETED, STOPPED)  # Optuna's COMPLETE and PRUNED: it leaves running and failed trials out
OPTUNA_STATE = {RUNNING: TrialState.RUNNING, PAUSED: TrialState.RUNNING, COMPLETED: TrialState.COMPLETE,
                STOPPED: TrialState.PRUNED, FAILED: TrialState.FAIL}


@dataclass(frozen=True)
class TrialView:
    """One trial as the searcher needs it."""
    number: int
    params: dict
    state: str  # RUNNING, PAUSED, COMPLETED, STOPPED or FAILED
    system_attrs: dict = field(default_factory=dict)  # what the sampler noted when it chose params
    rungs: dict = field(default_factory=dict)  # ASHA: {rung index: the metric's value there}
    promoted: int = -1  # ASHA: the highest rung index it was let go on from (-1: none yet)
    value: float | None = None  # the metric's final value (COMPLETED) or its latest


@dataclass(frozen=True)
class Proposal:
    params: dict
    system_attrs: dict


class Search:
    """The decisions of one experiment's searcher (trainyard.experiment.Experiment)."""

    def __init__(self, experiment):
        self.experiment = experiment
        self.searcher = experiment.searcher
        # The points tried one by one, each once: a grid's, and for random search and ASHA the whole
        # space when it is finite and small (sampling with replacement there repeats configurations:
        # 27 draws from 27 points give about 17 distinct ones).
        self.space = None
        if self.searcher.name == "grid":
            self.space = {hp.name: hp.grid_points() for hp in experiment.varied()}
        elif self.searcher.name in ("random", "asha"):
            finite = experiment.finite_space()
            if finite is not None and math.prod(len(values) for values in finite.values()) <= MAX_ENUMERATED:
                self.space = finite
        self.distributions = {hp.name: (CategoricalDistribution(self.space[hp.name]) if self.space
                                        else _distribution(hp)) for hp in experiment.varied()}

    # --- new configurations -----------------------------------------------------------------------
    def propose(self, trials, number):
        """The hyperparameters of trial `number` (constants excluded), or None when the search space
        has nothing left to try (a grid fully visited)."""
        if self.space:
            return self._next_point(trials)
        seed = (self.searcher.seed * 1_000_003 + number) % 2**32
        if self.searcher.name == "tpe":
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, self.searcher.max_trials // 4)))
            history = [self._frozen(trial) for trial in _latest(trials, TPE_LEARNS_FROM, TPE_HISTORY)]
        else:  # random, and asha's new configurations: a draw of its own seed, whatever came before
            sampler, history = optuna.samplers.RandomSampler(seed=seed), []
        study = optuna.create_study(direction=self.searcher.direction, sampler=sampler)
        study.add_trials(history)
        study.ask(self.distributions)
        asked = study.trials[-1]
        return Proposal(params=dict(asked.params), system_attrs=dict(asked.system_attrs))

    def _next_point(self, trials):
        """A point of the finite space no trial has, as GridSampler chooses it: its points in the order
        its seed shuffles them (one seed for the experiment's life), trial n takes the n-th while there
        are points past the trials, then one left over drawn from the same generator; `grid_id` is
        the point's place in that order."""
        names = sorted(self.space)
        points = list(itertools.product(*(self.space[name] for name in names)))
        generator = numpy.random.RandomState(self.searcher.seed or 0)
        generator.shuffle(points)
        taken = {trial.system_attrs.get("grid_id") for trial in trials}
        if len(trials) < len(points) and len(trials) not in taken:
            grid_id = len(trials)
        else:
            left = [grid_id for grid_id in range(len(points)) if grid_id not in taken]
            if not left:
                return None
            grid_id = int(generator.choice(left))
        return Proposal(params=dict(zip(names, points[grid_id])), system_attrs={"grid_id": grid_id})

    def _frozen(self, trial):
        state = OPTUNA_STATE[trial.state]
        value = trial.value if state == TrialState.COMPLETE else None
        if state == TrialState.COMPLETE and (value is None or not math.isfinite(value)):
            state, value = TrialState.FAIL, None  # completed without reporting the metric: nothing to learn
        milestones = self.searcher.rungs() if self.searcher.name == "asha" else []
        intermediate = {milestones[index]: value for index, value in trial.rungs.items()
                        if index < len(milestones) and value is not None and math.isfinite(value)}
        params = {name: value for name, value in trial.params.items() if name in self.distributions}
        return optuna.trial.create_trial(state=state, value=value, params=params,
                                         distributions={name: self.distributions[name] for name in params},
                                         system_attrs=trial.system_attrs, intermediate_values=intermediate)

    # --- ASHA -------------------------------------------------------------------------------------
    def goes_on(self, trials, number, rung):
        """Whether trial `number`, having just reached rung index `rung` (its value recorded in its
        view), is among the best 1/divisor of that rung and so trains on to the next."""
        return number in self._promotable(trials, rung)

    def promotions(self, trials, *, finishing=False):
        """Paused trials now among the best 1/divisor of their rung, highest rung first (Li et al.'s
        get_job): each is (trial number, rung index it is promoted from). `finishing`: no trial runs and
        none will start; if none has completed either (too few trials for any rung to promote one), the
        best paused trial of the highest rung goes on, so the experiment ends with one trained in full."""
        by_number = {t.number: t for t in trials}
        found = [(number, rung) for rung in reversed(range(len(self.searcher.rungs()) - 1))
                 for number in self._promotable(trials, rung) if by_number[number].state == PAUSED]
        if found or not finishing or any(t.state == COMPLETED for t in trials):
            return found
        paused = [t for t in trials if t.state == PAUSED and t.rungs]
        if not paused:
            return []
        top = max(max(t.rungs) for t in paused)
        sign = 1 if self.searcher.smaller_is_better else -1
        best = min((t for t in paused if top in t.rungs), key=lambda t: (sign * t.rungs[top], t.number))
        return [(best.number, top)]

    def _promotable(self, trials, rung):
        """The trials among the best floor(n/divisor) of the n that reached `rung`, not yet let go on from it."""
        reached = [t for t in trials if rung in t.rungs and t.rungs[rung] is not None and math.isfinite(t.rungs[rung])]
        places = len(reached) // self.searcher.divisor
        ranked = sorted(reached, key=lambda t: (t.rungs[rung] if self.searcher.smaller_is_better
                                                else -t.rungs[rung], t.number))
        return [t.number for t in ranked[:places] if t.promoted < rung]

    def rung_reached(self, steps_values, rung):
        """The metric's value at rung index `rung` from a trial's (step, value) points in step order: the
        first at or past the milestone; None while the trial has not got there."""
        milestone = self.searcher.rungs()[rung]
        return next((value for step, value in steps_values if step is not None and step >= milestone), None)

    # --- the result ---------------------------------------------------------------------------------
    def best(self, trials):
        """The best trial: among completed ones by final value; while none completed, by latest value."""
        def finite(t):
            return t.value is not None and math.isfinite(t.value)
        pool = [t for t in trials if t.state == COMPLETED and finite(t)] or [t for t in trials if finite(t)]
        if not pool:
            return None
        sign = 1 if self.searcher.smaller_is_better else -1
        return min(pool, key=lambda t: (sign * t.value, t.number))


def _latest(trials, states, count):
    """The last `count` (> 0) trials in one of `states`, oldest first."""
    return [trial for trial in trials if trial.state in states][-count:]


def _distribution(hp):
    if hp.type == "categorical":
        return CategoricalDistribution(list(hp.vals))
    if hp.type == "int":
        return IntDistribution(int(hp.minval), int(hp.maxval))
    return FloatDistribution(float(hp.minval), float(hp.maxval), log=hp.type == "log")
