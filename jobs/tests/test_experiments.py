"""Experiments driven pass by pass (jobs.experiments): trials started as jobs with their
hyperparameters, ASHA pausing and promoting through halt and resume, the end, pause/resume/kill,
and tenant scoping. The trials' jobs are moved through their states here as a backend would move them;
tests/e2e/test_experiments.py runs real learners."""
import json
from types import SimpleNamespace

import pytest
from django.utils import timezone

from jobs import admission, experiments, runtime, storage
from jobs.backends.base import Capacity, Node
from jobs.models import ACTIVE, Experiment, Job, MetricPoint, Status, Trial
from jobs.states import transition
from tenants import quotas
from tests.support import builders
from tests.support.builders import member, record_sends, tar_gz, upload
from trainyard.manifest import ManifestError

pytestmark = pytest.mark.django_db

BASE = """
name: sweep
cpus: 1
memory: 1GiB
framework: {name: custom, command: "python train.py --epochs 9 --lr {{hparams.lr}} --width {{hparams.width}}"}
checkpoint: {signal: SIGTERM, grace_seconds: 5}
"""


def manifest(searcher, hyperparameters=None):
    hyperparameters = hyperparameters or {"lr": {"type": "log", "minval": 0.001, "maxval": 0.1, "count": 3},
                                          "width": {"type": "categorical", "vals": [8, 16, 32]}}
    return (BASE + "hyperparameters: " + json.dumps(hyperparameters) + "\nsearcher: " + json.dumps(searcher)).encode()


def create(membership, searcher, **kwargs):
    return experiments.create(membership, manifest_bytes=manifest(searcher, **kwargs),
                              code_file=upload(tar_gz({"train.py": b"print(1)\n"})))


@pytest.fixture
def alice(monkeypatch):
    record_sends(monkeypatch)
    return member("team-a", "alice")


def trials_of(experiment):
    return list(Trial.objects.filter(experiment=experiment).select_related("job").order_by("number"))


def run_to(job, status):
    path = {Status.PROCESSING: [Status.PENDING, Status.PROCESSING],
            Status.COMPLETED: [Status.PENDING, Status.PROCESSING, Status.STORING, Status.COMPLETED]}[status]
    for target in path:
        transition(job.id, target, actor="test", attempt=job.attempt)
    job.refresh_from_db()


def report(job, step, value, name="val_acc"):
    MetricPoint.objects.create(job=job, attempt=job.attempt, name=name, step=step, value=value, time=timezone.now())


def test_a_grid_starts_its_trials_as_jobs_with_their_hyperparameters(alice):
    experiment = create(alice, {"name": "grid", "metric": "val_acc", "max_trials": 20, "max_concurrent_trials": 4})
    experiments.advance(experiment.id)
    trials = trials_of(experiment)
    assert [t.number for t in trials] == [0, 1, 2, 3]
    points = {(t.params["lr"], t.params["width"]) for t in trials}
    assert len(points) == 4
    first = trials[0]
    run = runtime.of(first.job)
    assert run.command == f"python train.py --epochs 9 --lr {first.params['lr']!r} --width {first.params['width']}"
    assert run.hyperparameters == first.params and run.experiment == {"id": experiment.id, "trial": 0}
    assert first.job.status == Status.QUEUED and first.job.tenant == alice.tenant and first.job.owner == alice.user
    hparams = storage.job_dir("team-a", first.job.id) / "results" / "hparams.json"
    assert json.loads(hparams.read_text()) == first.params
    experiments.advance(experiment.id)  # nothing ended: no trial more
    assert len(trials_of(experiment)) == 4


