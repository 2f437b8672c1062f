"""Crash points of the lifecycle: a process killed at any statement of a step, or a step run twice, and
then the platform's own recovery (stale claims sent again by the sweep, the reconcile pass, the
scheduling loop's next cycle) must still bring the job to its right end, with no learner left running,
no follow-up left open, no usage record left open or written twice, and no allocation row left open.

The learners are driven through the real ingest endpoint by a backend double whose agents post as the
local backend's do; "killed" is an exception no code of the platform catches, raised before the N-th
SQL statement of the step under test, so whatever that step committed before stays and the rest is lost."""
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import admission, lifecycle, outbox, reconcile, storage, tasks
from jobs.backends.base import Capacity, LearnerState, LearnerStatus, Node
from jobs.models import ACTIVE, Allocation, FollowUp, Job, JobEvent, Status
from tenants.models import UsageRecord
from tests.support.builders import ELASTIC_MANIFEST, job, member, post, record_sends

pytestmark = pytest.mark.django_db
Kind = FollowUp.Kind
RETRYING = """
name: retried
cpus: 1
memory: 1GiB
framework: {name: custom, command: sh run.sh}
restart_policy: {max_retries: 1}
"""


class Died(BaseException):
    """The process killed where it stood: nothing of the platform catches it."""


class Agent:
    def __init__(self, token):
        self.token, self.seq, self.state, self.halted = token, 0, "started", False


class Cluster:
    """A backend double: deploy starts an agent per learner (a repeat finds them started), halt asks them
    to stop, delete kills them; `act` has each live agent post what it would next."""
    name = "double"

    def __init__(self, exit_codes):
        self.agents = {}  # (job id, attempt, index) -> Agent
        self.exit_codes = exit_codes  # attempt -> the exit code its learners end with

    def capacity(self):
        return Capacity(nodes=(Node("local", 4, 16.0, 64 * 2**30),))

    def deploy(self, spec):
        for learner in spec.learners:
            self.agents.setdefault((spec.job_id, spec.attempt, learner.index), Agent(learner.ingest_token))

    def _of(self, job_id, attempt):
        return {key[2]: agent for key, agent in self.agents.items() if key[:2] == (job_id, attempt)}

    def halt(self, *, tenant, job_id, attempt, learners):
        for agent in self._of(job_id, attempt).values():
            agent.halted = True

    def delete(self, *, tenant, job_id, attempt, learners):
        for agent in self._of(job_id, attempt).values():
            if agent.state != "exited":
                agent.state = "killed"

    def status(self, *, tenant, job_id, attempt, learners):
        found, states = self._of(job_id, attempt), []
        for index in range(learners):
            agent = found.get(index)
            if agent is None or agent.state == "killed":
                states.append(LearnerStatus(index, LearnerState.MISSING, reason="no agent"))
            elif agent.state == "exited":
                states.append(LearnerStatus(index, LearnerState.EXITED, self.exit_codes.get(attempt, 0)))
            else:
                states.append(LearnerStatus(index, LearnerState.RUNNING))
        return states

    def running(self):
        return [key for key, agent in self.agents.items() if agent.state not in ("exited", "killed")]

    def act(self, job_id):
        for (_, attempt, index), agent in sorted(self.agents.items()):
            if agent.state in ("exited", "killed"):
                continue
            if agent.state == "started":
                records, agent.state = [("preparing", {}), ("running", {})], "running"
            else:
                records, agent.state = [("exited", {"exit_code": 0 if agent.halted else self.exit_codes.get(attempt, 0),
                                                    "reason": ""})], "exited"
            batch = []
            for state, extra in records:
                agent.seq += 1
                batch.append({"seq": agent.seq, "kind": "status", "state": state, "time": timezone.now().timestamp(),
                              **extra})
            answer = post(Job.objects.get(pk=job_id), batch, attempt=attempt, learner=index, token=agent.token)
            if answer.status_code == 410:
                agent.state = "killed"  # the attempt is over: the agent stops its learner and exits
            else:
                assert answer.status_code == 200, answer.content


class KillAt:
    """Kill the process before the `at`-th SQL statement of the first call of `owner.name`; with `at`
    None, just after that call returns (its row not marked done: the whole step runs again)."""

    def __init__(self, monkeypatch, owner, name, at):
        self.at, self.seen, self.fired = at, 0, False
        original = getattr(owner, name)

        def killed_once(*args, **kwargs):
            if self.fired:
                return original(*args, **kwargs)
            with connection.execute_wrapper(self._statement):
                result = original(*args, **kwargs)
            if self.at is None:
                self.fired = True
                raise Died("killed after the step, before its row was marked done")
            return result

        monkeypatch.setattr(owner, name, killed_once)
        if name in {"deploy", "halt_learners", "finish_attempt", "teardown"} and owner is lifecycle:
            monkeypatch.setitem(tasks.HANDLERS, Kind(name.replace("halt_learners", "halt").replace(
                "finish_attempt", "finish")), killed_once)

    def _statement(self, execute, sql, params, many, context):
        self.seen += 1
        if not self.fired and self.seen == self.at:
            self.fired = True
            raise Died(f"killed before statement {self.at}: {sql[:80]}")
        return execute(sql, params, many, context)


def recover_and_run(cluster, job_id, rounds=10):
    """What runs on its own: agents post, workers take every open row (a dead worker's claim gone
    stale), the scheduling loop's cycle, the reconcile pass; a process killed is a new one the next round."""
    for _ in range(rounds):
        cluster.act(job_id)
        rows = FollowUp.objects.filter(job_id=job_id, done_at=None)
        rows.exclude(claimed_at=None).update(claimed_at=timezone.now() - timedelta(seconds=outbox.CLAIM_TTL_S + 1))
        rows.update(due_at=timezone.now())
        for row_id in rows.order_by("pk").values_list("pk", flat=True):
            try:
                outbox.run(row_id, tasks.HANDLERS)
            except Died:
                pass
        for step in (admission.run_cycle, reconcile.reconcile):
            try:
                step()
            except Died:
                pass


