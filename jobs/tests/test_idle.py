"""Idle GPUs (jobs.idle): when a running job's samples say its GPUs stayed below the tenant's threshold
for the window, it is flagged once (page, list, API), a GPUS_IDLE webhook event is written with the flag,
and under a halt policy it is halted through its checkpoint; busy, unmeasured and other tenants' jobs
are left alone. The tenant's policy is read by every member and set by its admins only."""
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import idle
from jobs.models import FollowUp, IdleGpuPolicy, JobEvent, ResourceSample, Status
from notifications.models import Delivery, Webhook
from tenants.models import AuditEntry
from tests.support.builders import client_for, job, logged_in, member, record_sends
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.django_db
T0 = timezone.now().replace(microsecond=0)
MIN = timedelta(minutes=1)


def at(minutes):
    return T0 + timedelta(minutes=minutes)


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


def policy(membership, *, below=10.0, minutes=5.0, action="flag"):
    return IdleGpuPolicy.objects.create(tenant=membership.tenant, below_percent=below, minutes=minutes, action=action)


def running(membership, **fields):
    return job(membership, status=Status.PROCESSING, gpus=1, **fields)


def samples(target, utilisations, *, start=0.0, every_s=30.0, attempt=1, learner=0):
    """One sample every `every_s` from `start` minutes, with these GPU utilisations (None: no reading)."""
    for n, value in enumerate(utilisations):
        ResourceSample.objects.create(
            job=target, attempt=attempt, learner=learner, time=at(start) + timedelta(seconds=n * every_s),
            cpu_cores=0.1, memory_bytes=1, memory_peak_bytes=1,
            gpus=[] if value is None else [{"index": 0, "utilization": value}], gpu_utilization=value)


@pytest.mark.parametrize("reading, expected", [
    (idle.Reading(latest=at(5), oldest=at(0)), at(0)),  # idle all along, for the window exactly
    (idle.Reading(latest=at(4.9), oldest=at(0)), None),  # not for long enough yet
    (idle.Reading(latest=at(8), oldest=at(0), last_busy=at(3), first_idle=at(3.5)), None),
    (idle.Reading(latest=at(9), oldest=at(0), last_busy=at(3), first_idle=at(4)), at(4)),
    (idle.Reading(latest=at(9), oldest=at(0), last_busy=at(9)), None),  # the newest sample is busy
])
def test_it_measures_the_quiet_from_the_first_sample_after_the_last_busy_one(reading, expected):
    assert idle.idle_since(reading, window=5 * MIN) == expected