def test_a_grid_runs_every_point_once_then_completes_with_the_best(alice):
    experiment = create(alice, {"name": "grid", "metric": "val_acc", "max_trials": 100, "max_concurrent_trials": 4})
    seen = set()
    for _ in range(10):
        experiments.advance(experiment.id)
        for trial in trials_of(experiment):
            if trial.job.status == Status.QUEUED:
                run_to(trial.job, Status.COMPLETED)
                report(trial.job, 9, trial.params["width"] / 100 - trial.params["lr"])
                seen.add((trial.params["lr"], trial.params["width"]))
    experiment.refresh_from_db()
    assert len(seen) == 9 and experiment.trials_started == 9
    assert experiment.state == Experiment.State.COMPLETED and experiment.finished_at is not None
    best = Trial.objects.get(experiment=experiment, number=experiment.best_trial)
    assert best.params == {"lr": 0.001, "width": 32} and experiment.best_value == pytest.approx(0.319)


def asha_experiment(alice, **searcher):
    return create(alice, {"name": "asha", "metric": "val_acc", "max_trials": 9, "max_concurrent_trials": 3,
                          "max_length": 9, "divisor": 3, **searcher},
                  hyperparameters={"lr": {"type": "log", "minval": 0.001, "maxval": 0.1},
                                   "width": {"type": "int", "minval": 8, "maxval": 64}})


def test_asha_pauses_a_trial_at_a_rung_through_a_halt_and_promotes_it_by_resuming(alice):
    experiment = asha_experiment(alice)
    experiments.advance(experiment.id)
    first, second, third = trials_of(experiment)
    for trial, value in ((first, 0.5), (second, 0.9), (third, 0.7)):
        run_to(trial.job, Status.PROCESSING)
        report(trial.job, 1, value)
    experiments.advance(experiment.id)
    # Three reached rung 1: one place (3 // 3) goes to the best; the others are halted.
    first, second, third = trials_of(experiment)[:3]
    assert (first.state, second.state, third.state) == ("paused", "running", "paused")
    assert first.job.status == Status.HALTING and third.job.status == Status.HALTING
    assert second.job.status == Status.PROCESSING and second.promoted == 0
    assert first.job.events.latest("id").reason.startswith("paused at rung 1 (val_acc 0.5 at step 1)")
    assert len(trials_of(experiment)) == 5  # two slots freed: two new configurations
    for trial in (first, third):
        transition(trial.job.id, Status.HALTED, actor="test", attempt=trial.job.attempt)
    for trial, value in zip(trials_of(experiment)[3:5], (0.1, 0.2)):
        run_to(trial.job, Status.PROCESSING)
        report(trial.job, 1, value)
    experiments.advance(experiment.id)  # five at rung 1, still one place: both paused, two new trials
    assert [t.state for t in trials_of(experiment)[3:]] == ["paused", "paused", "running", "running"]
    # Six at rung 1 give two places: the second best (0.7, paused) is promoted from its checkpoint.
    sixth = trials_of(experiment)[5]
    run_to(sixth.job, Status.PROCESSING)
    report(sixth.job, 1, 0.3)
    experiments.advance(experiment.id)
    trials = {t.number: t for t in trials_of(experiment)}
    assert trials[2].state == "running" and trials[2].promoted == 0
    assert trials[2].job.status == Status.QUEUED and trials[2].job.attempt == 2
    assert trials[0].state == "paused" and trials[0].job.status == Status.HALTED


def test_asha_ends_with_paused_trials_stopped_and_the_best_completed(alice):
    experiment = asha_experiment(alice, max_trials=3)
    experiments.advance(experiment.id)
    trials = trials_of(experiment)
    for trial, value in zip(trials, (0.5, 0.9, 0.7)):
        run_to(trial.job, Status.PROCESSING)
        report(trial.job, 1, value)
    experiments.advance(experiment.id)
    for trial in trials_of(experiment):
        if trial.job.status == Status.HALTING:
            transition(trial.job.id, Status.HALTED, actor="test", attempt=trial.job.attempt)
    best = Trial.objects.get(experiment=experiment, number=1)
    report(best.job, 3, 0.95)  # alone at rung 2, no place among one; but nothing else could run: it goes on
    experiments.advance(experiment.id)
    best.refresh_from_db()
    assert best.state == "running" and best.promoted == 1 and best.job.status == Status.PROCESSING
    run_to(best.job, Status.COMPLETED)
    report(best.job, 9, 0.97)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert experiment.state == Experiment.State.COMPLETED
    states = {t.number: (t.state, t.job.status) for t in trials_of(experiment)}
    assert states == {0: ("stopped", Status.TERMINATED), 1: ("completed", Status.COMPLETED),
                      2: ("stopped", Status.TERMINATED)}
    assert experiment.best_trial == 1 and experiment.best_value == 0.97


