"""Batch changes inside running learners against hostile learners (jobs.elastic_timeline.batch_applied,
learner_agent.batch_changes): a learner's `batch_applied` report is believed only from learner 0 of
the attempt asked, for the change asked of it; anything else is stored as the metric it is and changes
no timeline, its own job's or another tenant's. That the learner cannot rewrite the request its agent
hands it is learner_agent/tests/test_agent.py's (a read-only bind in its sandbox); that a learner which
says it listens and never applies cannot hold its job at its size, jobs/tests/test_elastic_jobs.py's.
"""
import pytest
from django.utils import timezone

from jobs import credentials, lifecycle
from jobs.models import Allocation, Job, Status
from jobs.states import transition
from tests.support.builders import ELASTIC_MANIFEST as ELASTIC, job, member, post

pytestmark = pytest.mark.django_db


def asked(membership, first_gpu):
    """A running elastic job of two learners with a batch change asked of it, and its ingest tokens."""
    row = job(membership, manifest_yaml=ELASTIC, gpus=1, learners=2)
    transition(row.id, Status.PENDING, actor="scheduler",
               placement=[{"node": "local", "gpu_ids": [first_gpu + i]} for i in range(2)])
    row = transition(row.id, Status.PROCESSING, actor="lifecycle-manager", reason="training")
    row.tokens = credentials.issue_for_attempt(row)
    row.change = lifecycle.change_batch(row, wanted_batch=128, why="test", actor="test")
    return row


def applied(seq, value, **extra):
    return {"seq": seq, "kind": "metric", "name": "batch_applied", "value": value,
            "time": timezone.now().timestamp(), **extra}


def untouched(*rows):
    for row in rows:
        fresh = Job.objects.get(pk=row.pk)
        assert fresh.batch_request is not None and fresh.batch_request["id"] == row.change.id
        assert Allocation.objects.get(pk=row.change.pk).started_at is None


def test_a_report_naming_another_tenants_change_applies_neither():
    mine, theirs = asked(member(), 0), asked(member("team-b", "bob"), 2)
    answer = post(mine, [applied(1, theirs.change.id)]).json()
    assert answer["acked"] == 1 and answer["batch"]["id"] == mine.change.id  # still asked: not applied
    untouched(mine, theirs)


def test_only_learner_0_of_the_attempt_asked_is_believed():
    row = asked(member(), 0)
    assert post(row, [applied(1, row.change.id)], learner=1).status_code == 200
    untouched(row)


@pytest.mark.parametrize("value", [-1, 0, 0.5, 1e300, 2.0**63])
def test_a_value_that_names_no_change_is_stored_and_ignored(value):
    row = asked(member(), 0)
    response = post(row, [applied(1, value)])
    assert response.status_code == 200 and response.json()["acked"] == 1
    untouched(row)


def test_a_change_is_applied_once_and_a_replayed_report_changes_nothing():
    row = asked(member(), 0)
    post(row, [applied(1, row.change.id)])
    change = Allocation.objects.get(pk=row.change.pk)
    assert change.started_at is not None and Job.objects.get(pk=row.pk).batch_request is None
    post(row, [applied(2, row.change.id)])
    assert Allocation.objects.get(pk=row.change.pk).started_at == change.started_at
    assert Allocation.objects.filter(job=row).count() == 2
