"""hpsearch: ASHA and random search against an exhaustive grid whose best is known, on a real model
trained here, with every decision taken by the platform's own searcher code.

The sweep: a two-hidden-layer MLP (SGD, momentum 0.9) on scikit-learn's bundled digits (nothing
downloaded), a fixed stratified split of 1,197 training and 600 validation images, over 3 learning
rates x 3 widths x 3 batch sizes = 27 configurations of 27 epochs each; the metric is validation
accuracy after each epoch. Training is deterministic (fixed seeds, one thread,
torch.use_deterministic_algorithms, each trial its own generator), so a configuration's curve does not
depend on what else trains beside it. The experiments are written as experiment manifests (YAML, a
custom-framework job with `hyperparameters:` and `searcher:`), parsed by trainyard.experiment, and
driven by gpu_scheduler.search.Search: `propose` for new configurations (Optuna's GridSampler and
RandomSampler), `goes_on`, `promotions` and `best` for ASHA (rungs at epochs 1, 3, 9, 27).

Why 27 epochs: with a divisor of 3 each rung trains about as many epochs as there are configurations,
so s rungs over max_length L train about s/L of the grid's epochs: 3/9 over 9 epochs, a third by
construction (and, the widest networks being both the best and the dearest per epoch, more than a
third of its CPU-seconds), 4/27 over 27. Four rungs is the smallest sweep on which the target's third
tests the searcher rather than the arithmetic.

`Sweep` applies those decisions as jobs.experiments.Pass does, in-process: after each epoch a trial
reports its value; a running trial that reached its next rung is recorded there and goes on or is
paused (`would_promote_last` included); while fewer than max_concurrent_trials run, a paused trial
now good enough is promoted (its learner object kept, as a checkpoint would keep it, trains on), else
a new configuration is proposed; when nothing runs and nothing is left, the finishing promotion.
Concurrency is a discrete-event simulation on max_concurrent_trials workers: every epoch is trained
for real when its trial is given a worker, and ends on a virtual clock its measured CPU-seconds later;
the epoch that ends first is the next one the pass sees. Decisions take effect at once: no epoch runs
past a rung while a halt lands, and halting and resuming cost nothing here. Since the order epochs end
in follows their measured CPU-seconds, two runs of one seed can decide differently where two trials
reach a rung close together, as on a real cluster.

Cost: a trial's learner CPU-seconds are time.process_time around each epoch (building the model,
training, evaluating), one thread; an experiment's cost is the sum over every epoch it trained. The
grid trains all 27 configurations once. ASHA (max_trials BENCH_HPSEARCH_ASHA_TRIALS, as many as the
grid's points by default) and random search retrain for real, not replayed, on each seed of
BENCH_HPSEARCH_SEEDS; each of their epochs is checked against the grid's value for the same
configuration and epoch. Random search gets ASHA's measured CPU-seconds of the same seed: epochs count
in the order they end until the next would pass that budget, trials still going then are stopped, and
its result is its best completed trial. With the same seed both draw the same configurations in the
same order (ASHA's new configurations come from the same RandomSampler), so each pair differs only in
how long each trial trains.

Figures: the median over seeds, with the range, and how many seeds met each target. The gap is the
grid's best final validation accuracy minus the final accuracy of the trial `Search.best` returns
(completed trials only), in percentage points; one validation image is 1/6 of a point.
"""
import heapq
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import yaml
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from bench.report import publish
from bench.targets import figure, shown
from gpu_scheduler.search import COMPLETED, PAUSED, RUNNING, STOPPED, Search, TrialView
from trainyard.experiment import parse_experiment

SEEDS = [int(s) for s in os.environ.get("BENCH_HPSEARCH_SEEDS", "0,1,2,3,4,5,6,7,8,9").split(",")]
ASHA_TRIALS = int(os.environ.get("BENCH_HPSEARCH_ASHA_TRIALS", 27))
RANDOM_TRIALS = 1000  # random search ends at its budget, not here
SPACE = {"lr": [0.01, 0.03, 0.1], "hidden": [32, 128, 512], "batch_size": [16, 64, 256]}
EPOCHS = 27
CONCURRENT = 3
VALIDATION_IMAGES = 600
MODEL_SEED, SHUFFLE_SEED, SPLIT_SEED = 0, 1, 0
COMMAND = ("python train_digits.py --epochs {{hparams.epochs}} --lr {{hparams.lr}} --hidden {{hparams.hidden}} "
           "--batch-size {{hparams.batch_size}}")


