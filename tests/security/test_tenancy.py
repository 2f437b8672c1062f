"""Tenancy on the real platform, attacked by a researcher of another tenant: local data-store folders
of another tenant, membership forced on someone, usernames probed, shares that outlive a membership,
and data-store endpoints aimed at the platform's own network (SSRF, port scanning)."""
import uuid

import pytest

pytestmark = pytest.mark.e2e


def job_manifest(name, command, stores=""):
    return (f"name: {name}\ncpus: 0.25\nmemory: 128MiB\nframework:\n  name: custom\n  command: '{command}'\n"
            + stores)


def logs_of(platform, job_id, token):
    page = platform.api("GET", f"/api/v1/jobs/{job_id}/logs/", token=token, params={"limit": 10000}).json()
    return "\n".join(line["line"] for line in page["results"])


# --- 4. local data stores belong to one tenant -------------------------------------------------------
LOCAL_STORE = """data_stores:
  - id: shelf
    type: local
    {section}: {{container: {container}}}
"""


def test_another_tenants_local_data_store_folder_is_neither_read_nor_written(platform, intruder):
    _, _, mallory = intruder
    secret = f"team-a-only-{uuid.uuid4().hex}"
    container = f"vault-{uuid.uuid4().hex[:8]}"
    written = platform.submit("custom-shell", manifest_text=job_manifest(
        "writes", f"echo {secret} > $RESULT_DIR/secret.txt",
        LOCAL_STORE.format(section="training_results", container=container)))
    assert platform.wait_for(written["id"], timeout=120)["status"] == "COMPLETED"

    # the same container name from team-b: its own (empty) folder, never team-a's
    read = platform.submit("custom-shell", token=mallory, manifest_text=job_manifest(
        "reads", "cat $(find $DATA_DIR -type f) || true",
        LOCAL_STORE.format(section="training_data", container=container)))
    done = platform.wait_for(read["id"], timeout=120, token=mallory)
    assert secret not in logs_of(platform, read["id"], mallory)
    assert secret not in str(done)
    assert done["status"] == "FAILED" and f"folder '{container}' does not exist" in done["status_reason"]

    overwrite = platform.submit("custom-shell", token=mallory, manifest_text=job_manifest(
        "overwrites", "echo planted-by-team-b > $RESULT_DIR/planted.txt",
        LOCAL_STORE.format(section="training_results", container=container)))
    assert platform.wait_for(overwrite["id"], timeout=120, token=mallory)["status"] == "COMPLETED"
    stored = list(platform.data_dir.glob(f"datastores/team-a/{container}/**/secret.txt"))
    assert stored and secret in stored[0].read_text()
    assert not list(platform.data_dir.glob(f"datastores/team-a/{container}/**/planted.txt"))
    assert list(platform.data_dir.glob(f"datastores/team-b/{container}/**/planted.txt"))


def _empty_tar_gz():
    import io
    import tarfile
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("run.sh")
        archive.addfile(info, io.BytesIO(b""))
    return buffer.getvalue()


# --- 5. nobody joins a tenant without consent ----------------------------------------------------------
def submit_private(platform, manifest):
    """A private job of the platform's user (alice), submitted without naming a tenant."""
    response = platform.api("POST", "/api/v1/jobs/", data={"private": "true"}, files={
        "manifest": ("manifest.yml", manifest), "code": ("code.tar.gz", _empty_tar_gz())})
    assert response.status_code == 201, response.text
    return response.json()


@pytest.fixture(scope="module")
def trudy(platform):
    """The admin of tenant 'a-team', which sorts before team-a: the tenant a forced member's requests
    without a tenant header would have landed in."""
    return platform.add_member("a-team", "trudy", role="admin", password="trudy-password")


def test_a_tenant_admin_cannot_pull_someone_into_their_tenant(platform, trudy):
    response = platform.api("POST", "/api/v1/tenants/current/members/", token=trudy,
                            json={"username": platform.username, "role": "researcher"})
    assert response.status_code == 202, response.text
    members = platform.api("GET", "/api/v1/tenants/current/members/", token=trudy).json()["results"]
    assert platform.username not in [m["username"] for m in members]
    assert platform.api("GET", "/api/v1/tenants/current/").json()["tenant"]["slug"] == "team-a"

    private = submit_private(platform, job_manifest("mine", "true"))
    assert private["tenant"] == "team-a"  # not trudy's a-team, which sorts first
    assert platform.api("GET", f"/api/v1/jobs/{private['id']}/", token=trudy).status_code == 404
    listed = platform.api("GET", "/api/v1/jobs/", token=trudy).json()["results"]
    assert private["id"] not in [j["id"] for j in listed]
    assert platform.wait_for(private["id"], timeout=120)["status"] == "COMPLETED"


def test_inviting_does_not_tell_which_usernames_exist(platform, trudy):
    def answer(username):
        response = platform.api("POST", "/api/v1/tenants/current/members/", token=trudy,
                                json={"username": username, "role": "viewer"})
        return response.status_code, response.text.replace(username, "NAME")

    assert answer(platform.username) == answer(f"nobody-{uuid.uuid4().hex[:8]}")


def test_a_removed_member_loses_what_was_shared_with_them(platform):
    ada = platform.add_member("team-a", "ada", role="admin")
    bob = platform.add_member("team-a", "bob")
    private = submit_private(platform, job_manifest("shared", "true"))
    shared = platform.api("POST", f"/api/v1/jobs/{private['id']}/share/", json={"username": "bob", "access": "view"})
    assert shared.status_code == 200, shared.text
    assert platform.api("GET", f"/api/v1/jobs/{private['id']}/", token=bob).status_code == 200
    assert platform.api("DELETE", "/api/v1/tenants/current/members/bob/", token=ada).status_code == 204
    platform.manage("tenant", "adduser", "team-a", "bob", "--role", "researcher")  # back later, as anyone
    assert platform.api("GET", f"/api/v1/jobs/{private['id']}/", token=bob).status_code == 404


# --- 7. data-store endpoints cannot reach the platform's own network -------------------------------------
S3_STORE = """data_stores:
  - id: lake
    type: s3_datastore
    training_data: {{container: some-bucket}}
    connection: {{auth_url: '{endpoint}', user_name: AKIDEXAMPLE, password: not-a-secret}}
"""


def ssrf_targets(platform):
    web_port = platform.url.rsplit(":", 1)[1].rstrip("/")
    return {"open loopback port": f"http://127.0.0.1:{web_port}", "closed loopback port": "http://127.0.0.1:1",
            "cloud metadata": "http://169.254.169.254", "private host": "http://10.0.0.1",
            "IPv6 loopback": f"http://[::1]:{web_port}", "a name for the loopback": f"http://localhost:{web_port}"}


def test_data_store_endpoints_in_the_platforms_network_all_fail_alike(platform, intruder):
    _, _, mallory = intruder
    reasons = {}
    for what, endpoint in ssrf_targets(platform).items():
        job = platform.submit("custom-shell", token=mallory, manifest_text=job_manifest(
            "probe", "true", S3_STORE.format(endpoint=endpoint)))
        done = platform.wait_for(job["id"], timeout=120, token=mallory)
        assert done["status"] == "FAILED", (what, done["status_reason"])
        reasons[what] = done["status_reason"]
    assert len(set(reasons.values())) == 1, reasons
    assert "cannot be reached" in next(iter(reasons.values()))
