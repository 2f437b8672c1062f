"""Admission against quotas: jobs over a quota wait in QUEUED with the reason, budgets per period,
soft limits, quota changes taking effect at once — and exactly N admitted under real concurrency."""
import threading
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from gpu_scheduler.reasons import position_prefix, split_position
from jobs import admission, submission
from jobs.models import Job, Status
from tenants import quotas
from tenants.models import Quota, UsageRecord
from tests.support.builders import WAKE_SCHEDULER, client_for, job, member, open_follow_ups, tar_gz, upload
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.django_db
SMALL_JOB = b"name: small\ncpus: 0.5\nmemory: 256MiB\nframework: {name: custom, command: sh run.sh}\n"
CODE = tar_gz({"run.sh": b"echo hi\n"})


def statuses(*jobs):
    return [Job.objects.get(pk=j.pk).status for j in jobs]


def reason(j):
    return Job.objects.get(pk=j.pk).wait_reason


def test_a_job_over_the_tenant_gpu_quota_waits_with_the_reason(cluster, sent):
    cluster(gpus=8)
    alice = member()
    quotas.set_quota(alice.tenant, gpus=2)
    first, second = job(alice, gpus=2), job(alice, gpus=1)
    admission.run_cycle()
    assert statuses(first, second) == [Status.PENDING, Status.QUEUED]
    assert "tenant GPU quota 2/2 in use" in reason(second)
    assert ("deploy", 1) in open_follow_ups(first)  # the outbox row, written with the admission


def test_a_quota_the_scheduler_cannot_take_holds_back_its_own_tenant_only(cluster, sent):
    # Written past the model's checks (the database directly): a negative limit.
    cluster(gpus=8)
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    quotas.set_quota(alice.tenant, cpus=4)
    Quota.objects.filter(tenant=alice.tenant).update(cpus=-1)
    theirs, ours = job(alice, gpus=1), job(bob, gpus=1)
    admission.run_cycle()
    assert statuses(theirs, ours) == [Status.QUEUED, Status.PENDING]
    assert "the tenant's quota cannot be used" in reason(theirs)


@pytest.mark.parametrize("field", ["cpus", "memory_bytes", "gpu_hours", "cpu_hours", "storage_bytes",
                                   "disk_per_job_bytes"])
def test_a_negative_limit_is_refused_where_a_quota_is_set(field):
    alice = member()
    with pytest.raises(ValidationError) as refused:
        quotas.set_quota(alice.tenant, **{field: -1})
    assert field in refused.value.message_dict


def test_concurrent_jobs_and_per_user_caps(cluster, sent):
    cluster(gpus=8)
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    quotas.set_quota(alice.tenant, jobs=2, gpus_per_user=1)
    a1, a2, b1, b2 = job(alice, gpus=1), job(alice, gpus=1), job(bob, gpus=1), job(bob, gpus=0)
    admission.run_cycle()
    assert statuses(a1, a2, b1, b2) == [Status.PENDING, Status.QUEUED, Status.PENDING, Status.QUEUED]
    assert "user GPU cap 1/1" in reason(a2)
    assert "concurrent jobs 2/2" in reason(b2)


def test_raising_a_quota_admits_the_waiting_job(cluster, sent):
    cluster(gpus=8)
    alice = member()
    quotas.set_quota(alice.tenant, gpus=1)
    running, waiting = job(alice, gpus=1), job(alice, gpus=1)
    admission.run_cycle()
    assert statuses(waiting) == [Status.QUEUED]
    sent.clear()
    quotas.set_quota(alice.tenant, gpus=2)
    assert WAKE_SCHEDULER in sent  # the change wakes the scheduling loop on its own
    admission.run_cycle()
    assert statuses(running, waiting) == [Status.PENDING, Status.PENDING]


def used_gpu_minutes(membership, minutes):
    done = job(membership, status=Status.COMPLETED)
    now = timezone.now()
    return UsageRecord.objects.create(tenant=membership.tenant, job=done, user=membership.user, attempt=1, gpus=1,
                                      cpus=1, memory_bytes=0, started_at=now - timedelta(minutes=minutes),
                                      ended_at=now)


def test_a_spent_gpu_hour_budget_queues_the_next_job_with_the_reason(cluster, sent):
    cluster(gpus=4)
    alice = member()
    quotas.set_quota(alice.tenant, gpu_hours=1)
    spent = used_gpu_minutes(alice, 59)
    first = job(alice, gpus=1)
    admission.run_cycle()
    assert statuses(first) == [Status.PENDING]  # 59 of 60 minutes used: still allowed
    spent.started_at -= timedelta(minutes=2)  # usage passes the limit
    spent.save()
    second = job(alice, gpus=1)
    admission.run_cycle()
    assert statuses(second) == [Status.QUEUED]
    assert "GPU-hours budget" in reason(second) and "/1 h used this month" in reason(second)