def experiment(searcher, *, seed=0, max_trials=27, space=SPACE, epochs=EPOCHS):
    """The experiment manifest a researcher would submit for this sweep, parsed by the platform."""
    manifest = {
        "name": f"hpsearch-digits-{searcher}", "cpus": 1, "memory": "1GiB",
        "framework": {"name": "custom", "command": COMMAND},
        "checkpoint": {"signal": "SIGTERM", "grace_seconds": 30},
        "hyperparameters": {**{name: {"type": "categorical", "vals": list(vals)} for name, vals in space.items()},
                            "epochs": epochs},
        "searcher": {"name": searcher, "metric": "val_acc", "max_trials": max_trials,
                     "max_concurrent_trials": CONCURRENT, "max_length": epochs, "divisor": 3, "seed": seed},
    }
    return parse_experiment(yaml.safe_dump(manifest, sort_keys=False))


# --- the driver: jobs.experiments.Pass's rules over in-process trials -------------------------------
@dataclass
class Trial:
    """What jobs.models.Trial holds that the pass reads, and the learner that trains the trial."""
    number: int
    params: dict
    system_attrs: dict
    learner: object  # .epoch() -> (value, CPU-seconds)
    state: str = RUNNING
    rungs: dict = field(default_factory=dict)
    promoted: int = -1
    value: float | None = None
    curve: list = field(default_factory=list)  # (value, CPU-seconds) of each epoch counted
    training: bool = False  # an epoch of it is on a worker

    @property
    def epochs(self):
        return len(self.curve)

    def view(self):
        return TrialView(number=self.number, params=self.params, state=self.state, system_attrs=self.system_attrs,
                         rungs=dict(self.rungs), promoted=self.promoted, value=self.value)


class Sweep:
    """One experiment run to its end (module docstring). `learner_for(params)` makes a trial's learner;
    `budget_s`: stop everything once the epochs' CPU-seconds would pass it."""

    def __init__(self, spec, learner_for, *, budget_s=None):
        self.spec, self.searcher = spec, spec.searcher
        self.search = Search(spec)
        self.asha = self.searcher.name == "asha"
        self.learner_for, self.budget_s = learner_for, budget_s
        self.trials, self.events = [], []  # events: (ends at, order dispatched, trial number, value, CPU-seconds)
        self.now = self.spent_s = 0.0
        self.exhausted = self.finished = self.cut = False
        self.pauses = self.promotions = self.dispatched = 0

    def run(self):
        self.fill()
        self.dispatch()
        while self.events:
            self.now, _, number, value, cpu_s = heapq.heappop(self.events)
            if self.budget_s is not None and self.spent_s + cpu_s > self.budget_s:
                self.stop_at_budget()
                break
            self.spent_s += cpu_s
            self.epoch_ended(self.trials[number], value, cpu_s)
            self.dispatch()
        if not self.finished and not self.cut:
            raise RuntimeError(f"{self.searcher.name}: nothing trains and the experiment has not ended")
        for trial in self.trials:
            trial.learner = None
        return self

    @property
    def epochs(self):
        return sum(t.epochs for t in self.trials)

    def best(self):
        return self.search.best(self.views())

    def views(self):
        return [t.view() for t in self.trials]

    # --- one pass, at the end of one epoch ---------------------------------------------------------------
    def epoch_ended(self, trial, value, cpu_s):
        trial.training = False
        trial.curve.append((value, cpu_s))
        trial.value = value
        if self.asha:
            self.rungs_reached(trial, [(trial.epochs, value)])
        if trial.epochs == trial.params["epochs"]:  # its job ran to the end
            trial.state = COMPLETED
            if self.asha:
                trial.rungs[len(self.searcher.rungs()) - 1] = value
        self.fill()
        self.end_if_done()

    def rungs_reached(self, trial, points):
        if not self.record_next_rung(trial, points):
            return
        while True:
            rung = trial.promoted + 1
            if self.search.goes_on(self.views(), trial.number, rung):
                trial.promoted = rung
                if self.record_next_rung(trial, points):
                    continue
                break
            trial.state = PAUSED
            if self.would_promote_last(trial):
                trial.state, trial.promoted = RUNNING, rung
                break
            self.pauses += 1  # halted through its checkpoint: here, its learner is kept as it is
            break

    def record_next_rung(self, trial, points):
        rung = trial.promoted + 1
        if rung >= len(self.searcher.rungs()) - 1 or rung in trial.rungs:
            return False
        value = self.search.rung_reached(points, rung)
        if value is None:
            return False
        trial.rungs[rung] = value
        return True

    def would_promote_last(self, trial):
        if any(t.state == RUNNING for t in self.trials) or not self.out_of_trials():
            return False
        return self.search.promotions(self.views(), finishing=True)[:1] == [(trial.number, trial.promoted + 1)]

    def fill(self):
        room = self.searcher.max_concurrent_trials - sum(t.state == RUNNING for t in self.trials)
        while room > 0:
            promotion = self.search.promotions(self.views()) if self.asha else []
            if promotion:
                self.promote(*promotion[0])
                room -= 1
                continue
            if self.out_of_trials():
                return
            proposal = self.search.propose(self.views(), len(self.trials))
            if proposal is None:
                self.exhausted = True
                return
            params = {**self.spec.constants(), **proposal.params}
            self.trials.append(Trial(number=len(self.trials), params=params, system_attrs=proposal.system_attrs,
                                     learner=self.learner_for(params)))
            room -= 1

    def out_of_trials(self):
        return self.exhausted or len(self.trials) >= self.searcher.max_trials

    def promote(self, number, rung):
        trial = self.trials[number]
        trial.state, trial.promoted = RUNNING, rung
        self.promotions += 1

    def end_if_done(self):
        if self.finished or any(t.state == RUNNING for t in self.trials) or not self.out_of_trials():
            return
        last = self.search.promotions(self.views(), finishing=True) if self.asha else []
        if last:
            self.promote(*last[0])
            return
        for trial in self.trials:
            if trial.state == PAUSED:
                trial.state = STOPPED
        self.finished = True

    def stop_at_budget(self):
        for trial in self.trials:
            if trial.state in (RUNNING, PAUSED):
                trial.state = STOPPED
        self.cut = True

    # --- the workers ----------------------------------------------------------------------------------
    def dispatch(self):
        """Every running trial without an epoch on a worker trains its next one now; it ends on the
        virtual clock after its measured CPU-seconds."""
        for trial in self.trials:
            if trial.state == RUNNING and not trial.training:
                value, cpu_s = trial.learner.epoch()
                trial.training = True
                self.dispatched += 1
                heapq.heappush(self.events, (self.now + cpu_s, self.dispatched, trial.number, value, cpu_s))


