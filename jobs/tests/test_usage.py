"""Allocated against used (jobs.usage): GPU- and CPU-hours per tenant, user and job for a period, from
the usage records and the resource samples, through the API, as CSV and on the usage page; another
tenant's jobs never count, and job rows are only those the member may see."""
import csv
import io
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import ResourceSample
from tenants.models import UsageRecord
from tests.support.builders import client_for, job, logged_in, member

pytestmark = pytest.mark.django_db
T0 = timezone.now().replace(microsecond=0) - timedelta(days=2)
URL = "/api/v1/tenants/current/usage/"


def held(target, *, gpus, cpus, hours, start=T0):
    UsageRecord.objects.create(tenant=target.tenant, job=target, user=target.owner, attempt=1, gpus=gpus, cpus=cpus,
                               memory_bytes=2**30, started_at=start, ended_at=start + timedelta(hours=hours))


def sampled(target, *, cores, gpus_busy, minutes, start=T0, learner=0):
    """A sample a minute, each for the minute before it."""
    for n in range(1, minutes + 1):
        ResourceSample.objects.create(job=target, attempt=1, learner=learner, time=start + timedelta(minutes=n),
                                      cpu_cores=cores, memory_bytes=1, memory_peak_bytes=1, gpus_busy=gpus_busy,
                                      gpu_utilization=None if gpus_busy is None else 50.0)


@pytest.fixture
def tenant_jobs():
    alice, bob, eve = member(username="alice"), member(username="bob"), member("team-b", "eve")
    trained = job(alice, name="trained", gpus=2, cpus=4)
    held(trained, gpus=2, cpus=4, hours=1)
    sampled(trained, cores=2.0, gpus_busy=1.0, minutes=60)  # two GPUs at 50%, two of four cores
    unmeasured = job(bob, name="=HYPERLINK(1)", gpus=1, private=True)
    held(unmeasured, gpus=1, cpus=1, hours=2)
    sampled(unmeasured, cores=0.5, gpus_busy=None, minutes=120)  # no NVML: GPU use unknown
    elsewhere = job(eve, gpus=8)
    held(elsewhere, gpus=8, cpus=8, hours=1)
    sampled(elsewhere, cores=8.0, gpus_busy=8.0, minutes=60)
    return alice, bob, trained, unmeasured


def period():
    return {"start": (T0 - timedelta(hours=1)).isoformat(), "end": (T0 + timedelta(hours=5)).isoformat()}


def test_it_reports_allocated_and_used_per_job_user_and_tenant(tenant_jobs):
    alice, bob, trained, unmeasured = tenant_jobs
    body = client_for(bob).get(URL, period()).json()
    jobs = {row["job"]: row for row in body["jobs"]}
    assert jobs[trained.id] == {"job": trained.id, "name": "trained", "user": "alice", "deleted": False,
                                "allocated_gpu_hours": 2.0, "used_gpu_hours": 1.0, "allocated_cpu_hours": 4.0,
                                "used_cpu_hours": 2.0}
    assert jobs[unmeasured.id]["used_gpu_hours"] is None and jobs[unmeasured.id]["used_cpu_hours"] == 1.0
    assert body["tenant"] == {"tenant": "team-a", "allocated_gpu_hours": 4.0, "used_gpu_hours": 1.0,
                              "allocated_cpu_hours": 6.0, "used_cpu_hours": 3.0, "unmeasured_gpu_hours": 2.0}
    assert [(u["user"], u["allocated_gpu_hours"], u["used_gpu_hours"]) for u in body["users"]] == [
        ("alice", 2.0, 1.0), ("bob", 2.0, None)]


def test_job_rows_are_only_the_jobs_the_member_may_see_and_totals_are_everyones(tenant_jobs):
    alice, bob, trained, unmeasured = tenant_jobs
    body = client_for(alice).get(URL, period()).json()
    assert [row["job"] for row in body["jobs"]] == [trained.id]  # bob's job is private
    assert body["tenant"]["allocated_gpu_hours"] == 4.0  # another tenant's 8 GPUs never count


def test_a_deleted_jobs_row_stays_marked_so_the_rows_add_up_to_the_totals(tenant_jobs):
    """Deleting a job keeps what it held in the totals (its usage records stay); its row went from the
    report, so a member's job rows summed to less than the tenant's. Those who could see it keep its
    row, marked deleted, on the page, in the API and in the CSV; others' private jobs stay hidden."""
    from jobs import deletion
    from jobs.models import Job
    alice, bob, trained, unmeasured = tenant_jobs
    Job.objects.filter(pk=trained.pk).update(status="COMPLETED")
    deletion.delete(Job.objects.get(pk=trained.pk), actor="alice")
    body = client_for(alice).get(URL, period()).json()
    assert [(row["job"], row["deleted"]) for row in body["jobs"]] == [(trained.id, True)]
    assert body["tenant"]["allocated_gpu_hours"] == 4.0
    admin = client_for(member(username="root", role="admin")).get(URL, period()).json()
    assert sum(row["allocated_gpu_hours"] for row in admin["jobs"]) == admin["tenant"]["allocated_gpu_hours"]
    rows = list(csv.DictReader(io.StringIO(client_for(alice).get(URL + "csv/", {**period(), "by": "job"})
                                           .content.decode())))
    assert [(row["job"], row["deleted"]) for row in rows] == [(trained.id, "true")]
    start = timezone.localtime(T0).date().isoformat()
    page = logged_in(alice).get("/tenant/", {"start": start, "end": start}).content.decode()
    assert f'data-job="{trained.id}"' in page and "(deleted)" in page and f'href="/jobs/{trained.id}/"' not in page


