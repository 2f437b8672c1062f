"""Resource samples past their retention (jobs.retention): each learner's day is summed into one row and its
samples deleted, and the usage report of an old period reads the same before and after."""
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import connection

from jobs import retention, usage
from jobs.models import ResourceDay, ResourceSample
from tests.support.builders import job, member
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.django_db
NOW = datetime(2026, 11, 29, 15, 30, tzinfo=dt_timezone.utc)
OLD_DAY = datetime(2026, 10, 1, tzinfo=dt_timezone.utc)  # past 30 days' retention on NOW


def sampled(target, start, *, hours, cores=1.0, gpus_busy=0.5, learner=0, attempt=1):
    """A sample every 5 minutes from `start`, each for the five before it."""
    ResourceSample.objects.bulk_create(
        ResourceSample(job=target, attempt=attempt, learner=learner, time=start + timedelta(minutes=5 * n),
                       cpu_cores=cores, memory_bytes=1, memory_peak_bytes=1, gpus_busy=gpus_busy,
                       gpu_utilization=None if gpus_busy is None else 50.0)
        for n in range(1, hours * 12 + 1))


def report(tenant, start, end):
    return usage.report(tenant, start=start, end=end, now=NOW)


@pytest.fixture
def alice(settings):
    settings.RESOURCE_SAMPLE_DAYS = 30
    return member("team-a", "alice")


def test_old_days_are_summed_and_the_usage_report_reads_the_same(alice):
    trained, other = job(alice, gpus=1), job(alice)
    # Two days and a half of one learner, from the first old day into the third, then two learners
    # of the other job on the first old day, one without GPUs.
    sampled(trained, OLD_DAY + timedelta(hours=12), hours=59, cores=2.0)
    sampled(other, OLD_DAY, hours=5, learner=0)
    sampled(other, OLD_DAY, hours=5, learner=1, gpus_busy=None)
    recent = NOW - timedelta(days=2)
    sampled(trained, recent, hours=3)
    month = (datetime(2026, 10, 1, tzinfo=dt_timezone.utc), datetime(2026, 11, 1, tzinfo=dt_timezone.utc))
    whole = (month[0], NOW)
    before = [report(alice.tenant, *period) for period in (month, whole)]

    assert retention.prune_pass(now=NOW) == 4  # trained: Oct 1, 2 and 3; other: Oct 1
    assert not ResourceSample.objects.filter(time__lt=datetime(2026, 10, 30, tzinfo=dt_timezone.utc)).exists()
    assert ResourceSample.objects.filter(job=trained).count() == 36  # the recent three hours stay
    days = {(d.job_id, d.learner, d.day.isoformat()): d for d in ResourceDay.objects.all()}
    assert sorted(days) == sorted([(trained.id, 0, "2026-10-01"), (trained.id, 0, "2026-10-02"),
                                   (trained.id, 0, "2026-10-03"), (other.id, 0, "2026-10-01"),
                                   (other.id, 1, "2026-10-01")])
    assert days[(trained.id, 0, "2026-10-02")].samples == 288 and days[(other.id, 1, "2026-10-01")].gpu_samples == 0
    assert [report(alice.tenant, *period) for period in (month, whole)] == before
    assert before[0]["tenant"]["used_cpu_hours"] == pytest.approx(2.0 * 59 + 5 + 5, abs=0.2)
    assert retention.prune_pass(now=NOW) == 0


def test_samples_arriving_for_a_day_already_summed_are_added_to_it(alice):
    target = job(alice)
    sampled(target, OLD_DAY, hours=2)
    retention.prune_pass(now=NOW)
    sampled(target, OLD_DAY + timedelta(hours=2), hours=1, cores=3.0)  # an agent's spool, delivered late
    retention.prune_pass(now=NOW)
    day = ResourceDay.objects.get()
    assert (day.samples, day.cpu_cores) == (36, 24 * 1.0 + 12 * 3.0)
    assert day.first == OLD_DAY + timedelta(minutes=5) and day.last == OLD_DAY + timedelta(hours=3)


def test_a_day_counts_whole_in_the_period_it_begins_in(alice):
    target = job(alice)
    sampled(target, OLD_DAY, hours=24)
    retention.prune_pass(now=NOW)
    noon = OLD_DAY + timedelta(hours=12)
    assert report(alice.tenant, OLD_DAY, noon)["tenant"]["used_cpu_hours"] == pytest.approx(24, abs=0.1)
    assert report(alice.tenant, noon, OLD_DAY + timedelta(days=1))["tenant"]["used_cpu_hours"] == 0


def test_a_pass_keeps_within_its_budget_and_the_next_goes_on(alice):
    target = job(alice)
    sampled(target, OLD_DAY, hours=71)
    assert retention.prune_pass(now=NOW, budget_s=0) == 0
    assert retention.prune_pass(now=NOW) == 3


def test_nothing_is_pruned_when_samples_are_kept_for_ever(alice, settings):
    settings.RESOURCE_SAMPLE_DAYS = 0
    sampled(job(alice), OLD_DAY - timedelta(days=400), hours=1)
    assert retention.prune_pass(now=NOW) == 0 and ResourceSample.objects.count() == 12


@pytest.mark.parametrize("days", [800_000, 10**10])
def test_it_prunes_nothing_when_the_retention_reaches_before_any_sample(settings, days):
    """A retention longer than the calendar goes back (TRAINYARD_RESOURCE_SAMPLE_DAYS=999999, "for ever")
    keeps every sample; it does not fail every pass."""
    settings.RESOURCE_SAMPLE_DAYS = days
    sampled(job(member("team-a", "alice")), OLD_DAY, hours=1)
    assert retention.prune_pass(now=NOW) == 0 and ResourceSample.objects.count() == 12


def test_a_day_pruned_while_the_usage_report_reads_is_counted_once(settings):
    """The pass commits a day (its samples deleted, its sums written) just after the report's first read
    of samples or kept days: the report read both as of one moment, so the day is counted, and only once."""
    if connection.vendor != "postgresql":
        # SQLite steps through a statement's rows as they are fetched: a pass run on the same connection
        # after `execute` would delete rows the statement has still to read.
        skip_or_fail("a statement read whole at execute is PostgreSQL's (set DATABASE_URL)")
    settings.RESOURCE_SAMPLE_DAYS = 30
    alice = member("team-a", "alice")
    sampled(job(alice), OLD_DAY, hours=23)
    period = (OLD_DAY, OLD_DAY + timedelta(days=2))
    before = report(alice.tenant, *period)["tenant"]["used_cpu_hours"]
    assert before == pytest.approx(23, abs=0.1)
    pruned = []

    def prune_after_the_first_read(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not pruned and "resource" in sql and sql.lstrip("( ").upper().startswith("SELECT"):
            pruned.append(None)  # once: the pass's own statements come through here too
            pruned[0] = retention.prune_pass(now=NOW)
        return result
    with connection.execute_wrapper(prune_after_the_first_read):
        during = report(alice.tenant, *period)["tenant"]["used_cpu_hours"]
    assert pruned == [1] and during == before