@pytest.mark.parametrize("mode, outcome", [("soft", Status.PENDING), ("hard", Status.QUEUED)])
def test_over_budget_on_an_idle_cluster_a_soft_limit_still_runs_and_a_hard_one_holds(cluster, sent, mode, outcome):
    cluster(gpus=4)
    alice = member()
    quotas.set_quota(alice.tenant, gpu_hours=1, budget_mode=mode)
    used_gpu_minutes(alice, 120)
    over = job(alice, gpus=1)
    admission.run_cycle()
    assert statuses(over) == [outcome]


def test_a_higher_priority_job_preempts_through_a_halt(cluster, sent):
    cluster(gpus=4)
    alice = member()
    low = [job(alice, gpus=1, priority="low") for _ in range(4)]
    admission.run_cycle()
    high = job(alice, gpus=1, priority="high")
    admission.run_cycle()
    after = statuses(*low)
    assert after.count(Status.HALTING) == 1 and after.count(Status.PENDING) == 3
    victim = Job.objects.get(status=Status.HALTING)
    assert victim.preempted_reason and ("halt", 1) in open_follow_ups(victim)
    assert statuses(high) == [Status.QUEUED]  # waits until the victim has let go
    admission.run_cycle()
    assert Job.objects.filter(status=Status.HALTING).count() == 1  # no second victim for the same job


def test_a_job_preempted_for_another_tenants_job_is_not_told_which_job_or_tenant(cluster, sent):
    """Shared pool (no quotas): team-b's high-priority job halts one of team-a's. What team-a reads
    (status reason, events, preempted_reason) says why, but names neither team-b, bob nor the job."""
    cluster(gpus=4)
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    low = [job(alice, gpus=1, priority="low") for _ in range(4)]
    admission.run_cycle()
    high = job(bob, gpus=1, priority="high")
    admission.run_cycle()
    victim = Job.objects.get(status=Status.HALTING)
    told = [victim.status_reason, victim.preempted_reason, *victim.events.values_list("reason", flat=True)]
    assert victim.preempted_reason == "preempted for a higher-priority job of another tenant"
    assert not [text for text in told if high.id in text or "team-b" in text or "bob" in text], told


def test_a_job_preempted_for_a_colleagues_private_job_is_not_told_which(cluster, sent):
    """A private job is seen by its owner and those it is shared with: the colleague whose job it halts
    reads that a private job of the tenant needed the GPUs, not its id."""
    cluster(gpus=4)
    alice, carol = member("team-a", "alice"), member("team-a", "carol")
    for _ in range(4):
        job(alice, gpus=1, priority="low")
    admission.run_cycle()
    secret = job(carol, gpus=1, priority="high", private=True)
    admission.run_cycle()
    victim = Job.objects.get(status=Status.HALTING)
    told = [victim.status_reason, victim.preempted_reason, *victim.events.values_list("reason", flat=True)]
    assert victim.preempted_reason == "preempted for a private higher-priority job of this tenant"
    assert not [text for text in told if secret.id in text], told


def test_a_tenant_at_its_fair_share_halts_its_own_work_not_another_tenants(cluster, sent):
    """Shared pool: team-b already holds half of the 4 GPUs; its high-priority job would take it past
    half, so it halts team-b's own normal job, not team-a's low-priority one."""
    cluster(gpus=4)
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    theirs = [job(alice, gpus=1, priority="low") for _ in range(2)]
    own = [job(bob, gpus=1) for _ in range(2)]
    admission.run_cycle()
    job(bob, gpus=1, priority="high")
    admission.run_cycle()
    assert statuses(*theirs) == [Status.PENDING, Status.PENDING]
    assert sorted(statuses(*own)) == sorted([Status.HALTING, Status.PENDING])


def used_by(membership, *, gpus=0, cpus=1.0, minutes=10, ended_minutes_ago=0):
    """A finished job of the member that held these resources for `minutes`, ending that long ago."""
    done = job(membership, status=Status.COMPLETED)
    end = timezone.now() - timedelta(minutes=ended_minutes_ago)
    return UsageRecord.objects.create(tenant=membership.tenant, job=done, user=membership.user, attempt=1, gpus=gpus,
                                      cpus=cpus, memory_bytes=0, started_at=end - timedelta(minutes=minutes),
                                      ended_at=end)