def test_it_flags_a_job_whose_gpus_stayed_idle_for_the_window_and_sends_the_event(sent, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    alice = member()
    policy(alice)
    Webhook.objects.create(tenant=alice.tenant, user=None, url="http://127.0.0.1:9/t", sealed_secret="x",
                           created_by="root", format="json")
    quiet, busy, unmeasured, short = running(alice), running(alice), running(alice), running(alice)
    samples(quiet, [95.0, 90.0] + [3.0] * 11)  # busy, then quiet from minute 1 to minute 6
    samples(busy, [2.0] * 11 + [60.0])
    samples(unmeasured, [None] * 13)
    samples(short, [1.0] * 5)  # quiet for two minutes only
    assert idle.run(now=at(6.5)) == [quiet.id]
    quiet.refresh_from_db()
    assert quiet.gpus_idle == at(1) and quiet.status == Status.PROCESSING  # flag only: it keeps running
    delivery = Delivery.objects.get(event="GPUS_IDLE")
    assert delivery.job_id == quiet.id
    assert delivery.payload["idle"] == {"since": at(1).isoformat(), "below_percent": 10.0, "minutes": 5.0,
                                        "action": "flag"}
    assert ("deliver_webhook", (delivery.pk,)) in sent
    assert idle.run(now=at(7)) == []  # once per attempt
    assert Delivery.objects.filter(event="GPUS_IDLE").count() == 1
    assert client_for(alice).get(f"/api/v1/jobs/{quiet.id}/").json()["gpus_idle_since"] is not None
    assert client_for(alice).get(f"/api/v1/jobs/{busy.id}/").json()["gpus_idle_since"] is None


def test_a_halt_policy_halts_the_job_through_its_checkpoint(sent):
    alice = member()
    policy(alice, action="halt")
    quiet, busy = running(alice), running(alice)
    samples(quiet, [0.0] * 12)
    samples(busy, [85.0] * 12)
    assert idle.run(now=at(6)) == [quiet.id]
    quiet.refresh_from_db()
    busy.refresh_from_db()
    assert quiet.status == Status.HALTING and "idle GPUs below 10% for 5 min" in quiet.status_reason
    assert JobEvent.objects.get(job=quiet, to_status=Status.HALTING).actor == idle.ACTOR
    assert FollowUp.objects.filter(job=quiet, kind=FollowUp.Kind.HALT).exists()  # the learners checkpoint and stop
    assert busy.status == Status.PROCESSING and busy.gpus_idle is None


def test_a_flagged_job_is_halted_on_a_later_pass_when_the_first_stopped_short(sent, monkeypatch):
    alice = member()
    policy(alice, action="halt")
    quiet = running(alice)
    samples(quiet, [0.0] * 12)
    monkeypatch.setattr(idle, "_halt", lambda job, policy: None)  # the pass died between flag and halt
    idle.run(now=at(6))
    monkeypatch.undo()
    record_sends(monkeypatch)
    idle.run(now=at(6.2))
    quiet.refresh_from_db()
    assert quiet.status == Status.HALTING


def test_a_flagged_job_that_works_again_loses_its_flag(sent):
    alice = member()
    policy(alice)
    target = running(alice)
    samples(target, [0.0] * 12)
    idle.run(now=at(6))
    samples(target, [70.0], start=6)
    idle.run(now=at(6.5))
    target.refresh_from_db()
    assert target.gpus_idle is None


def test_only_the_current_attempt_and_the_policys_tenant_count(sent):
    alice, eve = member(), member("team-b", "eve")
    policy(alice)
    again = running(alice, attempt=2)
    samples(again, [0.0] * 12, attempt=1)  # the attempt before: not this one's idleness
    samples(again, [0.0] * 3, start=5, attempt=2)
    elsewhere = running(eve)
    samples(elsewhere, [0.0] * 12)
    assert idle.run(now=at(6.5)) == []


def samples_read():
    """Rows of the samples' table this transaction has read so far (PostgreSQL's own count)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
                       "WHERE relname = %s", [ResourceSample._meta.db_table])
        return cursor.fetchone()[0]


def test_a_pass_reads_only_the_samples_stored_since_the_one_before(sent):
    """A tenant's admin may set a window of a week: reading all of it again every pass, for each of the
    tenant's running jobs, held the database and the pass (every tenant's) for as long as it took."""
    if connection.vendor != "postgresql":
        skip_or_fail("counts the rows PostgreSQL reads (set DATABASE_URL)")
    alice = member()
    policy(alice, minutes=7 * 24 * 60)
    target = running(alice)
    ResourceSample.objects.bulk_create([
        ResourceSample(job=target, time=at(n), cpu_cores=0.1, memory_bytes=1, memory_peak_bytes=1,
                       gpu_utilization=90.0 if n == 0 else 2.0) for n in range(2000)])  # a busy minute, then quiet
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {ResourceSample._meta.db_table}")  # as autovacuum would: plans by the real sizes
    idle.run(now=at(2000))
    samples(target, [2.0, 3.0], start=2000, every_s=60)
    before = samples_read()
    assert idle.run(now=at(2002)) == []
    assert samples_read() - before < 20
    samples(target, [1.0] * 3, start=7 * 24 * 60 + 2, every_s=60)
    assert idle.run(now=at(7 * 24 * 60 + 5)) == [target.id]  # still judged on the whole week
    target.refresh_from_db()
    assert target.gpus_idle == at(1)


def test_a_changed_policy_judges_the_samples_already_read_again(sent):
    alice = member()
    strict = policy(alice, below=1.0)
    target = running(alice)
    samples(target, [95.0] + [3.0] * 12)
    assert idle.run(now=at(6.5)) == []  # 3% is busy by this policy
    strict.below_percent = 10.0
    strict.save()
    assert idle.run(now=at(6.6)) == [target.id]
    target.refresh_from_db()
    assert target.gpus_idle == at(0.5)


def test_the_job_page_and_the_jobs_list_show_the_flag(sent):
    alice = member()
    policy(alice, action="halt")
    target = running(alice, name="sleepy")
    samples(target, [0.0] * 12)
    idle.run(now=at(6))
    client = logged_in(alice)
    page = client.get(f"/jobs/{target.id}/").content.decode()
    assert 'data-testid="gpus-idle"' in page and "below 10% for 5 min" in page and "halts such a job" in page
    assert 'data-testid="gpus-idle"' in client.get("/").content.decode()


def test_a_member_reads_the_policy_and_only_an_admin_sets_it():
    alice, root = member(), member(username="root", role="admin")
    assert client_for(alice).get("/api/v1/tenants/current/idle-gpus/").json() == {"policy": None}
    body = {"below_percent": 5, "minutes": 30, "action": "halt"}
    assert client_for(alice).put("/api/v1/tenants/current/idle-gpus/", body, format="json").status_code == 403
    response = client_for(root).put("/api/v1/tenants/current/idle-gpus/", body, format="json")
    assert response.status_code == 200, response.content
    assert response.json() == {"policy": {"below_percent": 5.0, "minutes": 30.0, "action": "halt"}}
    assert client_for(alice).get("/api/v1/tenants/current/idle-gpus/").json()["policy"]["action"] == "halt"
    assert AuditEntry.objects.filter(target_type="idle-gpu-policy", action="created").exists()
    refused = client_for(root).put("/api/v1/tenants/current/idle-gpus/", {"below_percent": 120, "minutes": 0,
                                                                            "action": "nap"}, format="json")
    assert refused.status_code == 400 and refused.json()["field"] == "below_percent"
    assert all(f"{name}:" in refused.json()["detail"] for name in ("below_percent", "minutes", "action"))
    assert client_for(root).delete("/api/v1/tenants/current/idle-gpus/").status_code == 204
    assert not IdleGpuPolicy.objects.exists()


def test_another_tenants_policy_is_not_seen():
    policy(member("team-b", "eve"), action="halt")
    assert client_for(member()).get("/api/v1/tenants/current/idle-gpus/").json() == {"policy": None}


def test_the_usage_page_shows_the_policy_and_its_admins_set_it_there():
    alice, root = member(), member(username="root", role="admin")
    assert "No idle-GPU policy" in logged_in(alice).get("/tenant/").content.decode()
    assert 'data-testid="idle-policy-form"' not in logged_in(alice).get("/tenant/").content.decode()
    assert logged_in(alice).post("/tenant/idle-gpus/", {"below_percent": 5, "minutes": 30,
                                                        "action": "halt"}).status_code == 403
    admin = logged_in(root)
    assert 'data-testid="idle-policy-form"' in admin.get("/tenant/").content.decode()
    saved = admin.post("/tenant/idle-gpus/", {"below_percent": "5", "minutes": "30", "action": "halt"}, follow=True)
    assert IdleGpuPolicy.objects.get().as_dict() == {"below_percent": 5.0, "minutes": 30.0, "action": "halt"}
    assert "Idle-GPU policy saved" in saved.content.decode()
    page = logged_in(alice).get("/tenant/").content.decode()
    assert "below\n      5% utilisation for 30 min" in page and "halted through its checkpoint" in page
    refused = admin.post("/tenant/idle-gpus/", {"below_percent": "500", "minutes": "30", "action": "flag"}, follow=True)
    assert "unchanged: below_percent:" in refused.content.decode()
    assert IdleGpuPolicy.objects.get().below_percent == 5.0
    admin.post("/tenant/idle-gpus/", {"remove": "1"})
    assert not IdleGpuPolicy.objects.exists()
    assert AuditEntry.objects.filter(target_type="idle-gpu-policy").count() == 2  # created, deleted
