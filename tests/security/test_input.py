"""Bad input never crashes the web process or blows up in it (issue 12, finding 9): hostile manifests,
crafted cursors and out-of-range query parameters get a 400 naming what is wrong, nothing is stored, and
endpoints answer methods they do not take with 405. Runs in-process (the Django test client); a crash
would surface as the view's exception rather than a 500 page.
"""
import base64
import json

import pytest

from jobs.models import Job
from tests.support.bombs import billion_laughs
from tests.support.builders import MANIFEST, client_for, job, logged_in, member, tar_gz, upload

pytestmark = pytest.mark.django_db

BASE = "name: hostile\nframework: {name: custom, command: sh run.sh}\n"


@pytest.fixture
def alice():
    return member("team-a", "alice")


def submit(client, manifest):
    code = upload(tar_gz({"run.sh": b"echo hi\n"}))
    manifest = manifest.encode() if isinstance(manifest, str) else manifest
    return client.post("/api/v1/jobs/", {"manifest": upload(manifest, "manifest.yml"), "code": code},
                       format="multipart")


HOSTILE_MANIFESTS = {
    "memory-400-digits": (BASE + "memory: " + "9" * 400 + "GiB\n", "memory"),
    "memory-1e25-GiB": (BASE + "memory: 10000000000000000000000000GiB\n", "memory"),
    "memory-1e25GiB": (BASE + "memory: 1e25GiB\n", "memory"),
    "cpus-nan": (BASE + "cpus: .nan\n", "cpus"),
    "cpus-inf": (BASE + "cpus: .inf\n", "cpus"),
    "cpus-negative": (BASE + "cpus: -2\n", "cpus"),
    "gpus-400-digits": (BASE + "gpus: " + "9" * 400 + "\n", "gpus"),
    "learners-negative": (BASE + "learners: -1\n", "learners"),
    "grace-inf": (BASE + "checkpoint: {grace_seconds: .inf}\n", "checkpoint.grace_seconds"),
    "nested-nan": (BASE.replace("sh run.sh}", "sh run.sh, image_location: {x: .nan}}"),
                   "framework.image_location.x"),
    "flow-20000-deep": (BASE + "description: " + "[" * 20000 + "]" * 20000 + "\n", "manifest"),
    "block-20000-deep": (BASE + "description:\n" + "- " * 20000 + "x\n", "manifest"),
    "alias-bomb": (billion_laughs() + BASE, "manifest"),
    "alias-bomb-in-ignored-field": (
        BASE.replace("sh run.sh}", "sh run.sh, image_location: {a: &a [x, x, x, x, x, x, x, x, x], "
                                   "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a], c: [*b, *b, *b, *b, *b, *b]}}"),
        "manifest"),
    "oversized": (BASE + "description: " + "x" * 70_000 + "\n", "manifest"),
    "unknown-top-level-key": (BASE + "gpu: 1\n", "gpu"),
    "unknown-nested-key": (BASE + "restart_policy: {retries: 3}\n", "restart_policy.retries"),
    "impossible-date": (BASE + "version: 2001-02-30\n", "manifest"),
    "disk-1e30GiB": (BASE + "disk: {results: 1e30GiB}\n", "disk.results"),
    "disk-negative": (BASE + "disk: {checkpoints: -1MiB}\n", "disk.checkpoints"),
    "disk-nan": (BASE + "disk: {logs: .nan}\n", "disk.logs"),
    "disk-zero": (BASE + "disk: {work: 0MiB}\n", "disk.work"),
    "disk-23-digits": (BASE + "disk: {tmp: 99999999999999999999999GiB}\n", "disk.tmp"),
    "disk-lines-1e400": (BASE + "disk: {log_lines: 1e400}\n", "disk.log_lines"),
    "disk-unknown-key": (BASE + "disk: {resultz: 1GiB}\n", "disk.resultz"),
    "disk-not-a-mapping": (BASE + "disk: [1, 2]\n", "disk"),
    # A repeated key: YAML keeps the last, the credentials' redaction of the text read the first.
    "repeated-key": (BASE + "data_stores:\n- id: lake\n  type: s3\n  connection: {auth_url: 'https://s3.example.com'}\n"
                            "  connection: {auth_url: 'https://s3.example.com', user_name: a, password: s3cret}\n",
                     "manifest"),
    "nul-in-a-text": (BASE + 'description: "a\\0b"\n', "description"),
    "nul-in-a-key": (BASE.replace("sh run.sh}", 'sh run.sh, image_location: {"a\\0": 1}}'), "framework.image_location"),
}