def test_recent_service_decays_by_its_half_life():
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    used_by(alice, gpus=2, cpus=4.0, minutes=1)  # the last minute: its seconds weigh 0.99 to 1
    used_by(bob, cpus=8.0, minutes=1, ended_minutes_ago=60)  # one half-life ago: 0.494 to 0.5
    used_by(bob, cpus=8.0, minutes=1, ended_minutes_ago=60 * 11)  # past the horizon: not read
    service = quotas.recent_service({alice.tenant_id, bob.tenant_id}, timezone.now(), 3600.0)
    assert service[alice.tenant_id] == (pytest.approx(2 * 59.66, rel=0.002), pytest.approx(4 * 59.66, rel=0.002))
    assert service[bob.tenant_id] == (0.0, pytest.approx(8 * 29.83, rel=0.002))


def test_a_backlog_submitted_first_does_not_starve_another_tenants_small_job(cluster, sent):
    """CPU-only node of 8 CPUs. team-b queued whole-node jobs before team-a's half-CPU job and has
    just had the node; neither holds anything now. team-a's job goes first (it has had less), and
    team-b's next big job waits for the room it leaves."""
    cluster(gpus=0, cpus=8.0)
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    used_by(bob, cpus=8.0, minutes=5)
    backlog = [job(bob, cpus=8.0, memory_bytes=2**28) for _ in range(20)]
    small = job(alice, cpus=0.5, memory_bytes=2**28)
    admission.run_cycle()
    assert statuses(small) == [Status.PENDING]
    assert set(statuses(*backlog)) == {Status.QUEUED}


def test_the_cycle_hands_each_tenants_recent_service_to_the_scheduler(cluster, sent, monkeypatch, settings):
    settings.FAIR_SHARE_HALF_LIFE_S = 600.0
    cluster(gpus=0, cpus=8.0)
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    used_by(bob, gpus=1, cpus=8.0, minutes=1, ended_minutes_ago=10)
    job(alice, cpus=0.5)
    job(bob, cpus=0.5)
    seen = {}
    schedule = admission.scheduler.schedule
    monkeypatch.setattr(admission.scheduler, "schedule",
                        lambda snapshot, *args: seen.update(snapshot.tenants) or schedule(snapshot, *args))
    admission.run_cycle()
    assert (seen["team-a"].recent_gpu_s, seen["team-a"].recent_cpu_s) == (0.0, 0.0)
    # One GPU and 8 CPUs for the minute that ended one half-life ago: each second weighs 2^(-age/600),
    # from 0.5 down to 0.47 (ages 600 to 660 s), so 60 GPU-seconds count as 29.
    assert seen["team-b"].recent_gpu_s == pytest.approx(29.0, rel=0.01)
    assert seen["team-b"].recent_cpu_s == pytest.approx(8 * 29.0, rel=0.01)


def test_a_high_priority_job_at_its_tenants_quota_halts_the_tenants_low_priority_work(cluster, sent):
    cluster(gpus=8)  # the cluster has room; the quota does not
    alice = member()
    quotas.set_quota(alice.tenant, gpus=2)
    low = [job(alice, gpus=1, priority="low") for _ in range(2)]
    admission.run_cycle()
    high = job(alice, gpus=1, priority="high")
    admission.run_cycle()
    assert sorted(statuses(*low)) == sorted([Status.HALTING, Status.PENDING])
    assert statuses(high) == [Status.QUEUED]
    assert "lower-ranked work being halted (tenant GPU quota 2/2 in use)" in reason(high)


@pytest.mark.parametrize("level_hours, first", [(4, "fresh"), (0, "veteran")])  # 0: service levels off
def test_a_job_that_has_had_less_gpu_time_goes_first(cluster, sent, settings, level_hours, first):
    # Service levels: the earlier attempts' GPU time (UsageRecords) reaches the scheduler.
    settings.SERVICE_LEVEL_GPU_HOURS = level_hours
    cluster(gpus=1)
    alice = member()
    veteran, fresh = job(alice, gpus=1), job(alice, gpus=1)  # the veteran was submitted first
    now = timezone.now()
    UsageRecord.objects.create(tenant=alice.tenant, job=veteran, user=alice.user, attempt=1, gpus=1, cpus=1,
                               memory_bytes=0, started_at=now - timedelta(hours=5), ended_at=now)
    assert quotas.earlier_gpu_seconds([veteran.id, fresh.id]) == {veteran.id: 5 * 3600.0}
    admission.run_cycle()
    assert Job.objects.get(status=Status.PENDING).id == {"fresh": fresh, "veteran": veteran}[first].id


