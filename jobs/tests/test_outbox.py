"""The outbox (jobs.outbox): status changes write their follow-up work as rows in the same
transaction, one worker claims a row, failures stay on the row, and the sweep sends again what
nobody works on, final jobs included; teardown is done only when the backend confirms it."""
import queue
import threading
import time
from datetime import timedelta

import pytest
from django.db import OperationalError, connection
from django.db.models import QuerySet
from django.utils import timezone

from jobs import lifecycle, outbox, storage, tasks
from jobs.backends.base import BackendError, LearnerState, LearnerStatus
from jobs.models import FollowUp, Job, Learner, Status
from jobs.states import transition
from tests.support.builders import MANIFEST, job, member, open_follow_ups, record_sends

pytestmark = pytest.mark.django_db
Kind = FollowUp.Kind


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


def test_each_change_writes_the_work_it_requires_with_it(sent):
    target = job(member())
    transition(target.id, Status.PENDING, actor="t")
    assert open_follow_ups(target) == {("deploy", 1)}
    transition(target.id, Status.HALTING, actor="t")
    assert open_follow_ups(target) == {("deploy", 1), ("halt", 1)}
    transition(target.id, Status.TERMINATED, actor="t")
    assert open_follow_ups(target) == {("deploy", 1), ("halt", 1), ("teardown", 1)}
    rows = FollowUp.objects.filter(job=target).values_list("pk", flat=True)
    assert sorted(args[0] for name, args in sent if name == "follow_up") == sorted(rows)  # each woken once


def test_a_retry_tears_down_the_attempt_that_failed_and_a_queued_job_needs_none(sent):
    retried = job(member(), status="PROCESSING")
    transition(retried.id, Status.QUEUED, actor="t", attempt_next=True)
    assert open_follow_ups(retried) == {("teardown", 1)}
    never_ran = job(member())
    transition(never_ran.id, Status.TERMINATED, actor="t")
    assert open_follow_ups(never_ran) == set()


def test_a_change_allowed_from_where_the_job_moved_meanwhile_still_happens(sent):
    """The job moves on between the read and the compare-and-swap (its learner reports PROCESSING
    while a researcher terminates it): the swap reads again rather than answering that a PROCESSING
    job cannot be terminated. Seen as a 409 on terminate in the fair-share suite under load."""
    target = job(member(), status="DOWNLOADING")
    moved = []

    def learner_reports_first(execute, sql, params, many, context):
        if not moved and sql.lstrip().upper().startswith("UPDATE") and "TERMINATED" in (params or ()):
            moved.append(Job.objects.filter(pk=target.id).update(status=Status.PROCESSING))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(learner_reports_first):
        done = transition(target.id, Status.TERMINATED, actor="bea")
    assert moved == [1] and done is not None and done.status == Status.TERMINATED
    assert list(target.events.values_list("from_status", "to_status")) == [("PROCESSING", "TERMINATED")]


def test_a_change_of_another_attempt_or_from_a_status_it_left_is_refused(sent):
    target = job(member(), status="PROCESSING")
    assert transition(target.id, Status.HALTING, actor="t", attempt=target.attempt + 1) is None
    assert transition(target.id, Status.QUEUED, actor="t", only_from={Status.HALTED}) is None
    assert Job.objects.get(pk=target.id).status == Status.PROCESSING and not target.events.exists()


@pytest.mark.parametrize("target_status, first", [("PENDING", "follow_up"), ("COMPLETED", "publish"),
                                                  ("HALTED", "publish")])
def test_an_admission_wakes_its_worker_first_and_an_end_is_heard_of_first(monkeypatch, django_capture_on_commit_callbacks,
                                                                         target_status, first):
    """The order the messages of a change leave in once it commits: the deploy of an admission
    before its publication (the learner starts sooner), an end's publication before its teardown
    (a waiting script returns sooner)."""
    order = []
    monkeypatch.setattr("jobs.dispatch.send", lambda task, *args, **kwargs: order.append(task))
    monkeypatch.setattr("jobs.live._send", lambda groups, *messages: order.append("publish"))
    before = {"PENDING": "QUEUED", "COMPLETED": "STORING", "HALTED": "HALTING"}[target_status]
    target = job(member(), status=before)
    with django_capture_on_commit_callbacks(execute=True):
        assert transition(target.id, target_status, actor="t") is not None
    assert order[0] == first and {"follow_up", "publish"} <= set(order)


