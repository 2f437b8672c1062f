"""What the experiments' passes may cost the scheduling loop, and what they survive: a bounded amount
of work a pass (rung decisions, promotions, halts, stops, TPE's proposals), a time budget for all of
them with turns between tenants, an experiment no pass can read, the tenant's limits reached after
creation, one code archive shared by every trial, and a kill that leaves its stops to the passes.
jobs/tests/test_experiments.py has the searchers' behaviour itself."""
import json
import os
import time

import pytest
from django.utils import timezone

from jobs import experiments, lifecycle, reconcile, storage, submission
from jobs.models import Artifact, Experiment, Job, MetricPoint, Status, Trial
from jobs.states import transition
from tenants import quotas
from tenants.models import Membership, Quota
from tests.support import builders
from tests.support.builders import WAKE_SCHEDULER, member, record_sends, tar_gz, upload

pytestmark = pytest.mark.django_db

RANDOM = {"name": "random", "metric": "acc", "max_trials": 20, "max_concurrent_trials": 2}
ASHA = {"name": "asha", "metric": "acc", "max_trials": 40, "max_concurrent_trials": 6, "max_length": 9, "divisor": 3}


def manifest(searcher, *, priority="normal", extra=""):
    return (f"name: sweep\ncpus: 1\nmemory: 1GiB\npriority: {priority}\n{extra}"
            "framework: {name: custom, command: 'python t.py {{hparams.lr}}'}\n"
            "checkpoint: {signal: SIGTERM, grace_seconds: 5}\n"
            "hyperparameters: {lr: {type: log, minval: 0.001, maxval: 0.1}}\n"
            f"searcher: {json.dumps(searcher)}\n").encode()


def create(membership, searcher=None, **kwargs):
    return experiments.create(membership, manifest_bytes=manifest(searcher or RANDOM, **kwargs),
                              code_file=upload(tar_gz({"t.py": b"print(1)\n"})))


@pytest.fixture
def sent(monkeypatch):
    monkeypatch.setattr(experiments, "_not_reached", [], raising=False)  # no turn left over from another test
    return record_sends(monkeypatch)


@pytest.fixture
def alice(sent):
    return member("team-a", "alice")


def trials_of(experiment):
    return list(Trial.objects.filter(experiment=experiment).select_related("job").order_by("number"))


def run_to(job, *statuses):
    for target in statuses:
        transition(job.id, target, actor="test", attempt=job.attempt)
    job.refresh_from_db()


def report(job, step, value):
    MetricPoint.objects.create(job=job, attempt=job.attempt, name="acc", step=step, value=value, time=timezone.now())


def advanced(monkeypatch):
    """The experiments advance() is called for, in order."""
    calls, real = [], experiments.advance

    def advance(experiment_id, **kwargs):
        calls.append(experiment_id)
        real(experiment_id, **kwargs)
    monkeypatch.setattr(experiments, "advance", advance)
    return calls


# --- a pass does a bounded amount of work -------------------------------------------------------------
def asha_at_first_rung(alice, values):
    """An ASHA experiment whose first trials, running, all reported a value at its first rung."""
    experiment = create(alice, {**ASHA, "max_concurrent_trials": len(values)})
    while len(trials_of(experiment)) < len(values):
        experiments.advance(experiment.id)
    for trial, value in zip(trials_of(experiment), values):
        run_to(trial.job, Status.PENDING, Status.PROCESSING)
        report(trial.job, 1, value)
    return experiment