def test_pause_halts_running_trials_and_resume_resumes_them(alice):
    experiment = create(alice, {"name": "random", "metric": "val_acc", "max_trials": 5, "max_concurrent_trials": 2})
    experiments.advance(experiment.id)
    first, second = trials_of(experiment)
    run_to(first.job, Status.PROCESSING)
    experiments.pause(experiment, actor="alice")
    experiments.advance(experiment.id)
    first, second = trials_of(experiment)
    assert first.job.status == Status.HALTING and second.job.status == Status.QUEUED
    transition(first.job.id, Status.HALTED, actor="test", attempt=1)
    run_to(second.job, Status.PROCESSING)  # admitted while paused: halted by the next pass
    experiments.advance(experiment.id)
    assert trials_of(experiment)[1].job.status == Status.HALTING
    with pytest.raises(experiments.ExperimentError, match="only an experiment that is ACTIVE can be paused"):
        experiments.pause(experiment, actor="alice")
    experiments.resume(experiment, actor="alice")
    experiments.advance(experiment.id)
    first = trials_of(experiment)[0]
    assert first.job.status == Status.QUEUED and first.job.attempt == 2 and len(trials_of(experiment)) == 2


def test_kill_terminates_every_trial(alice):
    experiment = create(alice, {"name": "random", "metric": "val_acc", "max_trials": 5, "max_concurrent_trials": 2})
    experiments.advance(experiment.id)
    run_to(trials_of(experiment)[0].job, Status.PROCESSING)
    experiment = experiments.kill(experiment, actor="alice")
    assert experiment.state == Experiment.State.TERMINATED
    assert {(t.state, t.job.status) for t in trials_of(experiment)} == {("stopped", Status.TERMINATED)}


def test_a_kill_whose_own_pass_never_ran_is_finished_by_the_loop(alice, monkeypatch):
    """The kill commits, then the web process dies before its pass stops the trials: the loop's pass does it."""
    experiment = create(alice, {"name": "random", "metric": "val_acc", "max_trials": 5, "max_concurrent_trials": 2})
    experiments.advance(experiment.id)
    run_to(trials_of(experiment)[0].job, Status.PROCESSING)
    with monkeypatch.context() as patched:
        patched.setattr(experiments, "advance", lambda experiment_id, **kw: None)  # the request's own pass: never ran
        experiments.kill(experiment, actor="alice")
    experiment.refresh_from_db()
    assert experiment.state == Experiment.State.TERMINATED and experiment.finished_at is None
    assert {t.job.status for t in trials_of(experiment)} == {Status.PROCESSING, Status.QUEUED}
    experiments.advance_all()
    experiment.refresh_from_db()
    assert experiment.finished_at is not None
    assert {(t.state, t.job.status) for t in trials_of(experiment)} == {("stopped", Status.TERMINATED)}


def test_tpe_and_random_propose_within_the_ranges(alice):
    for name in ("random", "tpe"):
        experiment = create(alice, {"name": name, "metric": "loss", "smaller_is_better": True, "max_trials": 12,
                                    "max_concurrent_trials": 3},
                            hyperparameters={"lr": {"type": "log", "minval": 0.001, "maxval": 0.1},
                                             "width": {"type": "int", "minval": 8, "maxval": 64}})
        for _ in range(14):  # TPE proposes one trial a pass
            experiments.advance(experiment.id)
            for trial in trials_of(experiment):
                if trial.job.status == Status.QUEUED:
                    run_to(trial.job, Status.COMPLETED)
                    report(trial.job, 9, trial.params["lr"], name="loss")
        trials = trials_of(experiment)
        assert len(trials) == 12 and len({t.params["lr"] for t in trials}) == 12
        assert all(0.001 <= t.params["lr"] <= 0.1 and 8 <= t.params["width"] <= 64 for t in trials)
        experiment.refresh_from_db()
        assert experiment.state == Experiment.State.COMPLETED
        assert experiment.best_value == min(t.params["lr"] for t in trials)