def test_a_change_that_loses_its_compare_and_swap_writes_nothing(sent):
    target = job(member(), status="COMPLETED")
    assert transition(target.id, Status.TERMINATED, actor="t") is None
    assert open_follow_ups(target) == set()


def test_the_same_work_is_open_once(sent):
    target = job(member())
    assert outbox.add(target.id, 1, Kind.FINISH) is not None
    assert outbox.add(target.id, 1, Kind.FINISH) is None
    assert FollowUp.objects.filter(job=target).count() == 1


def test_one_worker_claims_a_row_and_a_stale_claim_passes_on(sent):
    row = outbox.add(job(member()).id, 1, Kind.TEARDOWN)
    assert outbox.claim(row.pk, "w1") is not None
    assert outbox.claim(row.pk, "w2") is None  # w1 holds it
    FollowUp.objects.filter(pk=row.pk).update(claimed_at=timezone.now() - timedelta(seconds=outbox.CLAIM_TTL_S + 1))
    assert outbox.claim(row.pk, "w2").claimed_by == "w2"  # w1 died: its claim went stale
    FollowUp.objects.filter(pk=row.pk).update(done_at=timezone.now(), claimed_at=None)
    assert outbox.claim(row.pk, "w3") is None  # done is done


def test_done_work_is_marked_done_and_a_failure_stays_on_the_row(sent):
    target = job(member())
    done = outbox.add(target.id, 1, Kind.HALT)
    calls = []
    assert outbox.run(done.pk, {Kind.HALT: lambda job_id, attempt: calls.append((job_id, attempt))})
    assert calls == [(target.id, 1)] and FollowUp.objects.get(pk=done.pk).done_at is not None

    failing = outbox.add(target.id, 1, Kind.TEARDOWN)

    def broken(job_id, attempt):
        raise RuntimeError("the API server said 503")

    sent.clear()
    assert outbox.run(failing.pk, {Kind.TEARDOWN: broken}) is None
    row = FollowUp.objects.get(pk=failing.pk)
    assert (row.done_at, row.claimed_at, row.tries) == (None, None, 1)
    assert row.last_error == "RuntimeError: the API server said 503"
    assert row.due_at > timezone.now()  # backoff
    assert sent == [("follow_up", (failing.pk,))]  # tried again after the backoff


def test_work_that_must_wait_its_turn_is_sent_again_later_and_counts_no_failed_try(sent):
    row = outbox.add(job(member()).id, 1, Kind.DEPLOY)

    def waits(job_id, attempt):
        raise outbox.NotYet("the tenant's other download is under way", after_s=30)

    sent.clear()
    assert outbox.run(row.pk, {Kind.DEPLOY: waits}) is None
    row.refresh_from_db()
    assert (row.done_at, row.claimed_at, row.tries, row.last_error) == (None, None, 0, "")
    assert row.due_at > timezone.now() + timedelta(seconds=25)
    assert sent == [("follow_up", (row.pk,))]


def claimed_elsewhere(row):
    """The row as a live worker holds it."""
    FollowUp.objects.filter(pk=row.pk).update(claimed_at=timezone.now(), claimed_by="another worker")
    return row


