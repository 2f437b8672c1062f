"""reconcile() against a backend double (the project's own interface): it settles learners the
backend knows more about, and re-drives steps whose tasks were lost. sweep_storage() removes what
processes killed mid-submission left in storage, and nothing a row owns or a submission in flight has."""
import os
import time

import pytest
from django.utils import timezone

from jobs import admission, datastores, experiments, lifecycle, reconcile, storage, submission, transfers
from jobs.backends.base import Capacity, LearnerState, LearnerStatus, Node
from jobs.models import Experiment, Job, Learner
from tests.support.builders import (MANIFEST, WAKE_SCHEDULER, job, member, open_follow_ups, record_sends, tar_gz,
                                    upload)

pytestmark = pytest.mark.django_db


class BackendDouble:
    name = "double"

    def __init__(self, states):
        self.states = states  # index -> LearnerStatus

    def status(self, *, tenant, job_id, attempt, learners):
        return [self.states.get(i, LearnerStatus(i, LearnerState.RUNNING)) for i in range(learners)]

    def capacity(self):
        return Capacity(nodes=(Node("n1", 0, 8.0, 64 * 2**30),))


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


def use_backend(monkeypatch, states):
    monkeypatch.setattr(reconcile, "get_backend", lambda: BackendDouble(states))


def running_job(learners=1, **fields):
    target = job(member(), status="PROCESSING", learners=learners, **fields)
    for index in range(learners):
        Learner.objects.create(job=target, attempt=1, index=index, state=Learner.State.RUNNING)
    return target


def test_it_records_an_exit_whose_report_never_arrived(monkeypatch, sent):
    target = running_job()
    use_backend(monkeypatch, {0: LearnerStatus(0, LearnerState.EXITED, 3, "")})
    reconcile.reconcile()
    assert Learner.objects.get(job=target).exit_code == 3
    assert ("finish", 1) in open_follow_ups(target)


def test_it_marks_a_vanished_learner_lost(monkeypatch, sent):
    target = running_job(learners=2)
    use_backend(monkeypatch, {1: LearnerStatus(1, LearnerState.MISSING, reason="agent gone")})
    reconcile.reconcile()
    states = dict(Learner.objects.filter(job=target).values_list("index", "state"))
    assert states == {0: "running", 1: "lost"}
    assert ("finish", 1) not in open_follow_ups(target)  # learner 0 still runs


@pytest.mark.parametrize("over", [False, True], ids=["within-the-longest-grace", "past-it"])
def test_a_halt_its_learners_ignore_ends_even_when_the_jobs_runtime_cannot_be_read(monkeypatch, sent, over):
    """The overdue check read the job's grace from its runtime and raised for one that cannot be read,
    every pass: the learners ignoring the halt kept the job's GPUs for ever. It now allows the longest
    grace a manifest may ask, then deletes them."""
    from datetime import timedelta

    from jobs.models import Status
    from jobs.states import transition
    from trainyard.manifest import MAX_GRACE_SECONDS
    target = running_job(learners=2, runtime={"unreadable": "a rule this platform no longer has"})
    transition(target.id, Status.HALTING, actor="alice")
    elapsed = MAX_GRACE_SECONDS + reconcile.HALT_SLACK_S + (1 if over else -60)
    target.events.filter(to_status=Status.HALTING).update(time=timezone.now() - timedelta(seconds=elapsed))
    deleted = []
    use_backend(monkeypatch, {})
    monkeypatch.setattr(BackendDouble, "delete", lambda self, **where: deleted.append(where["job_id"]), raising=False)
    reconcile.reconcile()
    states = set(Learner.objects.filter(job=target).values_list("state", flat=True))
    if over:
        assert deleted == [target.id] and states == {"lost"}
    else:
        assert deleted == [] and states == {"running"}


def test_it_redrives_finish_when_every_learner_ended_but_the_job_did_not(monkeypatch, sent):
    target = running_job()
    Learner.objects.filter(job=target).update(state=Learner.State.EXITED, exit_code=0)
    use_backend(monkeypatch, {})
    reconcile.reconcile()
    assert ("finish", 1) in open_follow_ups(target)


