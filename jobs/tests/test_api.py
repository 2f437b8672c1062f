"""REST API behaviour that needs no running worker (the end-to-end tests cover the rest)."""
import os

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, LogLine
from tests.support.builders import MANIFEST, client_for, job, member, tar_gz, upload, zip_bytes

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    return member("team-a", "alice")


def submit(client, manifest=MANIFEST, code=None):
    code = code if code is not None else tar_gz({"run.sh": b"echo hi\n"})
    return client.post("/api/v1/jobs/", {"manifest": upload(manifest, "manifest.yml"), "code": upload(code)},
                       format="multipart")


def test_it_accepts_a_job_and_queues_it(alice, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = submit(client_for(alice))
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["id"].startswith("training-") and body["status"] == "QUEUED"
    assert Job.objects.get(pk=body["id"]).events.get().to_status == "QUEUED"
    # Only after commit: the job's folder is its own (no longer staged), the scheduling loop is woken,
    # and the new job is published to the jobs list's sockets.
    assert len(callbacks) == 3


def test_the_answer_to_a_submission_is_the_job_as_read_back_without_asking_for_what_it_cannot_have_yet(
        alice, django_assert_num_queries):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    client = client_for(alice)
    with CaptureQueriesContext(connection) as captured:
        body = submit(client).json()
    tables = " ".join(query["sql"] for query in captured.captured_queries)
    assert "jobs_metricpoint" not in tables and "tenants_usagerecord" not in tables
    again = client.get(f"/api/v1/jobs/{body['id']}/").json()
    assert body["latest_metrics"] == again["latest_metrics"] == {}
    assert body["usage"] == again["usage"] == {"gpu_hours": 0.0, "cpu_hours": 0.0, "seconds": 0.0}
    assert body == again


def test_it_rejects_a_bad_field_with_400_naming_it(alice):
    response = submit(client_for(alice), manifest=MANIFEST.replace(b"memory: 1GiB", b"memory: 1 lots"))
    assert response.status_code == 400
    assert response.json()["field"] == "memory"
    assert "memory" in response.json()["detail"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("code, words", [
    (tar_gz({"../evil.sh": b"x"}), ".."),
    (zip_bytes({"../../etc/cron.d/x": b"x"}), ".."),
    (zip_bytes({"/abs/path": b"x"}), "abs"),
    (b"not an archive at all", "archive"),
])
def test_it_refuses_malicious_or_broken_archives(alice, code, words):
    response = submit(client_for(alice), code=code)
    assert response.status_code == 400, response.json()
    assert response.json()["field"] == "code"
    assert not Job.objects.exists()


@pytest.mark.parametrize("code", [tar_gz({}), zip_bytes({}), zip_bytes({"src/": b"", "src/pkg/": b""})],
                         ids=["empty tar.gz", "empty zip", "folders only"])
def test_it_refuses_an_archive_without_files(alice, code):
    response = submit(client_for(alice), code=code)
    assert response.status_code == 400, response.json()
    assert response.json()["field"] == "code"
    assert "holds no files" in response.json()["detail"]
    assert not Job.objects.exists()


def test_it_refuses_an_archive_over_the_size_limit(alice, settings):
    settings.MAX_CODE_BYTES = 1024
    response = submit(client_for(alice), code=tar_gz({"big.bin": os.urandom(4096)}))
    assert response.status_code == 413
    assert response.json()["field"] == "code"


def test_it_refuses_an_archive_that_unpacks_too_big(alice, settings):
    settings.MAX_UNPACKED_BYTES = 1024 * 1024
    response = submit(client_for(alice), code=zip_bytes({"zeros.bin": b"\0" * (5 * 1024 * 1024)}))
    assert response.status_code == 400
    assert response.json()["field"] == "code"


def test_it_needs_a_token():
    assert APIClient().get("/api/v1/jobs/").status_code in (401, 403)
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token nope")
    assert bad.get("/api/v1/jobs/").status_code == 401


def test_viewers_cannot_submit_or_terminate():
    viewer = member("team-a", "victor", role="viewer")
    client = client_for(viewer)
    assert submit(client).status_code == 403
    theirs = job(member("team-a", "alice"))
    assert client.post(f"/api/v1/jobs/{theirs.id}/terminate/").status_code == 403


@pytest.mark.parametrize("suffix", ["", "events/", "logs/", "metrics/", "allocations/", "artifacts/",
                                    "artifacts/results/x", "share/", "POST halt/", "POST resume/", "POST terminate/", "POST share/",
                                    "DELETE share/alice/"])
def test_outsiders_get_404_for_another_tenants_job(alice, suffix):
    secret = job(alice)
    LogLine.objects.create(job=secret, seq=1, stream="stdout", time=secret.created_at, line="secret")
    outsider = client_for(member("team-b", "bob", role="admin"))
    verb, _, suffix = suffix.rpartition(" ")
    method = {"POST": outsider.post, "DELETE": outsider.delete}.get(verb, outsider.get)
    response = method(f"/api/v1/jobs/{secret.id}/{suffix}")
    assert response.status_code == 404
    assert b"secret" not in response.content
    assert outsider.get("/api/v1/jobs/").json()["count"] == 0


def test_it_pages_logs_by_seq(alice):
    target = job(alice)
    LogLine.objects.bulk_create(LogLine(job=target, seq=i, stream="stdout", time=target.created_at, line=f"l{i}")
                                for i in range(1, 11))
    body = client_for(alice).get(f"/api/v1/jobs/{target.id}/logs/?since=4&limit=3").json()
    assert [x["seq"] for x in body["results"]] == [5, 6, 7]
    assert body["next_since"] == 7 and body["final"] is False


def test_terminate_is_refused_with_409_for_a_finished_job(alice):
    done = job(alice, status="COMPLETED")
    response = client_for(alice).post(f"/api/v1/jobs/{done.id}/terminate/")
    assert response.status_code == 409
    assert "COMPLETED" in response.json()["detail"]


def test_it_names_the_tenant_with_a_header():
    both = member("team-a", "carol")
    member("team-b", "carol")
    theirs = job(member("team-b", "bob"))
    client = client_for(both)
    assert client.get(f"/api/v1/jobs/{theirs.id}/", HTTP_X_TRAINYARD_TENANT="team-b").status_code == 200
    assert client.get(f"/api/v1/jobs/{theirs.id}/", HTTP_X_TRAINYARD_TENANT="team-a").status_code == 404
    assert client.get("/api/v1/jobs/", HTTP_X_TRAINYARD_TENANT="team-c").status_code == 403


def test_it_publishes_an_openapi_schema_and_offline_docs(alice):
    client = client_for(alice)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    assert "/api/v1/jobs/{job_id}/logs/" in schema.json()["paths"]
    docs = client.get("/api/docs/")
    assert docs.status_code == 200 and b"/static/drf_spectacular_sidecar/" in docs.content


@pytest.mark.parametrize("action, status", [("halt", "COMPLETED"), ("resume", "PROCESSING"), ("halt", "QUEUED")])
def test_halt_and_resume_answer_409_when_not_allowed(alice, action, status):
    target = job(alice, status=status)
    response = client_for(alice).post(f"/api/v1/jobs/{target.id}/{action}/")
    assert response.status_code == 409
    assert status in response.json()["detail"]


def test_a_jobs_artifacts_come_in_pages_with_a_link_to_the_next(alice):
    from jobs.models import Artifact
    target = job(alice)
    names = [f"results/part-{i:02d}" for i in range(5)] + ["checkpoints/epoch-1.pt"]
    Artifact.objects.bulk_create(Artifact(job=target, name=name, kind="result", size=1, sha256="0" * 64)
                                 for name in names)
    client, seen, pages = client_for(alice), [], 0
    url = f"/api/v1/jobs/{target.id}/artifacts/?limit=4"
    while url:
        body = client.get(url).json()
        assert body["count"] == 6 and len(body["results"]) <= 4
        seen += [a["name"] for a in body["results"]]
        url, pages = body["next"], pages + 1
    assert seen == sorted(names) and pages == 2
    first = client.get(f"/api/v1/jobs/{target.id}/artifacts/").json()  # 200 a page by default
    assert len(first["results"]) == 6 and first["next"] is None


def test_a_jobs_artifacts_of_some_kinds_come_in_pages_of_their_own(alice):
    from jobs.models import Artifact
    target = job(alice)
    files = {f"results/part-{i}": "result" for i in range(3)}
    files.update({"checkpoints/a.pt": "checkpoint", "checkpoints/b.pt": "checkpoint", "logs/learner-0.log": "log"})
    Artifact.objects.bulk_create(Artifact(job=target, name=name, kind=kind, size=1, sha256="0" * 64)
                                 for name, kind in files.items())
    client = client_for(alice)

    def names(kind):
        seen, url = [], f"/api/v1/jobs/{target.id}/artifacts/?limit=2&kind={kind}"
        while url:
            body = client.get(url).json()
            assert body["count"] == sum(k in kind.split(",") for k in files.values())
            seen, url = seen + [a["name"] for a in body["results"]], body["next"]
        return seen

    assert names("result") == ["results/part-0", "results/part-1", "results/part-2"]
    assert names("checkpoint,log") == ["checkpoints/a.pt", "checkpoints/b.pt", "logs/learner-0.log"]


@pytest.mark.parametrize("query, field", [("limit=0", "limit"), ("limit=1001", "limit"), ("limit=x", "limit"),
                                          ("after=a%00b", "after"), ("after=" + "x" * 501, "after"),
                                          ("kind=results", "kind"), ("kind=result,x", "kind")])
def test_artifact_pages_refuse_parameters_they_cannot_read(alice, query, field):
    response = client_for(alice).get(f"/api/v1/jobs/{job(alice).id}/artifacts/?{query}")
    assert response.status_code == 400 and response.json()["field"] == field


def test_a_jobs_metrics_come_a_page_at_a_time(alice):
    from django.utils import timezone

    from jobs.api import MAX_METRIC_LIMIT
    from jobs.models import MetricPoint
    target = job(alice)
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=target, name="loss" if i % 2 else "acc", value=i, step=i,
                                                 time=now) for i in range(MAX_METRIC_LIMIT + 5)])
    client, path = client_for(alice), f"/api/v1/jobs/{target.id}/metrics/"
    first = client.get(path).json()
    assert len(first["results"]) == MAX_METRIC_LIMIT and first["more"] is True
    rest = client.get(path, {"after": first["next_after"]}).json()
    assert [p["step"] for p in rest["results"]] == list(range(MAX_METRIC_LIMIT, MAX_METRIC_LIMIT + 5))
    assert rest["more"] is False and rest["next_after"] > first["next_after"]
    loss = client.get(path, {"name": "loss", "limit": 3}).json()
    assert [p["step"] for p in loss["results"]] == [1, 3, 5] and loss["more"] is True
    assert client.get(path, {"limit": MAX_METRIC_LIMIT + 1}).status_code == 400


