"""The dashboard's server side without a browser: pages, listing, manifest validation, cluster, assets."""
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import Job, LogLine
from portal import assets
from tests.support.asgi import streamed
from tests.support.builders import job, logged_in, member, token_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    return member("team-a", "alice")


def api_for(membership):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(membership)}")
    return client


def many_jobs(membership, count, **fields):
    base = timezone.now()
    return Job.objects.bulk_create([
        Job(tenant=membership.tenant, owner=membership.user, name=f"job-{i:04d}", framework="pytorch",
            manifest={}, manifest_yaml="", memory_bytes=2**30, code_sha256="0" * 64,
            created_at=base - timedelta(seconds=i), **fields) for i in range(count)])


def rows(html):
    return html.count('<tr data-job-id="')


def test_it_pages_the_job_list_with_keyset_cursors_both_ways(alice):
    many_jobs(alice, 120)
    client = logged_in(alice)
    first = client.get("/")
    assert first.status_code == 200 and rows(first.content.decode()) == 50
    assert "job-0000" in first.content.decode() and "120 jobs" in first.content.decode()
    after = first.context["page"].after_cursor
    second = client.get("/", {"after": after})
    names = [j.name for j in second.context["page"].rows]
    assert names[0] == "job-0050" and names[-1] == "job-0099"
    back = client.get("/", {"before": second.context["page"].before_cursor})
    assert [j.name for j in back.context["page"].rows] == [f"job-{i:04d}" for i in range(50)]
    assert not back.context["page"].has_before
    third = client.get("/", {"after": second.context["page"].after_cursor})
    assert len(third.context["page"].rows) == 20 and not third.context["page"].has_after


def test_it_filters_and_sorts_the_job_list(alice):
    many_jobs(alice, 5)
    many_jobs(alice, 2, status="FAILED")
    Job.objects.filter(name="job-0003", status="QUEUED").update(framework="jax")
    client = logged_in(alice)
    assert rows(client.get("/", {"status": "FAILED"}).content.decode()) == 2
    assert [j.name for j in client.get("/", {"framework": "jax"}).context["page"].rows] == ["job-0003"]
    assert [j.name for j in client.get("/", {"q": "0004"}).context["page"].rows] == ["job-0004"]
    by_name = [j.name for j in client.get("/", {"sort": "name", "status": "QUEUED"}).context["page"].rows]
    assert by_name == sorted(by_name)
    assert client.get("/", {"user": "nobody"}).context["page"].rows == []


def test_it_names_a_bad_filter_instead_of_guessing(alice):
    response = logged_in(alice).get("/", {"status": "RUNNING"})
    assert response.status_code == 400 and "&#x27;RUNNING&#x27; is not a job status" in response.content.decode()
    api = api_for(alice).get("/api/v1/jobs/", {"sort": "size"})
    assert api.status_code == 400 and api.json()["field"] == "sort"