def test_it_decides_a_few_trials_at_a_rung_each_pass_and_the_rest_the_next(alice, sent, monkeypatch):
    monkeypatch.setattr(experiments, "DECISIONS_PER_PASS", 2)
    values = [0.1, 0.9, 0.3, 0.8, 0.2, 0.4]
    experiment = asha_at_first_rung(alice, values)
    sent.clear()
    experiments.advance(experiment.id)
    trials = trials_of(experiment)[:6]
    assert all(t.rungs == {"0": v} for t, v in zip(trials, values))  # every one's rung is recorded at once
    assert [t.state for t in trials] == ["paused", "running", "running", "running", "running", "running"]
    assert [t.promoted for t in trials] == [-1, 0, -1, -1, -1, -1]
    assert WAKE_SCHEDULER in sent  # the loop comes back soon for the rest
    for _ in range(2):
        experiments.advance(experiment.id)
    # Decided over three passes as in one: the best two of six (0.9, 0.8) go on, the others pause.
    assert [t.state for t in trials_of(experiment)[:6]] == ["paused", "running", "paused", "running", "paused",
                                                             "paused"]
    assert [t.job.status for t in trials_of(experiment)[:6] if t.state == "paused"] == [Status.HALTING] * 4


def test_it_promotes_a_few_paused_trials_a_pass_before_any_new_one(alice, monkeypatch):
    experiment = asha_at_first_rung(alice, [0.1, 0.9, 0.3, 0.8, 0.2, 0.4])
    experiments.advance(experiment.id)  # the best two go on, four pause, and four new ones start
    for trial in trials_of(experiment):
        if trial.job.status == Status.HALTING:
            run_to(trial.job, Status.HALTED)
        elif trial.number >= 6:
            lifecycle.terminate(trial.job, actor="test")  # their slots free again
    started = len(trials_of(experiment))
    for number in range(started, started + 6):  # six more reach the rung, all worse: two more places
        Trial.objects.create(experiment=experiment, number=number, job=builders.job(alice, status=Status.TERMINATED),
                             params={"lr": 0.01}, state="stopped", rungs={"0": 0.01})
    Experiment.objects.filter(pk=experiment.pk).update(trials_started=started + 6)
    monkeypatch.setattr(experiments, "DECISIONS_PER_PASS", 1)
    experiments.advance(experiment.id)
    promoted = [t.number for t in trials_of(experiment) if t.state == "running" and t.promoted == 0]
    assert promoted == [1, 3, 5]  # 0.4, the best paused, joins the two let go on
    assert len(trials_of(experiment)) == started + 6  # no new configuration while a promotion waits
    experiments.advance(experiment.id)
    promoted = [t.number for t in trials_of(experiment) if t.state == "running" and t.promoted == 0]
    assert promoted == [1, 2, 3, 5] and trials_of(experiment)[2].job.status == Status.QUEUED


def test_a_pass_builds_the_searchers_view_of_each_trial_once(alice, monkeypatch):
    values = [0.1 * (n % 9) for n in range(30)]
    experiment = asha_at_first_rung(alice, values)
    built, view = [], experiments.searching.TrialView

    def counted(**fields):
        built.append(fields["number"])
        return view(**fields)
    monkeypatch.setattr(experiments.searching, "TrialView", counted)
    experiments.advance(experiment.id)
    decided = sum(t.state == "paused" or t.promoted == 0 for t in trials_of(experiment))
    assert decided == 30
    # once for each trial, and again for each one a decision changed: not every trial for every decision
    assert len(built) <= len(trials_of(experiment)) + 3 * decided


def test_tpe_proposes_one_trial_a_pass(alice):
    experiment = create(alice, {**RANDOM, "name": "tpe", "max_concurrent_trials": 8})
    experiments.advance(experiment.id)
    assert len(trials_of(experiment)) == 1 == experiments.TPE_NEW_TRIALS_PER_PASS
    experiments.advance(experiment.id)
    assert len(trials_of(experiment)) == 2