def test_the_period_cuts_what_was_held_and_used(tenant_jobs):
    alice, bob, trained, unmeasured = tenant_jobs
    half = {"start": T0.isoformat(), "end": (T0 + timedelta(minutes=30, seconds=30)).isoformat()}
    row = next(r for r in client_for(alice).get(URL, half).json()["jobs"] if r["job"] == trained.id)
    assert row["allocated_gpu_hours"] == pytest.approx(2 * 30.5 / 60, abs=1e-3)
    assert row["used_cpu_hours"] == pytest.approx(2.0 * 30 / 60, abs=1e-3)  # 30 samples of a minute each


@pytest.mark.parametrize("query, field", [({"start": "yesterday"}, "start"),
                                          ({"start": "2026-11-02", "end": "2026-11-01"}, "end"),
                                          ({"start": "2020-01-01", "end": "2026-01-01"}, "end"),
                                          ({"start": "9999-12-01", "end": "9999-12-31"}, "start"),
                                          ({"start": "2026-11-01T00:00-20:00", "end": "2026-11-02"}, "start")])
def test_a_period_that_makes_no_sense_is_refused_by_name(query, field):
    response = client_for(member()).get(URL, query)
    assert response.status_code == 400 and response.json()["field"] == field


def test_it_exports_csv_by_job_and_by_user(tenant_jobs):
    alice, bob, trained, unmeasured = tenant_jobs
    response = client_for(bob).get(URL + "csv/", {**period(), "by": "job"})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    by_job = {row["job"]: row for row in rows}
    assert by_job[trained.id]["used_gpu_hours"] == "1.0" and by_job[trained.id]["allocated_cpu_hours"] == "4.0"
    assert by_job[unmeasured.id]["name"] == "'=HYPERLINK(1)" and by_job[unmeasured.id]["used_gpu_hours"] == ""
    users = list(csv.DictReader(io.StringIO(client_for(bob).get(URL + "csv/", {**period(), "by": "user"})
                                            .content.decode())))
    assert [(u["user"], u["used_cpu_hours"]) for u in users] == [("alice", "2.0"), ("bob", "1.0")]
    assert client_for(bob).get(URL + "csv/", {"by": "team"}).status_code == 400


def test_the_usage_page_shows_allocated_and_used(tenant_jobs):
    alice, bob, trained, unmeasured = tenant_jobs
    start = timezone.localtime(T0).date().isoformat()
    page = logged_in(alice).get("/tenant/", {"start": start, "end": start}).content.decode()
    assert 'data-testid="usage-report"' in page and f'data-job="{trained.id}"' in page
    assert f'data-job="{unmeasured.id}"' not in page and 'data-user="bob"' in page
    assert "usage/csv/?start=" in page and "were not sampled" in page
    bad = logged_in(alice).get("/tenant/", {"start": "soon"}).content.decode()
    assert 'data-testid="usage-error"' in bad


def test_a_tenant_sums_a_bounded_number_of_usage_reports_at_once_and_others_are_not_held():
    # A long period's samples keep the shared database summing: a tenant that reloads its report many
    # times at once waits for its own, never for another tenant's.
    from tenants import throttling
    alice, mallory = member("team-a", "alice"), member("team-b", "mallory")
    limit = throttling.USAGE_REPORTS.limit
    holds = [throttling.slot(throttling.USAGE_REPORTS, alice.tenant_id) for _ in range(limit)]
    assert all(hold.__enter__() for hold in holds)
    try:
        for path in ("/api/v1/tenants/current/usage/", "/api/v1/tenants/current/usage/csv/"):
            busy = client_for(alice).get(path)
            assert busy.status_code == 429 and busy["Retry-After"] == "3", path
            assert "usage reports of this tenant" in busy.json()["detail"]
        page = logged_in(alice).get("/tenant/")
        assert page.status_code == 429 and b"usage reports of this tenant" in page.content
        assert client_for(mallory).get("/api/v1/tenants/current/usage/").status_code == 200
    finally:
        for hold in holds:
            hold.__exit__(None, None, None)
    assert client_for(alice).get("/api/v1/tenants/current/usage/").status_code == 200
