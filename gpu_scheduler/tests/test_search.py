"""The searcher's decisions (gpu_scheduler.search) on experiments built from manifests."""
import pytest

from gpu_scheduler.search import COMPLETED, PAUSED, RUNNING, Search, TrialView
from trainyard.experiment import parse_experiment

BASE = "name: s\nframework: {name: custom, command: 'python t.py'}\n"


def search(searcher, hyperparameters):
    return Search(parse_experiment(f"{BASE}hyperparameters: {hyperparameters}\nsearcher: {searcher}\n"))


def proposals(found, count):
    trials = []
    for number in range(count):
        proposal = found.propose(trials, number)
        if proposal is None:
            break
        trials.append(TrialView(number, proposal.params, RUNNING, proposal.system_attrs))
    return trials


FINITE = "{lr: {type: categorical, vals: [0.01, 0.03, 0.1]}, width: {type: int, minval: 1, maxval: 3}, b: {type: categorical, vals: [16, 64, 256]}}"


@pytest.mark.parametrize("name", ["random", "asha", "grid"])
def test_a_finite_space_is_tried_without_repeating_a_configuration(name):
    found = search(f"{{name: {name}, metric: acc, max_trials: 40, max_length: 9}}", FINITE)
    trials = proposals(found, 40)
    assert len(trials) == 27  # every point once, then nothing left to try
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 27


def test_a_finite_space_is_visited_in_optunas_own_grid_order():
    """Each point and its grid_id are those Optuna's GridSampler gives (trials stored before keep their
    meaning); the sampler itself is read here only to compare."""
    import optuna
    found = search("{name: grid, metric: acc, max_trials: 40, seed: 5}", FINITE)
    ours, theirs = proposals(found, 27), []
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(found.space, seed=5))
    for number in range(27):
        trial = study.ask(found.distributions)
        theirs.append((trial.params, study.trials[-1].system_attrs["grid_id"]))
        if number < 26:  # told of the last, the sampler would stop a study it does not run
            study.tell(trial, 0.0)
    assert [(t.params, t.system_attrs["grid_id"]) for t in ours] == theirs


def test_a_large_finite_space_costs_a_proposal_no_more_as_its_trials_grow():
    """1,000 proposals over 1,000 points: Optuna's GridSampler compared every trial's copy of the
    space with its own on each, a cost growing with trials times points; read here, it stays small."""
    import time
    found = search("{name: random, metric: acc, max_trials: 2000}", "{w: {type: int, minval: 0, maxval: 999}}")
    started = time.monotonic()
    trials = proposals(found, 1001)
    assert len(trials) == 1000 and len({t.params["w"] for t in trials}) == 1000
    assert time.monotonic() - started < 120


def test_the_same_seed_proposes_the_same_configurations_and_another_seed_others():
    def order(seed):
        found = search(f"{{name: random, metric: acc, max_trials: 10, seed: {seed}}}", FINITE)
        return [t.params for t in proposals(found, 10)]
    assert order(1) == order(1) and order(1) != order(2)


def test_a_continuous_range_is_sampled_within_its_bounds():
    found = search("{name: random, metric: acc, max_trials: 50}",
                   "{lr: {type: log, minval: 0.0001, maxval: 0.1}, width: {type: int, minval: 8, maxval: 100000}}")
    trials = proposals(found, 50)
    assert len(trials) == 50 and len({t.params["lr"] for t in trials}) == 50
    assert all(0.0001 <= t.params["lr"] <= 0.1 and 8 <= t.params["width"] <= 100000 for t in trials)


def test_asha_promotes_the_best_third_of_a_rung_and_finishes_with_the_best_paused():
    found = search("{name: asha, metric: acc, max_trials: 6, max_length: 9, divisor: 3}", FINITE)
    assert found.searcher.rungs() == [1, 3, 9]
    values = [0.1, 0.9, 0.5, 0.7, 0.2, 0.3]
    trials = [TrialView(n, {}, PAUSED, rungs={0: v}) for n, v in enumerate(values)]
    assert found.promotions(trials) == [(1, 0), (3, 0)]  # 6 at the rung: two places
    assert found.goes_on(trials, 1, 0) and not found.goes_on(trials, 2, 0)
    done = [TrialView(n, {}, PAUSED, rungs={0: v}, promoted=0 if n == 1 else -1) for n, v in enumerate(values[:2])]
    assert found.promotions(done) == []  # two at the rung: no place
    assert found.promotions(done, finishing=True) == [(1, 0)]  # nothing else left: the best goes on
    finished = done + [TrialView(9, {}, COMPLETED, rungs={0: 0.3, 1: 0.5, 2: 0.6}, value=0.6)]
    assert found.promotions(finished, finishing=True) == []
    assert found.best(finished).number == 9


def test_tpe_learns_from_the_latest_trials_that_ended(monkeypatch):
    """Each proposal rebuilds TPE's study in the scheduling loop: from a bounded history, of the trials
    TPE's model can use (running and failed ones it leaves out)."""
    import optuna

    from gpu_scheduler import search as searching
    found = search("{name: tpe, metric: acc, max_trials: 5000}", "{lr: {type: log, minval: 0.001, maxval: 1}}")
    states = [COMPLETED, RUNNING, "stopped", "failed"]
    trials = [TrialView(n, {"lr": 0.001 + n / 10000}, states[n % 4], value=n / 1000) for n in range(1000)]
    added = []
    monkeypatch.setattr(optuna.study.Study, "add_trials", lambda study, history: added.extend(history))
    proposal = found.propose(trials, 1000)
    assert 0.001 <= proposal.params["lr"] <= 1
    assert len(added) == searching.TPE_HISTORY < 1000
    assert {t.state for t in added} == {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}
    assert [t.params["lr"] for t in added][-1] == trials[-2].params["lr"]  # the latest that ended