def test_it_redeploys_an_admitted_job_that_has_no_learners(monkeypatch, sent):
    target = job(member(), status="PENDING")
    use_backend(monkeypatch, {})
    reconcile.reconcile()
    assert ("deploy", 1) in open_follow_ups(target)


def test_it_redeploys_an_admitted_job_whose_deploy_started_only_some_learners(monkeypatch, sent):
    # Learner 0 ran and ended (its agent's posts made its row); learner 1 never got an agent, and no
    # deploy is open to start it (jobs.lifecycle.finish_attempt waits for it).
    target = job(member(), status="DOWNLOADING", learners=2)
    Learner.objects.create(job=target, attempt=1, index=0, state=Learner.State.EXITED, exit_code=0)
    use_backend(monkeypatch, {1: LearnerStatus(1, LearnerState.MISSING, reason="never deployed")})
    reconcile.reconcile()
    assert open_follow_ups(target) == {("deploy", 1)}


def test_it_leaves_running_learners_alone(monkeypatch, sent):
    target = running_job()
    use_backend(monkeypatch, {})
    reconcile.reconcile()
    assert Learner.objects.get(job=target).state == "running"
    assert not open_follow_ups(target)


def test_a_reconcile_during_deploy_does_not_call_learners_lost_before_they_start(monkeypatch, sent):
    # The local backend reports a learner whose agent it has not started yet as MISSING; a
    # reconcile pass that runs while deploy is still starting the agents must not judge them.
    target = job(member(), status="PENDING", learners=2)
    not_started = {i: LearnerStatus(i, LearnerState.MISSING, reason="learner agent is not running") for i in (0, 1)}

    class Deploying(BackendDouble):
        def deploy(self, spec):
            reconcile.reconcile()  # the beat tick that lands mid-deploy
            self.states.clear()  # now the agents run

    monkeypatch.setattr(reconcile, "get_backend", lambda: Deploying(not_started))
    monkeypatch.setattr(lifecycle, "get_backend", lambda: Deploying(not_started))
    lifecycle.deploy(target.id, 1)
    assert list(Learner.objects.filter(job=target).order_by("index").values_list("index", "state")) == [
        (0, "deploying"), (1, "deploying")]


@pytest.mark.parametrize("status, attempt_now, torn_down", [
    ("TERMINATED", 1, True), ("HALTED", 1, True), ("QUEUED", 2, True),  # the attempt is over
    ("HALTING", 1, False), ("STORING", 1, False)])  # deployed: its halt or finish sees to the learners
def test_a_deploy_repeated_after_its_attempt_ended_tears_it_down_again(monkeypatch, sent, status, attempt_now,
                                                                       torn_down):
    """A worker made the learners; meanwhile the job ended and the attempt's teardown ran before they
    existed; the worker was killed before it could see that. Its claim went stale, and the repeat of
    the deploy finds the attempt over: it has it torn down again, or the learners ran on for good."""
    target = job(member(), status=status, attempt=attempt_now)
    monkeypatch.setattr(lifecycle, "get_backend", lambda: pytest.fail("nothing is deployed for an attempt over"))
    lifecycle.deploy(target.id, 1)
    assert (("teardown", 1) in open_follow_ups(target)) == torn_down