@pytest.mark.parametrize("theirs_running, steps_aside", [(0, True), (outbox.SHARE_PER_TENANT, False)])
def test_a_tenant_past_its_share_steps_aside_for_a_tenant_running_fewer(sent, theirs_running, steps_aside):
    """Tenant A has its share of follow-ups running and a third comes up while B's deploy waits for a
    worker: A's row waits its turn (no failed try) unless B runs as many as A already."""
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    for _ in range(outbox.SHARE_PER_TENANT):
        claimed_elsewhere(outbox.add(job(alice).id, 1, Kind.TEARDOWN))
    for _ in range(theirs_running):
        claimed_elsewhere(outbox.add(job(bob).id, 1, Kind.TEARDOWN))
    outbox.add(job(bob).id, 1, Kind.DEPLOY)  # waits for a worker
    third = outbox.add(job(alice).id, 1, Kind.TEARDOWN)
    calls = []
    done = outbox.run(third.pk, {Kind.TEARDOWN: lambda job_id, attempt: calls.append(job_id)})
    third.refresh_from_db()
    assert (done is None, calls == [], third.done_at is None) == (steps_aside,) * 3
    if steps_aside:
        assert (third.tries, third.claimed_at, third.last_error) == (0, None, "")
        assert third.due_at > timezone.now()


def test_with_no_one_else_waiting_a_tenant_gets_every_worker(sent):
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    for _ in range(outbox.SHARE_PER_TENANT + 3):
        claimed_elsewhere(outbox.add(job(alice).id, 1, Kind.TEARDOWN))
    FollowUp.objects.filter(pk=outbox.add(job(bob).id, 1, Kind.DEPLOY).pk).update(  # in its backoff: not waiting
        tries=1, due_at=timezone.now() + timedelta(seconds=30))
    row = outbox.add(job(alice).id, 1, Kind.TEARDOWN)
    assert outbox.run(row.pk, {Kind.TEARDOWN: lambda job_id, attempt: None}) is not None


@pytest.mark.django_db(transaction=True)
def test_a_tenant_filling_the_queue_does_not_hold_another_tenants_work_behind_its_own(monkeypatch):
    """Three workers take messages first in first out, as Celery's do. Tenant A's sixteen teardowns
    (a quarter of a second each) are queued ahead of B's one deploy: without turns B's came last but
    one or two; with them it is among the first few done, and every row of A's is done too."""
    messages = queue.Queue()

    def send(task, *args, countdown=None):
        threading.Timer(countdown or 0, messages.put, args).start()

    monkeypatch.setattr("jobs.dispatch.send", send)
    monkeypatch.setattr(outbox, "TURN_WAIT_S", 0.05)
    monkeypatch.setattr(outbox, "TURN_WAIT_PER_ROW_S", 0.0)
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    teardowns = [outbox.add(job(alice).id, 1, Kind.TEARDOWN) for _ in range(16)]
    deploy = outbox.add(job(bob).id, 1, Kind.DEPLOY)
    finished, lock = [], threading.Lock()

    def work(job_id, attempt):
        time.sleep(0.25)
        with lock:
            finished.append(job_id)

    handlers = {Kind.TEARDOWN: work, Kind.DEPLOY: work}

    def worker():
        try:
            while len(finished) < 17:
                try:
                    outbox.run(messages.get(timeout=0.5), handlers)
                except queue.Empty:
                    pass
        finally:
            connection.close()

    workers = [threading.Thread(target=worker) for _ in range(3)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=60)
    assert sorted(finished) == sorted([row.job_id for row in teardowns] + [deploy.job_id])
    assert finished.index(deploy.job_id) < 4, finished


@pytest.fixture
def backlog(monkeypatch):
    """The number of messages the sweep finds waiting in the workers' queue (0 unless a test sets it;
    another queue's under its name)."""
    waiting = {"messages": 0}
    monkeypatch.setattr("jobs.dispatch.backlog",
                        lambda queue=None: waiting["messages"] if queue is None else waiting.get(queue, 0))
    return waiting


