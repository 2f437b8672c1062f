"""Usage accounting: records follow the job state machine to the second; budgets per period."""
from datetime import datetime, timedelta, timezone as tz

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.models import Status
from jobs.states import transition
from tenants import quotas
from tenants.models import Quota, UsageRecord
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db

UTC = tz.utc


def walk(target, *statuses):
    for status in statuses:
        assert transition(target.id, status, actor="test"), status


def test_an_attempt_holds_resources_from_admission_to_release():
    alice = member()
    j = job(alice, gpus=2, learners=2, cpus=3)
    walk(j, Status.PENDING, Status.PROCESSING)
    record = UsageRecord.objects.get(job=j)
    admitted = j.events.get(to_status=Status.PENDING).time
    assert (record.started_at, record.ended_at, record.gpus, record.cpus) == (admitted, None, 4, 6.0)
    walk(j, Status.STORING, Status.COMPLETED)
    record.refresh_from_db()
    assert record.ended_at == j.events.get(to_status=Status.COMPLETED).time


def test_a_job_reports_what_it_consumed_over_its_attempts():
    alice = member()
    j = job(alice, gpus=2, cpus=1)
    start = timezone.now() - timedelta(hours=2)
    for attempt, (begin, end) in enumerate([(0, 30), (60, 90)], start=1):  # two 30-minute attempts
        UsageRecord.objects.create(tenant=alice.tenant, job=j, user=alice.user, attempt=attempt, gpus=2, cpus=1,
                                   memory_bytes=0, started_at=start + timedelta(minutes=begin),
                                   ended_at=start + timedelta(minutes=end))
    assert quotas.job_usage(j) == {"gpu_hours": 2.0, "cpu_hours": 1.0, "seconds": 3600.0}


def test_a_retry_closes_the_attempt_and_the_next_admission_opens_another():
    j = job(member())
    walk(j, Status.PENDING, Status.PROCESSING)
    assert transition(j.id, Status.QUEUED, actor="test", attempt_next=True)
    walk(j, Status.PENDING)
    records = list(UsageRecord.objects.filter(job=j).order_by("attempt"))
    assert [(r.attempt, r.ended_at is None) for r in records] == [(1, False), (2, True)]


def test_halted_jobs_hold_nothing():
    j = job(member())
    walk(j, Status.PENDING, Status.PROCESSING, Status.HALTING, Status.STORING, Status.HALTED)
    assert not UsageRecord.objects.filter(job=j, ended_at__isnull=True).exists()


def record(membership, started, ended, gpus=1, cpus=1.0):
    j = job(membership, status=Status.COMPLETED)
    return UsageRecord.objects.create(tenant=membership.tenant, job=j, user=membership.user, attempt=1, gpus=gpus,
                                      cpus=cpus, memory_bytes=0, started_at=started, ended_at=ended)


def test_consumption_counts_only_the_part_inside_the_period():
    alice = member()
    start, end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)
    now = datetime(2026, 11, 21, 12, tzinfo=UTC)
    record(alice, start - timedelta(hours=3), start + timedelta(hours=1), gpus=2)  # 1 h inside: 2 GPU-h
    record(alice, now - timedelta(minutes=30), None, gpus=4, cpus=8)  # still running: 2 GPU-h, 4 CPU-h (+1 above)
    record(alice, start - timedelta(hours=5), start - timedelta(hours=4))  # last month: nothing
    gpu_h, cpu_h = quotas.consumed(alice.tenant_id, start, end, now)
    assert (gpu_h, cpu_h) == (pytest.approx(4.0), pytest.approx(5.0))


@pytest.mark.parametrize("period, start, end", [
    ("month", datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)),
    ("week", datetime(2026, 11, 16, tzinfo=UTC), datetime(2026, 11, 23, tzinfo=UTC)),
    ("day", datetime(2026, 11, 21, tzinfo=UTC), datetime(2026, 11, 22, tzinfo=UTC)),
])
def test_period_bounds(settings, period, start, end):
    settings.TIME_ZONE = "UTC"
    assert quotas.period_bounds(period, datetime(2026, 11, 21, 15, 4, tzinfo=UTC)) == (start, end)


def test_december_rolls_into_the_next_year():
    assert quotas.period_bounds("month", datetime(2026, 12, 9, tzinfo=UTC))[1] == datetime(2027, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("mode, used_minutes, state", [
    ("hard", 59, "ok"), ("hard", 61, "hard_exceeded"), ("soft", 61, "soft_exceeded")])
def test_budget_state(mode, used_minutes, state):
    alice = member()
    quota = quotas.set_quota(alice.tenant, gpu_hours=1, budget_mode=mode)
    now = timezone.now()
    record(alice, now - timedelta(minutes=used_minutes), now)
    got, reason = quotas.budget_state(quota, quotas.usage_of(alice.tenant, now, quota))
    assert got == state
    assert (reason == "") == (state == "ok")
    if state != "ok":
        assert "GPU-hours budget" in reason and "/1 h used this month" in reason


def test_summary_reports_quota_usage_queue_and_history():
    alice = member()
    quotas.set_quota(alice.tenant, gpus=8, jobs=3, gpu_hours=100)
    walk(job(alice, gpus=2), Status.PENDING)
    job(alice, gpus=1, learners=2)  # queued
    body = quotas.summary(alice.tenant, user=alice.user)
    assert body["quota"]["gpus"] == 8 and body["quota"]["cpus"] is None
    assert (body["usage"]["gpus"], body["usage"]["jobs"], body["usage"]["my_gpus"]) == (2, 1, 2)
    assert body["queued"] == {"jobs": 1, "gpus": 2}
    assert len(body["history"]) == quotas.HISTORY_PERIODS
    assert body["budget"] == {"state": "ok", "reason": ""}


def test_set_quota_refuses_unknown_fields():
    with pytest.raises(ValueError, match="gpu_minutes"):
        quotas.set_quota(member().tenant, gpu_minutes=3)


def test_quota_defaults_are_no_limits():
    quota = Quota.objects.create(tenant=member().tenant)
    assert all(getattr(quota, name) is None for name in Quota.LIMITS)


def test_summary_reads_the_queue_in_the_same_queries_however_long_it_is():
    alice = member()
    counts = []
    for adding, queued in ((1, 1), (9, 10)):
        for _ in range(adding):
            job(alice, gpus=1, learners=2)
        with CaptureQueriesContext(connection) as queries:
            body = quotas.summary(alice.tenant, user=alice.user)
        assert body["queued"] == {"jobs": queued, "gpus": 2 * queued}
        counts.append(len(queries))
    assert counts[0] == counts[1]