# --- the budget of all the passes of a cycle ----------------------------------------------------------
def test_a_spent_budget_leaves_the_rest_to_the_next_cycle_taking_turns_between_tenants(alice, sent, monkeypatch):
    ours = [create(alice) for _ in range(3)]
    theirs = create(member("team-b", "bob"))
    calls = advanced(monkeypatch)
    experiments.advance_all(budget_s=0)  # past the budget from the start: one pass, the oldest's
    assert calls == [ours[0].id] and WAKE_SCHEDULER in sent
    experiments.advance_all(budget_s=0)  # team-b's one goes before team-a's others
    assert calls[1:] == [theirs.id]
    experiments.advance_all(budget_s=0)
    experiments.advance_all(budget_s=0)
    assert sorted(calls) == sorted(e.id for e in [*ours, theirs])  # each had its pass once
    calls.clear()
    experiments.advance_all(budget_s=60)
    assert sorted(calls) == sorted(e.id for e in [*ours, theirs])


def test_a_paused_experiment_with_nothing_to_observe_gets_no_pass(alice, monkeypatch):
    held, busy = create(alice), create(alice)
    for experiment in (held, busy):
        experiments.advance(experiment.id)
        experiments.pause(experiment, actor="alice")
    for trial in trials_of(held):
        run_to(trial.job, Status.PENDING, Status.PROCESSING, Status.HALTING, Status.HALTED)
    run_to(trials_of(busy)[0].job, Status.PENDING, Status.PROCESSING)  # admitted while paused: to be halted
    calls = advanced(monkeypatch)
    experiments.advance_all(budget_s=60)
    assert calls == [busy.id]
    assert trials_of(busy)[0].job.status == Status.HALTING


def test_a_tenant_may_have_so_many_experiments_not_finished(alice, settings):
    settings.MAX_EXPERIMENTS = 2
    first, _ = create(alice), create(alice)
    with pytest.raises(experiments.ExperimentError, match="tenant 'team-a' has 2 not finished") as refused:
        create(alice)
    assert refused.value.status == 429
    create(member("team-b", "bob"))  # another tenant's count is its own
    experiments.kill(first, actor="alice")  # no trial yet: it ends with its kill
    assert Experiment.objects.get(pk=first.pk).finished_at is not None
    create(alice)


# --- an experiment no pass can read --------------------------------------------------------------------
def test_a_manifest_its_redacted_credentials_would_break_is_refused(alice):
    local_store = ("data_stores: [{id: mine, type: local, training_data: {container: data}, "
                   "connection: {user_name: ' '}}]\n")
    with pytest.raises(experiments.ExperimentError, match="as stored, with its data-store credentials redacted") as no:
        create(alice, extra=local_store)
    assert no.value.status == 400 and no.value.field == "data_stores[0].connection"
    assert not Experiment.objects.exists() and not list(storage.root().glob("team-a/exp-*"))


def test_an_experiment_no_pass_can_read_is_paused_with_the_reason_and_can_be_killed(alice, caplog):
    experiment = create(alice)
    experiments.advance(experiment.id)
    running = trials_of(experiment)[0]
    run_to(running.job, Status.PENDING, Status.PROCESSING)
    spec = experiment.spec
    spec["fields"]["framework"]["name"] = "no-such-framework"  # a rule that changed since it was created
    Experiment.objects.filter(pk=experiment.pk).update(spec=spec)
    experiments.advance_all(budget_s=60)
    experiment.refresh_from_db()
    assert "its pass failed" not in caplog.text
    assert experiment.state == Experiment.State.PAUSED
    assert experiment.state_reason.startswith("paused: its stored manifest no longer passes the platform's rules (")
    assert trials_of(experiment)[0].job.status == Status.HALTING and len(trials_of(experiment)) == 2
    killed = experiments.kill(experiment, actor="alice")
    assert killed.state == Experiment.State.TERMINATED and killed.finished_at is not None
    assert {t.state for t in trials_of(experiment)} == {"stopped"}