def test_it_answers_htmx_with_the_results_only(alice):
    many_jobs(alice, 3)
    response = logged_in(alice).get("/", HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="jobs-results"') and "<html" not in html


def test_the_api_list_filters_by_framework_and_text(alice):
    many_jobs(alice, 3)
    Job.objects.filter(name="job-0001").update(framework="sklearn")
    body = api_for(alice).get("/api/v1/jobs/", {"framework": "sklearn"}).json()
    assert [j["name"] for j in body["results"]] == ["job-0001"]
    assert api_for(alice).get("/api/v1/jobs/", {"q": "job-000"}).json()["count"] == 3


def test_an_outsider_sees_none_of_the_tenants_jobs_on_any_page(alice):
    mine = job(alice)
    outsider = logged_in(member("team-b", "mallory"))
    assert mine.id not in outsider.get("/").content.decode()
    assert outsider.get(f"/jobs/{mine.id}/").status_code == 404
    assert outsider.get(f"/jobs/{mine.id}/log.txt").status_code == 404


def test_it_validates_a_manifest_by_the_submit_rules(alice):
    api = api_for(alice)
    ok = api.post("/api/v1/manifests/validate/", {"manifest": "name: x\nlearners: 2\ngpus: 1\nmemory: 1GiB\n"
                  "framework: {name: pytorch, command: python t.py}\n"}, format="json")
    assert ok.status_code == 200 and ok.json()["manifest"]["total_gpus"] == 2
    bad = api.post("/api/v1/manifests/validate/", {"manifest": "name: x\nmemory: 4XB\n"
                   "framework: {name: pytorch, command: python t.py}\n"}, format="json")
    assert bad.status_code == 400
    assert bad.json() == {"field": "memory", "detail": "memory: '4XB' is not a memory size; write a number and a "
                          "unit: MB, GB, TB (or M, G, T) count in 1000s, MiB, GiB, TiB (or Mi, Gi, Ti) in 1024s "
                          "(e.g. 4GiB)"}
    several = api.post("/api/v1/manifests/validate/", {"manifest": "name: x\ngpu: 1\nlearners: 0\n"
                       "framework: {name: pytorch, command: python t.py}\n"}, format="json")
    assert several.status_code == 400
    assert several.json() == {"field": "gpu", "detail": "2 problems: gpu: unknown field; did you mean 'gpus'?; "
                              "learners: 0 is outside 1..64"}
    assert api.post("/api/v1/manifests/validate/", {}, format="json").json()["field"] == "manifest"
    assert Job.objects.count() == 0


def test_the_submit_page_submits_an_example_and_shows_errors_in_place(alice, settings):
    client = logged_in(alice)
    page = client.get("/submit/", {"example": "custom-shell"})
    assert "bash run.sh" in page.content.decode()
    bad = client.post("/submit/", {"manifest": "name: x\n", "example": "custom-shell"})
    assert bad.status_code == 400 and "framework" in bad.content.decode() and Job.objects.count() == 0
    manifest = page.context["manifest_text"]
    done = client.post("/submit/", {"manifest": manifest, "example": "custom-shell"})
    created = Job.objects.get()
    assert done.status_code == 302 and done["Location"] == f"/jobs/{created.id}/"
    assert created.name == "custom-shell" and created.code_bytes > 0
    no_code = client.post("/submit/", {"manifest": manifest})
    assert no_code.status_code == 400 and "a code archive" in no_code.content.decode()


def test_the_log_download_is_the_whole_log_in_order(alice):
    mine = job(alice)
    now = timezone.now()
    LogLine.objects.bulk_create([LogLine(job=mine, seq=i, stream="stderr" if i == 7 else "stdout", time=now,
                                         line=f"line {i}") for i in range(1, 12001)])
    response = logged_in(alice).get(f"/jobs/{mine.id}/log.txt")
    text = streamed(response).decode().splitlines()
    assert len(text) == 12000 and text[0].endswith(" line 1") and text[-1].endswith(" line 12000")
    assert text[6].endswith(" E line 7")


def test_the_cluster_names_only_the_callers_own_jobs(alice):
    ours = job(alice, status="PROCESSING")
    ours.placement = [{"node": "local", "gpu_ids": [0]}]
    ours.save()
    theirs = job(member("team-b", "bob"), status="PROCESSING")
    theirs.placement = [{"node": "local", "gpu_ids": [1]}]
    theirs.save()
    body = api_for(alice).get("/api/v1/cluster/").json()
    named = [j["id"] for n in body["nodes"] for j in n["my_jobs"]]
    assert named == [ours.id] and body["gpus_used"] == 2
    assert logged_in(alice).get("/cluster/").status_code == 200
    assert logged_in(alice).get("/tenant/").status_code == 200


def test_the_committed_browser_libraries_match_the_lockfile():
    assert assets.check() == []


@pytest.mark.django_db(transaction=True)
def test_the_log_download_is_sent_a_batch_at_a_time_not_read_whole_first(alice, monkeypatch):
    """A log may hold millions of lines: each batch goes out before the next is read, so a download
    never holds the whole log in the web process (Django reads a streamed answer whole first under ASGI)."""
    from django.db.backends.signals import connection_created

    from portal import views
    from tests.support.asgi import serve_get
    monkeypatch.setattr(views, "LOG_DOWNLOAD_BATCH", 10)
    mine = job(alice)
    now = timezone.now()
    LogLine.objects.bulk_create([LogLine(job=mine, seq=i, stream="stdout", time=now, line=f"line {i}")
                                 for i in range(1, 101)])
    session = logged_in(alice).cookies["sessionid"].value
    batches_read, read_at_first_send = [], []

    def count_batches(execute, sql, params, many, context):
        if LogLine._meta.db_table in sql:
            batches_read.append(sql)
        return execute(sql, params, many, context)

    def watch(sender, connection, **kwargs):  # the request's thread opens a connection of its own
        connection.execute_wrappers.append(count_batches)

    def on_body(chunk):
        if not read_at_first_send:
            read_at_first_send.append(len(batches_read))
    connection_created.connect(watch)
    try:
        status, body = serve_get(f"/jobs/{mine.id}/log.txt", headers=[(b"cookie", f"sessionid={session}".encode())],
                                 on_body=on_body)
    finally:
        connection_created.disconnect(watch)
    assert status == 200 and len(body.decode().splitlines()) == 100
    assert len(batches_read) == 11 and read_at_first_send[0] <= 2