def test_the_apis_queue_position_is_the_place_the_scheduler_gave_and_costs_no_query(cluster, sent, settings):
    # One home for a job's place: the scheduler's order (here service levels put the job submitted
    # first behind), the one its reason names; a count by priority and submission time said otherwise
    # and cost a query per queued job in every answer.
    settings.SERVICE_LEVEL_GPU_HOURS = 4
    cluster(gpus=0)
    alice = member()
    veteran, fresh, later = job(alice, gpus=1), job(alice, gpus=1), job(alice, gpus=1)
    now = timezone.now()
    UsageRecord.objects.create(tenant=alice.tenant, job=veteran, user=alice.user, attempt=1, gpus=1, cpus=1,
                               memory_bytes=0, started_at=now - timedelta(hours=5), ended_at=now)
    client = client_for(alice)
    assert client.get(f"/api/v1/jobs/{fresh.id}/").json()["queue_position"] is None  # no cycle has seen it
    admission.run_cycle()
    answers = {j.id: client.get(f"/api/v1/jobs/{j.id}/").json() for j in (veteran, fresh, later)}
    assert [answers[j.id]["queue_position"] for j in (fresh, later, veteran)] == [1, 2, 3]
    assert all(a["wait_reason"].startswith(position_prefix(a["queue_position"])) for a in answers.values())
    queries, listed = listing_queued(client)
    assert {row["id"]: row["queue_position"] for row in listed} == {fresh.id: 1, later.id: 2, veteran.id: 3}
    job(alice, gpus=1)
    admission.run_cycle()
    assert listing_queued(client)[0] == queries  # a fourth queued job, no more queries


def listing_queued(client):
    """(queries it took, rows) of the API's list of queued jobs."""
    with CaptureQueriesContext(connection) as captured:
        rows = client.get("/api/v1/jobs/?status=QUEUED").json()["results"]
    return len(captured), rows


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_hundred_concurrent_submissions_admit_exactly_the_quota(cluster, sent, monkeypatch, settings):
    """200 submissions, each followed by its own scheduling cycle, from 50 connections at once
    (PostgreSQL's default limit is 100 connections), released together by a barrier. (The tenant's
    submission rate is lifted: this is about the quota, not the intake limits.)"""
    settings.SUBMITS_PER_MINUTE = 100_000  # its ten-second burst (a sixth) well above the 200 sent at once
    if connection.vendor != "postgresql":
        skip_or_fail("the concurrency test needs PostgreSQL (set DATABASE_URL)")
    monkeypatch.setattr("jobs.live._send", lambda groups, message: None)  # no channel layer in this test
    cluster(gpus=0, nodes=4, cpus=1000.0)
    alice = member()
    quotas.set_quota(alice.tenant, jobs=10)
    connections_at_once, submissions = 50, 200
    start = threading.Barrier(connections_at_once)
    errors = []

    def submit_and_schedule(count):
        try:
            start.wait()
            for _ in range(count):
                submission.submit(alice, manifest_bytes=SMALL_JOB, code_file=upload(CODE))
                admission.run_cycle()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    share = submissions // connections_at_once
    threads = [threading.Thread(target=submit_and_schedule, args=(share,)) for _ in range(connections_at_once)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert Job.objects.count() == submissions
    assert Job.objects.filter(status=Status.PENDING).count() == 10
    assert UsageRecord.objects.filter(ended_at__isnull=True).count() == 10
    admission.run_cycle()
    waiting = set(Job.objects.filter(status=Status.QUEUED).values_list("wait_reason", flat=True))
    assert len(waiting) and all("concurrent jobs 10/10" in r for r in waiting)


def cycle_queries(queued):
    from django.test.utils import CaptureQueriesContext
    alice = member()
    waiting = [job(alice, gpus=8) for _ in range(queued)]  # never fits a 4-GPU node: each gets a reason
    with CaptureQueriesContext(connection) as queries:
        admission.run_cycle()
    assert all(reason(j).startswith("waiting:") for j in waiting)
    Job.objects.filter(pk__in=[j.pk for j in waiting]).delete()
    return len(queries)


def test_a_cycle_writes_the_wait_reasons_of_5_or_120_jobs_in_as_many_queries(cluster, sent):
    # Each reason names the job's place in the queue, so one admission changes every reason behind
    # it; one UPDATE per job made a cycle at 10,000 queued jobs take seconds under the lock.
    cluster(gpus=4)
    assert cycle_queries(5) == cycle_queries(120)


def test_a_wait_reason_is_not_written_on_a_job_no_longer_queued(cluster, sent):
    cluster(gpus=4)
    alice = member()
    big = job(alice, gpus=8)
    admission._record_wait_reasons({big.id: "waiting: 1st", job(alice, status="TERMINATED").id: "waiting: 2nd"})
    assert reason(big) == "waiting: 1st"
    assert Job.objects.filter(status="TERMINATED", wait_reason="").count() == 1


def test_wait_reasons_written_in_several_statements_each_reach_their_own_job(cluster, sent, monkeypatch):
    monkeypatch.setattr(admission, "WAIT_REASON_BATCH", 2)  # PostgreSQL's statements: 2, 2 and 1 rows
    alice = member()
    waiting = [job(alice, gpus=8) for _ in range(5)]
    admission._record_wait_reasons({j.id: f"waiting: number {n}" for n, j in enumerate(waiting)})
    assert [reason(j) for j in waiting] == [f"waiting: number {n}" for n in range(5)]


@pytest.mark.postgres
def test_the_jobs_table_leaves_room_on_its_pages_for_rewritten_wait_reasons():
    # A page with room keeps a row's next version (a HOT update, no new index entries); full pages
    # made each rewrite of the queue's reasons add to every index (jobs/migrations/0012).
    if connection.vendor != "postgresql":
        skip_or_fail("fillfactor is PostgreSQL's (set DATABASE_URL)")
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [Job._meta.db_table])
        assert cursor.fetchone()[0] == ["fillfactor=70"]