# --- the tenant's rules, after creation ----------------------------------------------------------------
def test_a_full_storage_quota_stops_new_trials_with_the_reason_and_observations_go_on(alice, caplog):
    experiment = create(alice)
    experiments.advance(experiment.id)
    first = trials_of(experiment)[0]
    run_to(first.job, Status.PENDING, Status.PROCESSING, Status.STORING, Status.COMPLETED)
    report(first.job, 5, 0.9)
    Artifact.objects.create(job_id=first.job.id, kind="result", name="results/big.bin", size=10**6)
    Quota.objects.update_or_create(tenant=alice.tenant, defaults={"storage_bytes": 1})
    experiments.advance_all(budget_s=60)
    experiment.refresh_from_db()
    assert "its pass failed" not in caplog.text
    assert experiment.state_reason.startswith("waiting: tenant storage quota reached")
    assert experiment.best_trial == 0 and experiment.best_value == 0.9
    assert trials_of(experiment)[0].state == "completed" and len(trials_of(experiment)) == 2


def test_an_experiments_code_archive_counts_once_against_the_storage_quota_whatever_links_it(alice):
    experiment = create(alice)
    experiments.advance(experiment.id)
    trials = trials_of(experiment)
    assert trials and all(trial.job.code_bytes == experiment.code_bytes > 0 for trial in trials)
    assert quotas.stored_bytes(alice.tenant) == experiment.code_bytes


def test_a_trial_the_tenants_limits_refuse_leaves_the_reason_not_a_failed_pass(alice, monkeypatch):
    experiment = create(alice)

    def refused(*args):
        raise submission.SubmitError("the job asks for more disk than the tenant's quota allows", field="disk")
    monkeypatch.setattr(submission, "disk_caps_for", refused)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert experiment.state_reason == "waiting: the job asks for more disk than the tenant's quota allows"
    assert trials_of(experiment) == [] and experiment.trials_started == 0


def test_a_trial_is_queued_within_the_tenants_queue_limit_counted_under_its_lock(alice, monkeypatch):
    # The pass's own count of the queue's room was read earlier, without the lock: submissions may
    # have filled the queue since.
    Quota.objects.update_or_create(tenant=alice.tenant, defaults={"queued_jobs": 1})
    builders.job(alice)  # the one queued job the tenant may have
    monkeypatch.setattr(submission, "queue_room", lambda tenant: 4)
    experiment = create(alice)
    experiments.advance(experiment.id)
    experiment.refresh_from_db()
    assert trials_of(experiment) == [] and experiment.state_reason.startswith("waiting: too many queued jobs")


def test_an_owner_disabled_or_refused_the_trials_priority_pauses_the_experiment(sent):
    boss = member("team-a", "boss", role="admin")
    urgent, plain = create(boss, priority="high"), create(boss)
    Membership.objects.filter(pk=boss.pk).update(role="researcher")
    experiments.advance(urgent.id)
    experiments.advance(plain.id)
    urgent.refresh_from_db()
    assert urgent.state == Experiment.State.PAUSED and not trials_of(urgent)
    assert urgent.state_reason.startswith("paused: its owner boss may no longer start its trials (priority high is "
                                          "refused")
    assert len(trials_of(plain)) == 2  # a researcher may start normal ones
    boss.user.is_active = False
    boss.user.save()
    experiments.advance(plain.id)
    plain.refresh_from_db()
    assert plain.state == Experiment.State.PAUSED
    assert plain.state_reason == "paused: its owner boss's account is disabled"
    assert len(trials_of(plain)) == 2


# --- one code archive for every trial --------------------------------------------------------------------
def archive_of(experiment):
    return next(storage.job_dir(experiment.tenant.slug, experiment.id).glob("code.*"))


def test_trials_link_the_experiments_read_only_archive_and_its_known_digest(alice, monkeypatch):
    experiment = create(alice)
    monkeypatch.setattr(storage, "sha256_of", lambda path: pytest.fail(f"{path} hashed again"))
    experiments.advance(experiment.id)
    shared = archive_of(experiment).stat()
    assert shared.st_mode & 0o222 == 0
    for trial in trials_of(experiment):
        code = submission.code_archive(trial.job)
        assert code.stat().st_ino == shared.st_ino and code.stat().st_dev == shared.st_dev
        assert trial.job.code_sha256 == experiment.code_sha256 and trial.job.code_bytes == experiment.code_bytes