# --- the learner ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Digits:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


def digits():
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=VALIDATION_IMAGES, stratify=y,
                                                      random_state=SPLIT_SEED)
    return Digits(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train),
                  torch.tensor(x_val, dtype=torch.float32), torch.tensor(y_val))


class DigitsMLP:
    """One trial's learner. Kept between epochs (and across a pause) as its checkpoint would keep it."""

    def __init__(self, params, data):
        self.params, self.data = params, data
        self.model = self.optimizer = self.shuffle = None

    def epoch(self):
        """Train one epoch and evaluate: (validation accuracy, CPU-seconds it took)."""
        started = time.process_time()
        if self.model is None:
            self.build()
        data, batch = self.data, self.params["batch_size"]
        order = torch.randperm(len(data.y_train), generator=self.shuffle)
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            self.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(self.model(data.x_train[rows]), data.y_train[rows]).backward()
            self.optimizer.step()
        with torch.no_grad():
            correct = int((self.model(data.x_val).argmax(1) == data.y_val).sum())
        return correct / len(data.y_val), time.process_time() - started

    def build(self):
        hidden = self.params["hidden"]
        torch.manual_seed(MODEL_SEED)  # the same initial weights whatever trained before
        self.model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                         torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.params["lr"], momentum=0.9)
        self.shuffle = torch.Generator().manual_seed(SHUFFLE_SEED)


# --- the figures ------------------------------------------------------------------------------------
def config(params):
    return tuple(params[name] for name in SPACE)


def pp(value):
    return round(100 * value, 4)


def mismatches(sweep, table):
    """Epochs of `sweep` whose value differs from the grid's for the same configuration and epoch."""
    return sum(value != table[config(t.params)][i][0] for t in sweep.trials for i, (value, _) in enumerate(t.curve))


def seed_run(seed, learner_for, grid, table):
    asha = Sweep(experiment("asha", seed=seed, max_trials=ASHA_TRIALS), learner_for).run()
    rand = Sweep(experiment("random", seed=seed, max_trials=RANDOM_TRIALS), learner_for, budget_s=asha.spent_s).run()
    grid_best = grid.best().value
    grid_epoch_cost = sum(table[config(t.params)][i][1] for t in asha.trials for i in range(t.epochs))
    return {
        "seed": seed,
        "asha_cost_ratio_vs_grid": round(asha.spent_s / grid.spent_s, 4),
        "asha_cost_ratio_from_grid_epochs": round(grid_epoch_cost / grid.spent_s, 4),
        "asha_epoch_ratio_vs_grid": round(asha.epochs / grid.epochs, 4),
        "asha_gap_to_best_pp": pp(grid_best - asha.best().value),
        "asha_best_config": config(asha.best().params),
        "asha_learner_cpu_s": round(asha.spent_s, 3), "asha_epochs": asha.epochs, "asha_trials": len(asha.trials),
        "asha_distinct_configs": len({config(t.params) for t in asha.trials}),
        "asha_completed": sum(t.state == COMPLETED for t in asha.trials),
        "asha_pauses": asha.pauses, "asha_promotions": asha.promotions,
        "asha_virtual_makespan_s": round(asha.now, 3),
        "random_gap_to_best_pp": pp(grid_best - rand.best().value),
        "random_best_completed": rand.best().state == COMPLETED,
        "random_learner_cpu_s": round(rand.spent_s, 3), "random_epochs": rand.epochs,
        "random_completed": sum(t.state == COMPLETED for t in rand.trials),
        "retrained_epochs": asha.epochs + rand.epochs,
        "mismatched_epochs": mismatches(asha, table) + mismatches(rand, table),
    }