def test_a_bad_experiment_is_refused_naming_each_problem(alice):
    with pytest.raises(experiments.ExperimentError) as refused:
        create(alice, {"name": "asha", "metric": "val_acc"},
               hyperparameters={"lr": {"type": "log", "minval": 0, "maxval": 1}})
    text = str(refused.value)
    assert "searcher.max_length: is required for asha" in text and "hyperparameters.lr.minval" in text
    with pytest.raises(experiments.ExperimentError, match=r"framework.command: uses \{\{hparams.width\}\}, which is "
                                                           "not among the hyperparameters"):
        create(alice, {"name": "random", "metric": "val_acc"}, hyperparameters={"lr": {"type": "double", "minval": 0,
                                                                                      "maxval": 1}})
    assert not Experiment.objects.exists()
    assert not list(storage.root().glob("team-a/exp-*"))


def test_an_experiment_that_could_flood_the_platform_is_refused_by_name(alice):
    """A grid the searcher would have to list in full, and a command its values would blow up past a
    manifest's size in every trial's job row."""
    huge = {f"h{i}": {"type": "double", "minval": 0, "maxval": 1, "count": 100} for i in range(6)}
    huge["lr"], huge["width"] = {"type": "const", "val": 1}, {"type": "const", "val": 2}
    with pytest.raises(experiments.ExperimentError, match="hyperparameters: make a grid of 1,000,000,000,000 points; "
                                                         "a grid search takes at most 100,000"):
        create(alice, {"name": "grid", "metric": "val_acc"}, hyperparameters=huge)
    long_values = {"lr": {"type": "categorical", "vals": ["'" * 200, "b"]}, "width": {"type": "const", "val": 1}}
    with pytest.raises(experiments.ExperimentError, match="framework.command: becomes"):
        experiments.create(alice, manifest_bytes=manifest({"name": "grid", "metric": "val_acc"}, long_values).replace(
            b"--lr {{hparams.lr}}", b" ".join([b"{{hparams.lr}}"] * 100)), code_file=upload(tar_gz({"t.py": b"1\n"})))
    assert not Experiment.objects.exists()


def test_a_pass_starts_a_few_new_trials_however_many_may_run(alice):
    """The searcher's proposals run in the scheduling loop every tenant waits on: a search that may run
    256 trials at once reaches that over several passes."""
    experiment = create(alice, {"name": "random", "metric": "val_acc", "max_trials": 300, "max_concurrent_trials": 256},
                        hyperparameters={"lr": {"type": "double", "minval": 0, "maxval": 1},
                                         "width": {"type": "int", "minval": 1, "maxval": 100000}})
    experiments.advance(experiment.id)
    assert len(trials_of(experiment)) == experiments.NEW_TRIALS_PER_PASS
    experiments.advance(experiment.id)
    assert len(trials_of(experiment)) == 2 * experiments.NEW_TRIALS_PER_PASS


@pytest.mark.parametrize("change", ["removed", "viewer"])
def test_an_experiment_pauses_when_its_owner_may_no_longer_submit(alice, change):
    from tenants import people
    member("team-a", "root", role="admin")  # the tenant keeps an admin
    experiment = create(alice, {"name": "grid", "metric": "val_acc", "max_concurrent_trials": 2})
    experiments.advance(experiment.id)
    first = trials_of(experiment)
    run_to(first[0].job, Status.PROCESSING)
    if change == "removed":
        people.remove_member(alice)
    else:
        people.change_role(alice, "viewer")
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert experiment.state == Experiment.State.PAUSED
    assert experiment.state_reason.startswith("paused: its owner alice ")
    assert len(trials_of(experiment)) == 2  # no trial more
    assert Job.objects.get(pk=first[0].job.pk).status == Status.HALTING  # its running trial halts