def positions(jobs):
    """Each job's place in its queue as its written reason says it."""
    return [split_position(reason(j))[0] for j in jobs]


def ranked_queue(owner, count):
    """`count` queued jobs that never fit the 4-GPU cluster, each given its place by a cycle."""
    jobs = [job(owner, gpus=8) for _ in range(count)]
    admission.run_cycle()
    return jobs


def leave_queue(gone):
    """`gone` ends, moving every job behind it up one; a cycle follows."""
    Job.objects.filter(pk=gone.pk).update(status=Status.TERMINATED)
    admission.run_cycle()


def test_positions_behind_the_head_are_refreshed_on_an_interval_the_head_at_once(cluster, sent, settings):
    # One admission moves every job behind it: rewriting all their reasons each cycle was half of a
    # cycle's time at 10,000 queued jobs (bench controlplane).
    settings.QUEUE_POSITION_REFRESH_S = 1
    cluster(gpus=4)
    first, second, *waiting = ranked_queue(member(), admission.QUEUE_HEAD + 10)
    assert positions([first, second, *waiting]) == list(range(1, admission.QUEUE_HEAD + 11))
    leave_queue(first)  # the first move since the last refresh: written, and the next refresh is in 1 s
    assert positions(waiting) == list(range(2, admission.QUEUE_HEAD + 10))
    leave_queue(second)  # and up one again
    head, tail = waiting[:admission.QUEUE_HEAD], waiting[admission.QUEUE_HEAD:]
    assert positions(head) == list(range(1, admission.QUEUE_HEAD + 1))  # written at once
    assert positions(tail) == list(range(admission.QUEUE_HEAD + 2, admission.QUEUE_HEAD + 10))  # not yet
    time.sleep(1.05)
    admission.run_cycle()
    assert positions(tail) == list(range(admission.QUEUE_HEAD + 1, admission.QUEUE_HEAD + 9))


def test_a_reason_that_changes_more_than_its_position_is_written_at_once_anywhere_in_the_queue(cluster, sent,
                                                                                                 settings):
    settings.QUEUE_POSITION_REFRESH_S = 3600
    cluster(gpus=4)
    alice = member()
    first, *waiting = ranked_queue(alice, admission.QUEUE_HEAD + 10)
    leave_queue(first)  # the refresh is spent: the tail's positions wait an hour
    quotas.set_quota(alice.tenant, gpus=2)
    admission.run_cycle()
    last = reason(waiting[-1])
    assert "more than the tenant GPU quota of 2" in last and positions([waiting[-1]]) == [admission.QUEUE_HEAD + 9]


def test_every_position_is_written_at_once_when_the_refresh_interval_is_0(cluster, sent, settings):
    settings.QUEUE_POSITION_REFRESH_S = 0
    cluster(gpus=4)
    first, *waiting = ranked_queue(member(), admission.QUEUE_HEAD + 5)
    leave_queue(first)
    assert positions(waiting) == list(range(1, admission.QUEUE_HEAD + 5))