@pytest.mark.django_db(transaction=True)
def test_an_artifact_is_downloaded_a_piece_at_a_time_not_read_whole_first(alice, monkeypatch):
    """A checkpoint may be gigabytes: the web process sends it as it reads it, so however many are
    downloaded at once it never holds one whole (Django reads a file response whole first under ASGI)."""
    from jobs import storage
    from jobs.models import Artifact
    from tests.support.asgi import serve_get
    from tests.support.builders import token_for
    target = job(alice)
    stored = storage.job_dir("team-a", target.id) / "checkpoints" / "model.pt"
    stored.parent.mkdir(parents=True)
    content = os.urandom(8 * 2**20)
    stored.write_bytes(content)
    Artifact.objects.create(job=target, name="checkpoints/model.pt", kind="checkpoint", size=len(content),
                            sha256="0" * 64)
    opened, read_at_first_send = [], []
    real_open = storage.open_artifact
    monkeypatch.setattr(storage, "open_artifact", lambda *args: opened.append(real_open(*args)) or opened[-1])

    def on_body(chunk):
        if not read_at_first_send:
            read_at_first_send.append(opened[0].tell())
    status, body = serve_get(f"/api/v1/jobs/{target.id}/artifacts/checkpoints/model.pt",
                             headers=[(b"authorization", f"Token {token_for(alice)}".encode())], on_body=on_body)
    assert status == 200 and body == content
    assert read_at_first_send[0] <= 2 * 2**20