# --- cost at scale (bench controlplane measures the same at 1,000 jobs) ---------------------------
def reconcile_queries(monkeypatch, jobs_of_each_kind):
    """The queries of one pass over `jobs_of_each_kind` running, storing and waiting jobs."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from jobs import outbox
    from jobs.models import FollowUp
    tenant = member()
    for _ in range(jobs_of_each_kind):
        running_job(learners=2, tenant=tenant.tenant, owner=tenant.user)
        storing = job(tenant, status="STORING")
        outbox.add(storing.id, 1, FollowUp.Kind.FINISH)  # its finish is under way
        job(tenant, status="QUEUED", gpus=1, wait_reason="stale")  # the queue is the scheduling loop's
    use_backend(monkeypatch, {})
    reconcile.reconcile()  # the first pass writes every row it adds; the one measured sees them settled
    with CaptureQueriesContext(connection) as queries:
        reconcile.reconcile()
    return len(queries)


def test_a_pass_costs_as_many_queries_for_30_jobs_as_for_3(monkeypatch, sent):
    assert reconcile_queries(monkeypatch, 3) == reconcile_queries(monkeypatch, 30)


def test_a_pass_settles_learners_and_adds_missing_steps_in_one_go(monkeypatch, sent):
    ended, lost = running_job(), running_job(learners=2)
    pending = job(member(), status="PENDING")
    states = {0: LearnerStatus(0, LearnerState.EXITED, 0, ""), 1: LearnerStatus(1, LearnerState.MISSING, reason="gone")}
    use_backend(monkeypatch, states)
    reconcile.reconcile()
    assert ("finish", 1) in open_follow_ups(ended)
    assert ("finish", 1) in open_follow_ups(lost)  # both its learners ended in this pass
    assert ("deploy", 1) in open_follow_ups(pending)
    reconcile.reconcile()  # open already: nothing added twice (one open row per step, else IntegrityError)
    assert len(open_follow_ups(ended)) == 1


# --- the pass wakes the scheduling loop and runs no cycle of its own ----------------------------------
def test_a_pass_wakes_the_scheduling_loop_and_admits_nothing_itself(monkeypatch, sent):
    use_backend(monkeypatch, {})
    monkeypatch.setattr(admission, "get_backend", lambda: BackendDouble({}))
    waiting = job(member(), status="QUEUED", gpus=0, cpus=1)  # the double's node has room for it
    reconcile.reconcile()
    waiting.refresh_from_db()
    assert waiting.status == "QUEUED"  # the loop's cycle admits it (jobs.scheduler_loop)
    assert sent == [WAKE_SCHEDULER]


# --- the storage sweep: what killed processes left --------------------------------------------------------
EXPERIMENT = (b"name: sweep\ncpus: 1\nmemory: 1GiB\nframework: {name: custom, command: 'python t.py'}\n"
              b"hyperparameters: {lr: {type: log, minval: 0.001, maxval: 0.1}}\n"
              b"searcher: {name: random, metric: acc, max_trials: 2}\n")


class Killed(BaseException):
    """The process dies here: nothing after it runs, no cleanup of its own either."""


def killed(*args, **kwargs):
    raise Killed()


def code():
    return upload(tar_gz({"t.py": b"print(1)\n"}))


def age(*paths):
    """As a killed process left them, longer ago than the sweep waits for a submission in flight."""
    then = time.time() - reconcile.ORPHAN_GRACE_S - 60
    for path in paths:
        for made in (path, path / storage.STAGED_MARK):
            if made.exists():
                os.utime(made, (then, then))


def names_in(folder):
    return {path.name for path in folder.iterdir()}


def test_the_sweep_removes_what_a_killed_submission_or_creation_left_once_no_row_can_own_it(monkeypatch, sent):
    alice = member()
    submitted = submission.submit(alice, manifest_bytes=MANIFEST, code_file=code())
    created = experiments.create(alice, manifest_bytes=EXPERIMENT, code_file=code())
    with monkeypatch.context() as patched:  # killed between the folder and the row's commit
        patched.setattr(submission, "_hold_queue_place", killed)
        with pytest.raises(Killed):
            submission.submit(alice, manifest_bytes=MANIFEST, code_file=code())
    with monkeypatch.context() as patched:
        patched.setattr(experiments, "_check_unfinished", lambda tenant, lock=False: lock and killed())
        with pytest.raises(Killed):
            experiments.create(alice, manifest_bytes=EXPERIMENT, code_file=code())
    left_upload = submission._save_upload(code())  # killed while its archive was checked
    tenant_folder = storage.root() / "team-a"
    kept = {submitted.id, created.id}
    left = names_in(tenant_folder) - kept
    assert len(left) == 2 and not Job.objects.filter(id__in=left) and not Experiment.objects.filter(id__in=left)
    stranger = storage.root() / "not-a-tenant" / "training-0000000000"  # no tenant of ours: not ours to judge
    stranger.mkdir(parents=True)
    in_flight = storage.create_job_dir("team-a", "training-inflight00")  # its row not committed yet
    age(left_upload, stranger, *(tenant_folder / name for name in kept | left))
    reconcile.sweep_storage()
    assert names_in(tenant_folder) == kept | {in_flight.name}
    assert not left_upload.exists() and stranger.exists()
    assert submission.code_archive(submitted) and list(storage.job_dir("team-a", created.id).glob("code.*"))
    # The tests' transaction never commits, as a process killed right after the commit never unstaged:
    # the sweep finds their rows and unstages them.
    assert not any((tenant_folder / name / storage.STAGED_MARK).exists() for name in kept)


def test_the_sweep_never_removes_a_folder_whose_row_committed_whatever_the_database_says_now(sent):
    """A database restored from before a job was stored knows no row of it: its folder is kept, since
    only a folder staged and never committed can be a leftover."""
    alice = member()
    folder = storage.create_job_dir("team-a", "training-restored0")
    storage.unstage("team-a", "training-restored0")  # as its commit did
    (folder / "results" / "model.bin").write_bytes(b"weights")
    age(folder)
    reconcile.sweep_storage()
    assert (folder / "results" / "model.bin").read_bytes() == b"weights"
    assert alice.tenant.slug == "team-a"


def test_the_sweep_deletes_the_credentials_of_what_ended_when_its_end_was_killed_after_its_commit(sent):
    """An ending deletes the sealed credentials after its commit (jobs.transfers.forget_credentials,
    jobs.experiments.Pass.finish); the tests' transaction never commits, as a process killed there never
    ran them."""
    alice = member()
    ended_job, running = job(alice, status="COMPLETED"), job(alice, status="PROCESSING")
    common = dict(tenant=alice.tenant, owner=alice.user, name="e", spec={}, manifest_yaml="", searcher="random",
                  metric="acc", code_sha256="0" * 64)
    ended_experiment = Experiment.objects.create(**common, finished_at=timezone.now())
    searching = Experiment.objects.create(**common)
    for row in (ended_job, running, ended_experiment, searching):
        folder = storage.create_job_dir("team-a", row.id)
        transfers.seal_credentials(folder, {"store": {"secret_access_key": "s3cr3t"}})
        age(folder)
    reconcile.sweep_storage()
    sealed = {row.id for row in (ended_job, running, ended_experiment, searching)
              if (storage.job_dir("team-a", row.id) / datastores.SEALED_FILE).exists()}
    assert sealed == {running.id, searching.id}


def test_a_submission_whose_commit_fails_leaves_its_folder_to_the_sweep_which_keeps_it_for_its_row(
        monkeypatch, sent):
    """A commit that raises may have happened after all (the connection dropped after COMMIT): the job's
    folder is kept, staged, and the sweep finds the row and unstages it."""
    import contextlib

    from django.db import transaction
    real_atomic = transaction.atomic

    @contextlib.contextmanager
    def commit_lost(*args, **kwargs):
        with real_atomic(*args, **kwargs):
            yield
        raise ConnectionError("server closed the connection unexpectedly")
    alice = member()
    monkeypatch.setattr(submission.transaction, "atomic", commit_lost)
    with pytest.raises(ConnectionError):
        submission.submit(alice, manifest_bytes=MANIFEST, code_file=code())
    monkeypatch.undo()
    stored = Job.objects.get()  # it did commit
    folder = storage.job_dir("team-a", stored.id)
    assert submission.code_archive(stored) and (folder / storage.STAGED_MARK).exists()
    age(folder)
    reconcile.sweep_storage()
    assert submission.code_archive(stored) and not (folder / storage.STAGED_MARK).exists()