def until_running(cluster, job_id):
    for _ in range(6):
        if Job.objects.get(pk=job_id).status == Status.PROCESSING:
            return
        recover_and_run(cluster, job_id, rounds=1)
    raise AssertionError(f"never ran: {Job.objects.get(pk=job_id).status}")


def assert_settled(cluster, job_id, status):
    row = Job.objects.get(pk=job_id)
    assert row.status == status, (row.status, row.status_reason)
    assert cluster.running() == []
    assert not FollowUp.objects.filter(job_id=job_id, done_at=None).exists(), list(
        FollowUp.objects.filter(job_id=job_id, done_at=None).values_list("kind", "attempt", "last_error"))
    admitted = set(JobEvent.objects.filter(job_id=job_id, to_status=Status.PENDING).values_list("attempt", flat=True))
    records = list(UsageRecord.objects.filter(job_id=job_id).values_list("attempt", "ended_at"))
    assert sorted(attempt for attempt, _ in records) == sorted(admitted)  # one record per attempt that held
    if status not in ACTIVE:
        assert all(ended is not None for _, ended in records)
        assert not Allocation.objects.filter(job_id=job_id, ended_at=None).exists()


@pytest.fixture
def world(monkeypatch):
    record_sends(monkeypatch)

    made = []

    def make(exit_codes=None, **fields):
        cluster = Cluster(exit_codes or {})
        for module in (lifecycle, reconcile, admission):
            monkeypatch.setattr(module, "get_backend", lambda: cluster)
        target = job(member(), **fields)
        storage.create_job_dir(target.tenant.slug, target.id)
        made.append(target.id)
        return cluster, target

    def forget():
        """Each run's job out of the next runs' way (they share the database: their work commits)."""
        Job.objects.filter(pk__in=made).update(status=Status.COMPLETED)
        FollowUp.objects.filter(job_id__in=made).update(done_at=timezone.now())

    make.forget = forget
    return make


# --- scenarios -----------------------------------------------------------------------------------
def completes(world):
    cluster, target = world()
    recover_and_run(cluster, target.id)
    assert_settled(cluster, target.id, Status.COMPLETED)


def retries_then_completes(world):
    cluster, target = world({1: 1, 2: 0}, manifest_yaml=RETRYING)
    recover_and_run(cluster, target.id)
    assert_settled(cluster, target.id, Status.COMPLETED)
    assert Job.objects.get(pk=target.id).attempt == 2


def halted(world):
    cluster, target = world()
    until_running(cluster, target.id)
    lifecycle.halt(Job.objects.get(pk=target.id), actor="alice")
    recover_and_run(cluster, target.id)
    assert_settled(cluster, target.id, Status.HALTED)


def terminated(world):
    cluster, target = world()
    until_running(cluster, target.id)
    lifecycle.terminate(Job.objects.get(pk=target.id), actor="alice")
    recover_and_run(cluster, target.id)
    assert_settled(cluster, target.id, Status.TERMINATED)


def resized(world):
    cluster, target = world(manifest_yaml=ELASTIC_MANIFEST, learners=2, gpus=1)
    until_running(cluster, target.id)
    row = Job.objects.get(pk=target.id)
    assert row.status == Status.PROCESSING
    assert lifecycle.resize(row, learners=1, placement=row.placement[:1], why="test", actor="autoscaler")
    # Not run to its end: the job would grow again onto the idle GPU. It must be at its new size.
    for _ in range(4):
        recover_and_run(cluster, target.id, rounds=1)
        if Job.objects.get(pk=target.id).status == Status.PROCESSING:
            break
    row = Job.objects.get(pk=target.id)
    assert (row.status, row.attempt, row.learners) == (Status.PROCESSING, 2, 1), row.status_reason
    assert [key for key in cluster.running() if key[1] == 1] == []
    assert UsageRecord.objects.filter(job=row, ended_at=None).count() == 1


SCENARIOS = {"completes": completes, "retries": retries_then_completes, "halted": halted,
             "terminated": terminated, "resized": resized}
# Each scenario with the step of it that commits most on the way (a kill between its commits is what
# recovery must finish): the deploy, the finish of a retry, a halt's and a resize's store, a teardown.
KILLED = [("completes", lifecycle, "deploy"), ("retries", lifecycle, "finish_attempt"),
          ("halted", lifecycle, "finish_attempt"), ("resized", lifecycle, "finish_attempt"),
          ("terminated", lifecycle, "teardown"), ("completes", admission, "run_cycle")]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_scenario_ends_right_without_a_kill(world, scenario):
    SCENARIOS[scenario](world)


@pytest.mark.django_db(transaction=True)  # a kill loses what its transaction had not committed, no more
@pytest.mark.parametrize("scenario, owner, name", KILLED, ids=[f"{s}-{n}" for s, _, n in KILLED])
def test_a_step_killed_at_any_statement_still_ends_right(monkeypatch, world, scenario, owner, name):
    run = SCENARIOS[scenario]
    with monkeypatch.context() as counting:
        counter = KillAt(counting, owner, name, at=10**9)
        run(world)
        world.forget()
    failures = []
    for at in [*range(1, counter.seen + 1), None]:
        with monkeypatch.context() as patched:
            KillAt(patched, owner, name, at)
            try:
                run(world)
            except AssertionError as exc:
                failures.append(f"killed before statement {at}: {exc}")
            world.forget()
    assert not failures, "\n".join(failures)