def spread(runs, key):
    values = [run[key] for run in runs]
    return round(statistics.median(values), 4), [min(values), max(values)]


def met(key, value):
    """Whether `value` meets the target of figure `key` (random search's gap is held to ASHA's)."""
    return bool(figure("hpsearch", key).met(value))


def main():
    started = time.monotonic()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = digits()

    def learner_for(params):
        return DigitsMLP(params, data)

    learner_for({"lr": 0.01, "hidden": 32, "batch_size": 64}).epoch()  # torch's first-call costs, not counted
    grid = Sweep(experiment("grid", max_trials=27), learner_for).run()
    table = {config(t.params): t.curve for t in grid.trials}
    grid_best = grid.best()
    runs = [seed_run(seed, learner_for, grid, table) for seed in SEEDS]
    figures = {}
    for key in ("asha_cost_ratio_vs_grid", "asha_gap_to_best_pp", "random_gap_to_best_pp",
                "asha_cost_ratio_from_grid_epochs", "asha_epoch_ratio_vs_grid"):
        figures[key], figures[f"{key}_range"] = spread(runs, key)
    both = [run for run in runs if met("asha_cost_ratio_vs_grid", run["asha_cost_ratio_vs_grid"])
            and met("asha_gap_to_best_pp", run["asha_gap_to_best_pp"])]
    figures.update(
        seeds=len(runs), asha_seeds_meeting_targets=len(both),
        asha_seeds_meeting_cost_target=sum(met("asha_cost_ratio_vs_grid", r["asha_cost_ratio_vs_grid"]) for r in runs),
        asha_seeds_meeting_gap_target=sum(met("asha_gap_to_best_pp", r["asha_gap_to_best_pp"]) for r in runs),
        random_seeds_within_gap_target=sum(met("asha_gap_to_best_pp", r["random_gap_to_best_pp"]) for r in runs),
        grid_best_val_acc=grid_best.value, grid_best_config=dict(zip(SPACE, config(grid_best.params))),
        grid_learner_cpu_s=round(grid.spent_s, 3), grid_epochs=grid.epochs,
        grid_virtual_makespan_s=round(grid.now, 3),
        configs_within_gap_target=sum(met("asha_gap_to_best_pp", pp(grid_best.value - curve[-1][0]))
                                      for curve in table.values()),
        asha_max_trials=ASHA_TRIALS, max_concurrent_trials=CONCURRENT, rungs=grid.search.searcher.rungs(),
        retrained_epochs=sum(r["retrained_epochs"] for r in runs),
        mismatched_epochs=sum(r["mismatched_epochs"] for r in runs),
        training="every epoch trained for real (ASHA and random retrain; nothing replayed from the grid)",
        per_seed=runs,
        grid_table={"/".join(map(str, key)): [[round(v, 4), round(c, 4)] for v, c in curve]
                    for key, curve in sorted(table.items())},
        bench_wall_s=round(time.monotonic() - started, 1))
    rows = [("grid: best val acc", grid_best.value, ""), ("grid: learner CPU-seconds", grid.spent_s, "")]
    for run in runs:
        rows.append((f"seed {run['seed']}: ASHA cost ÷ grid / gap pp / random gap pp",
                     f"{run['asha_cost_ratio_vs_grid']:.3f} / {run['asha_gap_to_best_pp']:.2f} / "
                     f"{run['random_gap_to_best_pp']:.2f}", ""))
    for key in ("asha_cost_ratio_vs_grid", "asha_gap_to_best_pp", "random_gap_to_best_pp"):
        rows.append((f"{key} (median of {len(runs)})", figures[key], shown("hpsearch", key)))
    rows.append(("seeds meeting both ASHA targets", f"{len(both)} of {len(runs)}", ""))
    rows.append(("retrained epochs differing from the grid's", figures["mismatched_epochs"], "= 0"))
    publish("hpsearch", rows, figures)


if __name__ == "__main__":
    main()