def test_a_hundred_trial_experiment_keeps_to_its_tenants_quota_and_gives_borrowed_gpus_back(alice, monkeypatch):
    """Trials are the tenant's jobs to the scheduler: beside an idle tenant they borrow its GPUs, and
    when that tenant submits, the borrowed ones are reclaimed (preempted through a halt, queued again)
    while the trials within the tenant's own quota run on."""
    capacity = Capacity(nodes=(Node("node-0", 4, 64.0, 256 * 2**30), Node("node-1", 4, 64.0, 256 * 2**30)))
    monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
    bob = member("team-b", "bob")
    quotas.set_quota(alice.tenant, gpus=4, can_borrow=True)
    quotas.set_quota(bob.tenant, gpus=4, can_borrow=True)
    experiment = experiments.create(alice, manifest_bytes=(BASE.replace("cpus: 1", "cpus: 1\ngpus: 1") + """
hyperparameters: {lr: {type: log, minval: 0.001, maxval: 0.1}, width: {type: int, minval: 8, maxval: 64}}
searcher: {name: random, metric: val_acc, max_trials: 100, max_concurrent_trials: 100}
""").encode(), code_file=upload(tar_gz({"train.py": b"print(1)\n"})))
    for _ in range(100 // experiments.NEW_TRIALS_PER_PASS):  # a few new trials a pass
        experiments.advance(experiment.id)
    assert len(trials_of(experiment)) == 100
    admission.run_cycle()

    def holding(tenant):
        return sum(j.gpus for j in Job.objects.filter(tenant=tenant, status__in=ACTIVE))
    assert holding(alice.tenant) == 8  # its 4 and, while team-b is idle, team-b's 4 borrowed

    theirs = [builders.job(bob, gpus=1, name=f"b{i}") for i in range(4)]
    reclaimed = []
    for _ in range(6):  # cycles until team-b runs: each preempts what it needs back
        admission.run_cycle()
        for trial in trials_of(experiment):
            victim = trial.job
            if victim.status == Status.HALTING:  # its learners checkpoint and stop; it queues again
                assert "reclaimed" in victim.preempted_reason
                reclaimed.append(victim.id)
                transition(victim.id, Status.HALTED, actor="test", attempt=victim.attempt)
                transition(victim.id, Status.QUEUED, actor="test", attempt=victim.attempt, attempt_next=True)
        if all(Job.objects.get(pk=j.pk).status == Status.PENDING for j in theirs):
            break
    assert [Job.objects.get(pk=j.pk).status for j in theirs] == [Status.PENDING] * 4
    assert len(reclaimed) == 4  # exactly the borrowed GPUs, none of the tenant's own
    assert holding(alice.tenant) == 4 and holding(bob.tenant) == 4
    experiments.advance(experiment.id)  # the preempted trials are still the experiment's, running again later
    assert sum(t.state == "running" for t in trials_of(experiment)) == 100
    assert Trial.objects.filter(experiment=experiment).count() == 100


def test_a_pass_that_learns_nothing_writes_nothing(alice):
    experiment = create(alice, {"name": "random", "metric": "val_acc", "max_trials": 5, "max_concurrent_trials": 2})
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    stamp = experiment.updated_at
    trial_stamps = [t.updated_at for t in trials_of(experiment)]
    experiments.advance(experiment.id)  # the scheduling loop's next cycle: no point, no job changed
    experiment.refresh_from_db()
    assert experiment.updated_at == stamp and [t.updated_at for t in trials_of(experiment)] == trial_stamps
    report(trials_of(experiment)[0].job, 1, 0.4)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert experiment.updated_at > stamp and experiment.best_value == 0.4