@pytest.mark.parametrize("name", HOSTILE_MANIFESTS)
def test_it_refuses_hostile_manifests_with_400_naming_the_field(alice, name):
    manifest, field = HOSTILE_MANIFESTS[name]
    response = submit(client_for(alice), manifest)
    assert response.status_code == 400, response.content[:300]
    assert response.json()["field"] == field
    assert not Job.objects.exists()


@pytest.mark.parametrize("name", ["memory-400-digits", "cpus-nan", "flow-20000-deep", "alias-bomb", "repeated-key",
                                  "nul-in-a-text"])
def test_it_validates_hostile_manifests_without_crashing(alice, name):
    manifest, field = HOSTILE_MANIFESTS[name]
    response = client_for(alice).post("/api/v1/manifests/validate/", {"manifest": manifest}, format="json")
    assert response.status_code == 400 and response.json()["field"] == field


def test_an_alias_bomb_is_never_stored_blown_up(alice):
    """The finding: 413 bytes of YAML, in a field Trainyard ignores, became a 6.9 MB job record."""
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]" for previous, name in zip("abcd", "bcde")]
    manifest = BASE.replace("sh run.sh}", "sh run.sh, image_location: {" + ", ".join(levels) + "}}")
    assert len(manifest) < 600
    response = submit(client_for(alice), manifest)
    assert response.status_code == 400 and "anchor or alias" in response.json()["detail"]
    assert not Job.objects.exists()


def test_a_deeply_nested_json_body_is_a_400(alice):
    body = '{"manifest": ' + "[" * 50_000 + "]" * 50_000 + "}"
    response = client_for(alice).post("/api/v1/manifests/validate/", body, content_type="application/json")
    assert response.status_code == 400
    response = client_for(alice).post("/api/v1/tokens/", body, content_type="application/json")
    assert response.status_code == 400


def cursor(value):
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


CRAFTED_CURSORS = {
    "not-base64": "%%%not-base64",
    "not-json": base64.urlsafe_b64encode(b"\xff\xfe{").decode(),
    "dict": cursor({"a": 1, "b": 2}),
    "two-characters": cursor("ab"),
    "three-parts": cursor(["2024-01-01T00:00:00+00:00", "training-x", 3]),
    "number-value": cursor([10**30, "training-x"]),
    "list-value": cursor([[1, 2], "training-x"]),
    "not-a-time": cursor(["yesterday", "training-x"]),
    "naive-time": cursor(["2024-01-01T00:00:00", "training-x"]),
    "time-before-utc-exists": cursor(["0001-01-01T00:00:00+14:00", "training-x"]),
    "id-is-a-number": cursor(["2024-01-01T00:00:00+00:00", 10**40]),
    "deeply-nested": base64.urlsafe_b64encode(("[" * 100 + "]" * 100).encode()).decode(),
    "100000-deep": base64.urlsafe_b64encode(("[" * 100_000 + "]" * 100_000).encode()).decode(),
    "very-long": cursor(["x" * 5000, "training-x"]),
    "nul-in-the-value": cursor(["x\x00", "training-x"]),
    "nul-in-the-id": cursor(["2024-01-01T00:00:00+00:00", "training-\x00"]),
}


@pytest.mark.parametrize("name", CRAFTED_CURSORS)
@pytest.mark.parametrize("direction", ["after", "before"])
def test_it_refuses_crafted_cursors(alice, name, direction):
    job(alice)
    crafted = CRAFTED_CURSORS[name]
    response = client_for(alice).get("/api/v1/jobs/", {direction: crafted})
    assert response.status_code == 400 and response.json()["field"] == direction
    page = logged_in(alice).get("/", {direction: crafted})  # the jobs page reads the same parameters
    assert page.status_code == 400 and b"is not a cursor from a previous page" in page.content