def test_an_archive_that_cannot_be_linked_is_copied(alice, monkeypatch):
    experiment = create(alice)

    def cannot(*args):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "link", cannot)
    experiments.advance(experiment.id)
    code = submission.code_archive(trials_of(experiment)[0].job)
    assert code.stat().st_ino != archive_of(experiment).stat().st_ino
    assert code.read_bytes() == archive_of(experiment).read_bytes()


# --- a pass that fails or is killed after storing trials ---------------------------------------------------
class Killed(BaseException):
    """The process dies here: nothing after it runs, no cleanup of its own either."""


def fail_on_second_trial(monkeypatch, error):
    """The pass fails while storing its second trial: after its job's folder, before the commit."""
    written, real = [], experiments._write_hparams

    def write_hparams(job, values):
        written.append(job.id)
        if len(written) == 2:
            raise error
        real(job, values)
    monkeypatch.setattr(experiments, "_write_hparams", write_hparams)
    return written


def folders_of(tenant_slug):
    return {path.name for path in storage.root().joinpath(tenant_slug).iterdir()}


def test_a_pass_that_fails_after_storing_trials_removes_their_folders(alice, monkeypatch):
    experiment = create(alice)
    with monkeypatch.context() as patched:
        stored = fail_on_second_trial(patched, OSError(28, "No space left on device"))
        experiments.advance_all(budget_s=60)  # logged; the next pass tries again
    assert len(stored) == 2 and not Job.objects.exists() and not Trial.objects.exists()
    assert folders_of("team-a") == {experiment.id}
    experiments.advance(experiment.id)
    assert folders_of("team-a") == {experiment.id} | {t.job_id for t in trials_of(experiment)}


def test_a_pass_killed_after_storing_trials_leaves_folders_the_storage_sweep_removes(alice, monkeypatch):
    experiment = create(alice)
    with monkeypatch.context() as patched:
        stored = fail_on_second_trial(patched, Killed())
        patched.setattr(experiments.Pass, "discard_stored", lambda self: None, raising=False)  # nothing runs
        with pytest.raises(Killed):
            experiments.advance(experiment.id)
    assert not Job.objects.exists() and folders_of("team-a") == {experiment.id, *stored}
    experiments.advance(experiment.id)  # the restarted loop's pass stores its trials again
    kept = {experiment.id} | {t.job_id for t in trials_of(experiment)}
    reconcile.sweep_storage()
    assert folders_of("team-a") == kept | set(stored)  # not before a submission in flight would have committed
    long_ago = time.time() - reconcile.ORPHAN_GRACE_S - 60
    for name in folders_of("team-a"):
        staged = storage.job_dir("team-a", name) / storage.STAGED_MARK
        if staged.exists():
            os.utime(staged, (long_ago, long_ago))
    reconcile.sweep_storage()
    assert folders_of("team-a") == kept
    assert all(submission.code_archive(t.job) for t in trials_of(experiment))


# --- kill -----------------------------------------------------------------------------------------------
def test_kill_commits_and_leaves_most_stops_to_the_loops_passes(alice, sent, monkeypatch):
    experiment = create(alice, {**RANDOM, "max_concurrent_trials": 5})
    for _ in range(2):
        experiments.advance(experiment.id)
    assert len(trials_of(experiment)) == 5
    monkeypatch.setattr(experiments, "DECISIONS_PER_PASS", 2)
    sent.clear()
    killed = experiments.kill(experiment, actor="alice")
    assert killed.state == Experiment.State.TERMINATED and killed.finished_at is None
    assert [t.state for t in trials_of(experiment)] == ["stopped"] * 2 + ["running"] * 3
    assert WAKE_SCHEDULER in sent
    for _ in range(2):
        experiments.advance_all(budget_s=60)
    experiment.refresh_from_db()
    assert experiment.finished_at is not None and experiment.state_reason == "killed by alice"
    assert {(t.state, t.job.status) for t in trials_of(experiment)} == {("stopped", Status.TERMINATED)}