def test_the_sweep_sends_again_what_nobody_works_on_final_jobs_included(sent, backlog):
    finished = job(member(), status="TERMINATED")
    lost = outbox.add(finished.id, 1, Kind.TEARDOWN)  # its message was lost
    dead = outbox.add(job(member()).id, 1, Kind.FINISH)
    fresh = outbox.add(job(member()).id, 1, Kind.DEPLOY)
    busy = outbox.add(job(member()).id, 1, Kind.HALT)
    old = timezone.now() - timedelta(seconds=outbox.CLAIM_TTL_S + 5)
    FollowUp.objects.filter(pk__in=[lost.pk, dead.pk, busy.pk]).update(created=old)
    FollowUp.objects.filter(pk=dead.pk).update(claimed_at=old, claimed_by="a worker that was killed")
    FollowUp.objects.filter(pk=busy.pk).update(claimed_at=timezone.now(), claimed_by="a live worker")
    assert sorted(outbox.sweep()) == sorted([lost.pk, dead.pk])



def test_a_row_whose_worker_died_is_sent_again_once_its_claim_is_stale_however_long_it_had_waited(sent, backlog):
    """A row the sweep had sent again waits as long again as its age (a deploy downloading data for an
    hour: an hour); the worker that claimed it then died, and the row waited that hour more."""
    waited = outbox.add(job(member()).id, 1, Kind.DEPLOY)
    FollowUp.objects.filter(pk=waited.pk).update(created=timezone.now() - timedelta(hours=1))
    assert outbox.sweep() == [waited.pk]  # its message was lost: sent again, and due an hour on
    assert outbox.claim(waited.pk, "a worker that is then killed") is not None
    later = timezone.now() + timedelta(seconds=outbox.CLAIM_TTL_S + 5)
    assert outbox.sweep(now=later) == [waited.pk]


def aged(row, seconds):
    FollowUp.objects.filter(pk=row.pk).update(created=timezone.now() - timedelta(seconds=seconds))
    return row


def test_a_row_sent_again_is_not_sent_again_by_the_next_passes_until_it_is_as_old_again(sent, backlog):
    lost = aged(outbox.add(job(member()).id, 1, Kind.DEPLOY), 5)
    assert outbox.sweep() == [lost.pk]
    assert outbox.sweep() == []  # the next pass: not again
    later = timezone.now() + timedelta(seconds=outbox.RESEND_MIN_S + 1)
    assert outbox.sweep(now=later) == [lost.pk]  # its message was lost again: sent again
    lost.refresh_from_db()
    # ... and after that only once it is twice as old (its age then was RESEND_MIN_S + 6 s)
    assert lost.due_at - later >= timedelta(seconds=outbox.RESEND_MIN_S + 5)
    assert outbox.sweep(now=later + timedelta(seconds=outbox.RESEND_MIN_S + 1)) == []


def test_while_messages_wait_for_the_workers_a_row_that_is_not_claimed_yet_is_left_to_its_own(sent, backlog):
    backlog["messages"] = 300  # a burst of deploys ahead of it
    queued = aged(outbox.add(job(member()).id, 1, Kind.DEPLOY), 30)
    dead = aged(outbox.add(job(member()).id, 1, Kind.FINISH), 30)
    stale = timezone.now() - timedelta(seconds=outbox.CLAIM_TTL_S + 5)
    FollowUp.objects.filter(pk=dead.pk).update(claimed_at=stale, claimed_by="a worker that was killed")
    assert outbox.sweep() == [dead.pk]  # a dead worker's claim is not waiting in the queue
    aged(queued, outbox.BACKLOG_TRUST_S + 1)
    assert outbox.sweep() == [queued.pk]  # waited too long to be only behind the others
    backlog["messages"] = None  # the broker cannot say: sent as before
    assert sorted(outbox.sweep(now=timezone.now() + timedelta(days=1))) == sorted([queued.pk, dead.pk])


class Backend:
    def __init__(self, running_after_delete):
        self.running_after_delete, self.deleted = running_after_delete, 0

    def delete(self, **where):
        self.deleted += 1

    def status(self, *, tenant, job_id, attempt, learners):
        state = LearnerState.RUNNING if self.deleted <= self.running_after_delete else LearnerState.MISSING
        return [LearnerStatus(i, state) for i in range(learners)]