def test_a_real_cursor_still_pages(alice):
    for index in range(3):
        job(alice, name=f"j{index}")
    page = logged_in(alice).get("/", {"size": 2})
    after = page.context["page"].after_cursor
    assert after and logged_in(alice).get("/", {"size": 2, "after": after}).status_code == 200
    assert client_for(alice).get("/api/v1/jobs/", {"after": after}).status_code == 200


HUGE = "9" * 400


@pytest.mark.parametrize("path, parameter, value", [
    ("/api/v1/jobs/", "limit", HUGE),
    ("/api/v1/jobs/", "limit", str(2**63)),
    ("/api/v1/jobs/", "limit", "0"),
    ("/api/v1/jobs/", "limit", "-5"),
    ("/api/v1/jobs/", "limit", "ten"),
    ("/api/v1/jobs/", "limit", "²"),
    ("/api/v1/jobs/", "offset", HUGE),
    ("/api/v1/jobs/", "size", HUGE),
    ("/api/v1/jobs/{id}/logs/", "since", HUGE),
    ("/api/v1/jobs/{id}/logs/", "since", "-1"),
    ("/api/v1/jobs/{id}/logs/", "limit", HUGE),
    ("/api/v1/jobs/{id}/logs/", "limit", "lots"),
    ("/api/v1/cluster/use/", "minutes", HUGE),
    ("/api/v1/cluster/use/", "minutes", "0"),
    ("/api/v1/cluster/use/", "minutes", "1441"),
    ("/api/v1/cluster/use/", "minutes", "²"),
])
def test_it_refuses_out_of_range_query_parameters_naming_them(alice, path, parameter, value):
    target = job(alice)
    response = client_for(alice).get(path.format(id=target.id), {parameter: value})
    assert response.status_code == 400, response.content[:300]
    assert response.json()["field"] == parameter and parameter in response.json()["detail"]


def test_bounded_parameters_still_work(alice):
    target = job(alice)
    assert client_for(alice).get("/api/v1/cluster/use/", {"minutes": "1440"}).status_code == 200
    assert client_for(alice).get("/api/v1/jobs/", {"limit": "200", "offset": "0"}).json()["count"] == 1
    assert client_for(alice).get(f"/api/v1/jobs/{target.id}/logs/", {"since": "0", "limit": "10000"}).status_code == 200


@pytest.mark.parametrize("method, suffix", [("delete", "share/"), ("get", "share/bob/"), ("post", "share/bob/")])
def test_the_share_endpoints_answer_methods_they_do_not_take_with_405(alice, method, suffix):
    target = job(alice)
    response = getattr(client_for(alice), method)(f"/api/v1/jobs/{target.id}/{suffix}")
    assert response.status_code == 405


def test_sharing_and_unsharing_still_work(alice):
    bob = member("team-a", "bob")
    target = job(alice, private=True)
    client = client_for(alice)
    shared = client.post(f"/api/v1/jobs/{target.id}/share/", {"username": "bob", "access": "view"}, format="json")
    assert shared.status_code == 200 and [p["username"] for p in shared.json()["results"]] == ["bob"]
    assert client_for(bob).get(f"/api/v1/jobs/{target.id}/").status_code == 200
    assert client.delete(f"/api/v1/jobs/{target.id}/share/bob/").json()["results"] == []
    assert client_for(bob).get(f"/api/v1/jobs/{target.id}/").status_code == 404


def test_the_manifest_example_still_submits(alice):
    assert submit(client_for(alice), MANIFEST).status_code == 201


@pytest.mark.parametrize("path", ["/api/v1/tokens/abc/", "/api/v1/tokens/" + "9" * 40 + "/", "/api/v1/nothing/"])
def test_api_paths_that_match_nothing_answer_json_404(alice, path):
    response = client_for(alice).delete(path)
    assert response.status_code == 404 and response["Content-Type"] == "application/json"


