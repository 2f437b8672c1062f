"""What a tenant may put in the queue (jobs.submission, tenants.quotas.intake_of): submissions per
minute and jobs queued at once, from the platform's settings or the tenant's quota."""
import pytest

from jobs.models import Job, Status
from tenants import quotas
from tests.support.builders import MANIFEST, client_for, job, member, tar_gz, upload

pytestmark = pytest.mark.django_db


def submit(client):
    return client.post("/api/v1/jobs/", {"manifest": upload(MANIFEST, "manifest.yml"),
                                         "code": upload(tar_gz({"run.sh": b"echo hi\n"}))}, format="multipart")


def test_past_its_submissions_per_minute_a_tenant_gets_429_with_retry_after(settings):
    settings.SUBMITS_PER_MINUTE = 2
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    answers = [submit(client_for(alice)) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 201, 429]
    refused = answers[-1]
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused.json()["detail"].startswith(
        "too many submissions: tenant 'team-a' may submit 2 jobs per minute "
        "(the platform's TRAINYARD_SUBMITS_PER_MINUTE), at most 2 of them in any ten seconds; try again in ")
    assert Job.objects.filter(tenant=alice.tenant).count() == 2
    assert submit(client_for(bob)).status_code == 201  # counted per tenant


def test_a_refused_submission_is_answered_before_its_upload_is_parsed(settings, monkeypatch):
    """Refusals cost the web process no parsing: a tenant sending upload after upload past its rate
    (archive bombs, say) gets its 429s without a byte of them parsed."""
    from rest_framework.parsers import MultiPartParser
    settings.SUBMITS_PER_MINUTE = 1
    alice = member("team-a", "alice")
    assert submit(client_for(alice)).status_code == 201
    parsed = []
    original = MultiPartParser.parse
    monkeypatch.setattr(MultiPartParser, "parse", lambda self, *a, **k: parsed.append(1) or original(self, *a, **k))
    assert submit(client_for(alice)).status_code == 429
    assert parsed == []


def test_with_as_many_jobs_queued_as_it_may_a_tenant_gets_429(settings):
    settings.MAX_QUEUED_JOBS = 2
    alice = member("team-a", "alice")
    job(alice), job(alice), job(alice, status=Status.PENDING)
    response = submit(client_for(alice))
    assert response.status_code == 429 and "Retry-After" not in response
    assert response.json()["detail"] == (
        "too many queued jobs: tenant 'team-a' has 2 jobs queued, the most it may have (the platform's "
        "TRAINYARD_MAX_QUEUED_JOBS); submit again once some have started or been terminated")
    Job.objects.filter(tenant=alice.tenant, status=Status.QUEUED).update(status=Status.PENDING)
    assert submit(client_for(alice)).status_code == 201


def test_a_tenants_quota_sets_its_own_limits(settings):
    settings.MAX_QUEUED_JOBS = 100
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    quotas.set_quota(alice.tenant, queued_jobs=1, submissions_per_minute=5)
    assert submit(client_for(alice)).status_code == 201
    response = submit(client_for(alice))
    assert response.status_code == 429 and "(its quota's queued_jobs)" in response.json()["detail"]
    assert submit(client_for(bob)).status_code == 201
    summary = quotas.summary(alice.tenant)
    assert summary["intake"] == {"queued_jobs": 1, "submissions_per_minute": 5,
                                 "overridden": ["queued_jobs", "submissions_per_minute"]}
    assert summary["quota"]["queued_jobs"] == 1 and quotas.summary(bob.tenant)["quota"]["queued_jobs"] is None


def test_a_submission_past_the_queues_limit_leaves_nothing_stored(settings):
    """The queue is counted where the job is queued, under the tenant's lock: a refusal there removes
    the job's folder it had written (code, sealed credentials) and queues nothing."""
    from jobs import storage
    settings.MAX_QUEUED_JOBS = 1
    alice = member("team-a", "alice")
    assert submit(client_for(alice)).status_code == 201
    folders = set(storage.root().joinpath("team-a").iterdir())
    response = submit(client_for(alice))
    assert response.status_code == 429 and Job.objects.filter(tenant=alice.tenant).count() == 1
    assert set(storage.root().joinpath("team-a").iterdir()) == folders
    assert not list(storage.uploads_dir().iterdir())


def test_a_submission_counts_its_tenants_queue_once(settings):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    alice = member("team-a", "alice")
    with CaptureQueriesContext(connection) as queries:
        assert submit(client_for(alice)).status_code == 201
    assert sum(q["sql"].startswith("SELECT COUNT(*)") and '"jobs_job"' in q["sql"] for q in queries.captured_queries) == 1


def test_a_submission_reads_its_tenants_quota_once(settings):
    """admit() reads the quota; the disk caps and the queue check under the tenant's lock use it."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    quotas.Quota.objects.create(tenant=member("team-a", "alice").tenant, queued_jobs=5)
    with CaptureQueriesContext(connection) as queries:
        assert submit(client_for(member("team-a", "alice"))).status_code == 201
    assert sum('FROM "tenants_quota"' in q["sql"] for q in queries.captured_queries) == 1


def test_counting_a_tenants_queue_reads_an_index_of_queued_jobs_alone(settings):
    """The count every submission makes need not scan the rest of the tenant's jobs (their
    history, or those running) nor the table: PostgreSQL can answer it from job_queued_per_tenant."""
    from django.db import connection, transaction
    from tests.support.optional import skip_or_fail
    if connection.vendor != "postgresql":
        skip_or_fail("the partial index is PostgreSQL's (set DATABASE_URL)")
    alice = member("team-a", "alice")
    query = Job.objects.filter(tenant=alice.tenant, status=Status.QUEUED).values("pk")
    sql, params = query.query.sql_with_params()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN SELECT COUNT(*) FROM ({sql}) AS queued", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "job_queued_per_tenant" in plan, plan