def test_a_teardown_is_done_only_when_the_backend_confirms_nothing_runs(sent, monkeypatch):
    backend = Backend(running_after_delete=1)
    monkeypatch.setattr(lifecycle, "get_backend", lambda: backend)
    target = job(member(), status="PROCESSING")
    transition(target.id, Status.TERMINATED, actor="t")
    row = FollowUp.objects.get(job=target, kind=Kind.TEARDOWN)
    assert outbox.run(row.pk, tasks.HANDLERS) is None
    row.refresh_from_db()
    assert row.done_at is None and "still run after delete" in row.last_error
    assert outbox.run(row.pk, tasks.HANDLERS) is not None  # the second delete left nothing
    assert backend.deleted == 2


@pytest.mark.django_db(transaction=True)
def test_a_worker_keeps_its_claim_while_it_works(monkeypatch, sent):
    monkeypatch.setattr(outbox, "CLAIM_TTL_S", 0.6)
    row = outbox.add(job(member()).id, 1, Kind.FINISH)
    others = []

    def long_finish(job_id, attempt):
        time.sleep(1.5)  # well past the TTL
        others.append(outbox.claim(row.pk, "another worker"))

    thread = threading.Thread(target=lambda: outbox.run(row.pk, {Kind.FINISH: long_finish}))
    thread.start()
    thread.join()
    assert others == [None]
    assert FollowUp.objects.get(pk=row.pk).done_at is not None


def test_the_last_learner_to_end_makes_finishing_due(sent):
    target = job(member(), status="PROCESSING", learners=2)
    first, second = (Learner.objects.create(job=target, attempt=1, index=i, state="running") for i in (0, 1))
    lifecycle.learner_exited(target, first, exit_code=0, reason="", when=timezone.now())
    assert open_follow_ups(target) == set()
    lifecycle.learner_exited(target, second, exit_code=0, reason="", when=timezone.now())
    assert open_follow_ups(target) == {("finish", 1)}


RESULTS_TO_AN_UNREACHABLE_STORE = """
name: results-out
framework: {name: custom, command: sh run.sh}
restart_policy: {max_retries: 1}
data_stores:
  - id: bucket
    type: s3_datastore
    training_results: {container: results}
    connection: {type: s3_datastore, auth_url: "http://127.0.0.1:9"}
"""


def test_a_failed_attempt_whose_results_cannot_be_pushed_keeps_its_retries(sent, settings):
    # The push fails (a private address, refused by the egress policy); before, that failed the job
    # and the restart that should have followed lost its compare-and-swap without a word.
    target = job(member(), status="PROCESSING", manifest_yaml=RESULTS_TO_AN_UNREACHABLE_STORE)
    storage.create_job_dir(target.tenant.slug, target.id)
    Learner.objects.create(job=target, attempt=1, index=0, state="exited", exit_code=1, finished_at=timezone.now())
    lifecycle.finish_attempt(target.id, 1)
    target.refresh_from_db()
    assert (target.status, target.attempt, target.retries) == (Status.QUEUED, 2, 1), target.status_reason
    assert target.status_reason.startswith("restart 1 of 1")


def test_a_job_completes_when_its_stored_manifest_no_longer_parses(sent):
    # Later steps read the runtime fields written at submission, never the stored manifest.
    target = job(member(), status="PROCESSING")
    storage.create_job_dir(target.tenant.slug, target.id)
    Job.objects.filter(pk=target.id).update(manifest_yaml="framework: [this no longer parses")
    Learner.objects.create(job=target, attempt=1, index=0, state="exited", exit_code=0, finished_at=timezone.now())
    lifecycle.finish_attempt(target.id, 1)
    assert Job.objects.get(pk=target.id).status == Status.COMPLETED


