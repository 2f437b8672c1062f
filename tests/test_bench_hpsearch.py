"""bench.hpsearch's driver (jobs.experiments.Pass's rules over gpu_scheduler.search) on a made-up table
of learning curves, nothing trained: ASHA pauses, promotes and ends with the best it tried for fewer
epochs than the grid, and random search stops at its budget."""
import itertools

import pytest

from bench import hpsearch
from gpu_scheduler.search import COMPLETED, STOPPED

SPACE = hpsearch.SPACE
EPOCHS = hpsearch.EPOCHS
CONFIGS = list(itertools.product(*SPACE.values()))


def quality(config):
    """Each configuration's final value: higher rates and widths, smaller batches are better; one best."""
    lr, hidden, batch = config
    return (0.5 + 0.1 * SPACE["lr"].index(lr) + 0.1 * SPACE["hidden"].index(hidden)
            - 0.05 * SPACE["batch_size"].index(batch))


class TableLearner:
    """A curve that keeps its ranking at every epoch; one CPU-second an epoch; refuses one past the last."""
    trained = []

    def __init__(self, params):
        self.config, self.done = hpsearch.config(params), 0

    def epoch(self):
        self.done += 1
        assert self.done <= hpsearch.EPOCHS, f"{self.config} trained past its job's length"
        TableLearner.trained.append((self.config, self.done))
        return round(quality(self.config) * (1 - 0.5 ** self.done), 6), 1.0


@pytest.fixture
def grid():
    return hpsearch.Sweep(hpsearch.experiment("grid"), TableLearner).run()


def test_the_grid_trains_every_configuration_to_the_end_once(grid):
    assert sorted(hpsearch.config(t.params) for t in grid.trials) == sorted(CONFIGS)
    assert {t.state for t in grid.trials} == {COMPLETED} and grid.epochs == 27 * EPOCHS == grid.spent_s
    assert hpsearch.config(grid.best().params) == max(CONFIGS, key=quality)


def test_asha_finds_the_best_for_under_a_third_of_the_grids_epochs(grid):
    asha = hpsearch.Sweep(hpsearch.experiment("asha", seed=0), TableLearner).run()
    assert asha.best().value == grid.best().value and asha.best().state == COMPLETED
    assert asha.epochs == asha.spent_s < grid.epochs / 3
    assert asha.pauses > 0 and asha.promotions > 0 and asha.finished
    assert all(t.epochs in asha.searcher.rungs() for t in asha.trials)  # each stopped at a rung, none ran past one


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_asha_ends_with_the_best_configuration_it_tried(seed):
    asha = hpsearch.Sweep(hpsearch.experiment("asha", seed=seed), TableLearner).run()
    assert hpsearch.config(asha.best().params) == max((hpsearch.config(t.params) for t in asha.trials), key=quality)
    assert asha.epochs < 27 * EPOCHS / 3


def test_a_promoted_trial_trains_on_from_where_it_was_paused():
    TableLearner.trained = []
    asha = hpsearch.Sweep(hpsearch.experiment("asha", seed=0), TableLearner).run()
    promoted = [t for t in asha.trials if t.epochs == EPOCHS]
    assert promoted
    for trial in promoted:
        assert [value for value, _ in trial.curve] == [round(quality(hpsearch.config(trial.params)) * (1 - 0.5 ** k), 6)
                                                       for k in range(1, EPOCHS + 1)]
    assert len(TableLearner.trained) == asha.epochs  # every epoch trained was counted, and once


def test_random_search_stops_at_its_budget_with_its_best_completed_trial():
    budget = 4.5 * EPOCHS  # three trials at a time: three complete, three more are cut short
    rand = hpsearch.Sweep(hpsearch.experiment("random", seed=0, max_trials=1000), TableLearner, budget_s=budget).run()
    assert rand.cut and rand.spent_s == int(budget) == rand.epochs
    assert rand.best().state == COMPLETED and rand.trials[rand.best().number].epochs == EPOCHS
    assert {t.state for t in rand.trials} <= {COMPLETED, STOPPED}