def test_the_use_per_node_names_no_job_owner_or_tenant_and_answers_only_members(alice):
    from django.utils import timezone
    from rest_framework.test import APIClient

    from jobs.models import Allocation, ResourceSample
    secret = job(alice, name="secret-project")
    Allocation.objects.create(job=secret, attempt=1, learners=1, placement=[{"node": "n1", "gpu_ids": [0]}])
    ResourceSample.objects.create(job=secret, attempt=1, learner=0, time=timezone.now(), cpu_cores=1.0,
                                  memory_bytes=1, memory_peak_bytes=1, gpus_busy=1.0)
    answer = client_for(member("team-b", "mallory")).get("/api/v1/cluster/use/")
    assert answer.status_code == 200 and answer.json()["nodes"][0]["name"] == "n1"
    for name in (secret.id, "secret-project", "alice", "team-a"):
        assert name not in answer.content.decode()
    assert APIClient().get("/api/v1/cluster/use/").status_code in (401, 403)


# A NUL character reached PostgreSQL, which refuses it in any text (a 500), from each of these.
NUL_IN_THE_QUERY = [("/api/v1/jobs/", {"user": "a\x00"}, "user"), ("/api/v1/jobs/", {"framework": "a\x00"}, "framework"),
                    ("/api/v1/jobs/", {"q": "a\x00"}, "q"), ("/api/v1/jobs/", {"a\x00": "1"}, "a\\0"),
                    ("/api/v1/jobs/{id}/metrics/", {"name": "loss\x00"}, "name")]
NUL_IN_THE_PATH = ["/api/v1/jobs/x%00y/", "/api/v1/jobs/x%00y/share/", "/api/v1/jobs/{id}/artifacts/results/a%00b"]


@pytest.mark.parametrize("path, params, field", NUL_IN_THE_QUERY)
def test_a_nul_in_a_query_parameter_is_a_400_naming_it(alice, path, params, field):
    response = client_for(alice).get(path.format(id=job(alice).id), params)
    assert response.status_code == 400 and response.json()["field"] == field
    assert "holds a NUL character" in response.json()["detail"]


@pytest.mark.parametrize("path", NUL_IN_THE_PATH)
def test_a_nul_in_the_path_is_a_400(alice, path):
    response = client_for(alice).get(path.format(id=job(alice).id))
    assert response.status_code == 400 and response.json() == {"detail": "path: holds a NUL character", "field": "path"}


@pytest.mark.parametrize("params", [{"user": "a\x00"}, {"q": "a\x00"}, {"metric": "lo\x00ss"}])
def test_the_pages_refuse_a_nul_too(alice, params):
    job(alice)
    page = logged_in(alice).get("/", params)
    assert page.status_code == 400 and b"holds a NUL character" in page.content
    assert logged_in(alice).get("/jobs/x%00y/").status_code == 400


@pytest.mark.parametrize("body, where", [({"username": "bob\x00", "access": "view"}, "username"),
                                         ({"username": "bob", "access": "view", "x\x00": 1}, "x\\0"),
                                         ({"username": ["bob", {"deep": "\x00"}]}, "username.1.deep")])
def test_a_nul_in_a_json_body_is_a_400_naming_where(alice, body, where):
    target = job(alice)
    response = client_for(alice).post(f"/api/v1/jobs/{target.id}/share/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {"detail": f"{where}: holds a NUL character", "field": where}



@pytest.mark.parametrize("content_type", ["multipart", "urlencoded"])
def test_a_nul_in_a_form_field_is_a_400_naming_it(alice, content_type):
    target = job(alice)
    client = client_for(alice)
    path = f"/api/v1/jobs/{target.id}/share/"
    if content_type == "multipart":
        response = client.post(path, {"username": "bob\x00", "access": "view"}, format="multipart")
    else:
        response = client.post(path, "username=bob%00&access=view", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400
    assert response.json() == {"detail": "username: holds a NUL character", "field": "username"}


def test_only_one_data_store_takes_a_jobs_results(alice):
    stores = "".join(f"- {{id: shelf{i}, type: local, training_results: {{container: out}}}}\n" for i in range(3))
    response = submit(client_for(alice), BASE + "data_stores:\n" + stores)
    assert response.status_code == 400
    assert response.json()["field"] == "data_stores[1].training_results"
    assert "'shelf0' already takes the results" in response.json()["detail"]