def test_a_claim_reads_its_row_alone(sent):
    """Two statements, neither touching the job's row: the work reads what it needs of the job, and
    decoding the whole row in the claim's join cost a millisecond of every follow-up."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    target = job(member())
    row = FollowUp.objects.create(job_id=target.id, attempt=1, kind=FollowUp.Kind.FINISH)
    with CaptureQueriesContext(connection) as queries:
        claimed = outbox.claim(row.pk, "worker-1")
    assert claimed.pk == row.pk and claimed.claimed_by == "worker-1"
    assert len(queries) == 2 and not any("jobs_job" in query["sql"] for query in queries)


class Died(BaseException):
    """A worker killed where it stood (not an error its code would catch)."""


def test_a_preempted_job_is_queued_again_even_when_its_worker_dies_while_halting_it(sent, monkeypatch):
    # Halted and queued again commit together: a worker that dies between the two leaves the job
    # storing, and the finish sent again halts and queues it. Before, it stayed HALTED for good.
    target = job(member(), status="PROCESSING")
    storage.create_job_dir(target.tenant.slug, target.id)
    transition(target.id, Status.HALTING, actor="scheduler", attempt=1, preempted_reason="for a high-priority job")
    Learner.objects.create(job=target, attempt=1, index=0, state="exited", exit_code=0, finished_at=timezone.now())

    def dies(halted):
        raise Died()

    with monkeypatch.context() as patched, pytest.raises(Died):
        patched.setattr(lifecycle, "_requeue_preempted", dies)
        lifecycle.finish_attempt(target.id, 1)
    assert Job.objects.get(pk=target.id).status == Status.STORING
    lifecycle.finish_attempt(target.id, 1)
    target.refresh_from_db()
    assert (target.status, target.attempt, target.preempted_reason) == (Status.QUEUED, 2, "")


def test_a_resume_by_hand_ends_a_preemption_left_on_a_halted_job(sent):
    # A job left HALTED with its preemption set (by the crash above, before it was fixed) would count
    # as stopping in every cycle after its resume, and the autoscaler would pass it by.
    target = job(member(), status="HALTED", preempted_reason="for a high-priority job")
    resumed = lifecycle.resume(target, actor="alice")
    assert (resumed.status, resumed.attempt, resumed.preempted_reason) == (Status.QUEUED, 2, "")


class DiesMidDeploy:
    """A backend whose worker is killed after starting the first learner of a deploy, until told not to."""

    def __init__(self):
        self.dies, self.started = True, []

    def deploy(self, spec):
        for learner in spec.learners:
            self.started.append(learner.index)
            if self.dies:
                raise Died()


def test_a_learner_that_ends_before_a_killed_deploy_started_the_others_does_not_finish_the_job(sent, monkeypatch):
    # A worker killed between the learners of a deploy leaves the deploy's row open and the other
    # learners without agents or rows. The one it started may end before the deploy sent again starts
    # the rest: its end made finishing due, and the job COMPLETED with one learner of two ever run.
    backend = DiesMidDeploy()
    monkeypatch.setattr(lifecycle, "get_backend", lambda: backend)
    target = job(member(), learners=2)
    storage.create_job_dir(target.tenant.slug, target.id)
    transition(target.id, Status.PENDING, actor="scheduler")
    deploy = FollowUp.objects.get(job=target, kind=Kind.DEPLOY)
    with pytest.raises(Died):
        outbox.run(deploy.pk, tasks.HANDLERS)
    assert backend.started == [0]

    # Learner 0's agent posts: ingest makes the row deploy had not written yet, then hears it exit.
    first = Learner.objects.create(job=target, attempt=1, index=0, state="running")
    lifecycle.learner_exited(target, first, exit_code=0, reason="", when=timezone.now())
    for row in FollowUp.objects.filter(job=target, kind=Kind.FINISH, done_at=None):
        outbox.run(row.pk, tasks.HANDLERS)
    assert Job.objects.get(pk=target.id).status == Status.PENDING

    # The deploy, sent again once its claim went stale, starts the other; its end finishes the job.
    backend.dies = False
    FollowUp.objects.filter(pk=deploy.pk).update(claimed_at=timezone.now() - timedelta(seconds=outbox.CLAIM_TTL_S + 1))
    assert outbox.run(deploy.pk, tasks.HANDLERS) is not None
    second = Learner.objects.get(job=target, attempt=1, index=1)
    lifecycle.learner_exited(target, second, exit_code=0, reason="", when=timezone.now())
    for row in FollowUp.objects.filter(job=target, kind=Kind.FINISH, done_at=None):
        outbox.run(row.pk, tasks.HANDLERS)
    assert Job.objects.get(pk=target.id).status == Status.COMPLETED


class DeployAlwaysRefused:
    """A backend whose API server answers every deploy with a 503: an error that may pass, retried."""

    def __init__(self):
        self.tries = 0

    def deploy(self, spec):
        self.tries += 1
        raise BackendError("the API server answered 503 (ServiceUnavailable)")


@pytest.mark.parametrize("restarts, then", [(0, Status.FAILED), (1, Status.QUEUED)])
def test_a_deploy_that_keeps_failing_ends_its_attempt_instead_of_holding_its_gpus_for_ever(sent, monkeypatch, settings,
                                                                                          restarts, then):
    """Its row was retried about once a minute for ever, the job PENDING on its GPUs all along. After
    DEPLOY_TRIES tries in a row the attempt ends like a failed one: queued again while the job has
    restarts left, failed otherwise, and its teardown deletes whatever the backend made of it."""
    settings.DEPLOY_TRIES = 3
    backend = DeployAlwaysRefused()
    monkeypatch.setattr(lifecycle, "get_backend", lambda: backend)
    manifest = MANIFEST.decode() + f"restart_policy: {{max_retries: {restarts}}}\n"
    target = job(member(), manifest_yaml=manifest)
    storage.create_job_dir(target.tenant.slug, target.id)
    transition(target.id, Status.PENDING, actor="scheduler", placement=[{"node": "local", "gpu_ids": [0]}])
    deploy = FollowUp.objects.get(job=target, kind=Kind.DEPLOY)
    for _ in range(2):
        assert outbox.run(deploy.pk, tasks.HANDLERS) is None  # kept for another try
    deploy.refresh_from_db()
    assert deploy.last_error == "BackendError: the API server answered 503 (ServiceUnavailable)"
    assert Job.objects.get(pk=target.id).status == Status.PENDING
    assert outbox.run(deploy.pk, tasks.HANDLERS) is not None  # the third: given up, the row done
    target.refresh_from_db()
    assert backend.tries == 3 and target.status == then
    assert ("deploy failed 3 times in a row, the last time: BackendError: the API server answered 503 "
            "(ServiceUnavailable)") in target.status_reason
    assert target.attempt == 1 + restarts and ("teardown", 1) in open_follow_ups(target)


@pytest.mark.django_db(transaction=True)
def test_a_worker_keeps_its_claim_after_one_renewal_fails(monkeypatch, sent):
    # A renewal that fails (the connection dropped under it) stopped every renewal after it: a
    # minute later another worker took the row and ran the same finish beside the first.
    monkeypatch.setattr(outbox, "CLAIM_TTL_S", 0.6)
    row = outbox.add(job(member()).id, 1, Kind.FINISH)
    update, failed = QuerySet.update, []

    def drops_once(rows, **changes):
        if rows.model is FollowUp and set(changes) == {"claimed_at"} and not failed:
            failed.append(changes)
            raise OperationalError("server closed the connection unexpectedly")
        return update(rows, **changes)

    monkeypatch.setattr(QuerySet, "update", drops_once)
    others = []

    def long_finish(job_id, attempt):
        time.sleep(1.5)  # well past the TTL
        others.append(outbox.claim(row.pk, "another worker"))

    def worker():
        try:
            outbox.run(row.pk, {Kind.FINISH: long_finish})
        finally:
            connection.close()  # this thread's own

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert failed and others == [None]
    assert FollowUp.objects.get(pk=row.pk).done_at is not None
