"""A job's disk caps (jobs.disk) and its tenant's storage quota, at submission."""
import pytest

from jobs.models import Artifact, Job
from tenants import quotas
from tests.support.builders import client_for, member, tar_gz, upload

pytestmark = pytest.mark.django_db
MiB, GiB = 2**20, 2**30


def submit(alice, disk=""):
    manifest = f"name: d\nframework: {{name: custom, command: ls}}\n{disk}".encode()
    return client_for(alice).post("/api/v1/jobs/", {"manifest": upload(manifest, "manifest.yml"),
                                                    "code": upload(tar_gz({"run.sh": b"ls\n"}))}, format="multipart")


def test_a_job_gets_the_defaults_and_what_its_manifest_asks_within_them(settings):
    alice = member()
    response = submit(alice, "disk: {results: 20MiB, log_lines: 100}\n")
    assert response.status_code == 201, response.json()
    caps = Job.objects.get().runtime["disk"]
    assert caps == {**settings.DISK_DEFAULTS, "results": 20 * MiB, "log_lines": 100}
    assert client_for(alice).get(f"/api/v1/jobs/{response.json()['id']}/").json()["disk"] == caps


def test_without_a_tenant_limit_a_job_cannot_ask_more_than_the_default(settings):
    settings.DISK_DEFAULTS = {**settings.DISK_DEFAULTS, "work": GiB}
    response = submit(member(), "disk: {work: 2GiB}\n")
    assert response.status_code == 400
    assert response.json()["field"] == "disk.work" and "the platform's limit (1.0 GiB)" in response.json()["detail"]


def test_the_tenant_limit_lowers_the_defaults_and_allows_more_than_them(settings):
    alice = member()
    settings.DISK_DEFAULTS = {**settings.DISK_DEFAULTS, "results": GiB}
    quotas.set_quota(alice.tenant, disk_per_job_bytes=512 * MiB)
    assert submit(alice).status_code == 201
    assert Job.objects.get().runtime["disk"]["results"] == 512 * MiB
    quotas.set_quota(alice.tenant, disk_per_job_bytes=4 * GiB)
    assert submit(alice, "disk: {results: 3GiB}\n").status_code == 201
    refused = submit(alice, "disk: {results: 5GiB}\n")
    assert refused.status_code == 400 and "the tenant's per-job disk limit (4.0 GiB)" in refused.json()["detail"]


def test_a_tenant_at_its_storage_quota_cannot_submit_and_sees_its_storage_on_the_usage_summary():
    alice = member()
    first = submit(alice).json()["id"]
    Artifact.objects.create(job_id=first, name="results/model.bin", kind="result", size=3 * MiB, sha256="0" * 64)
    quotas.set_quota(alice.tenant, storage_bytes=3 * MiB)
    summary = client_for(alice).get("/api/v1/tenants/current/").json()
    code = Job.objects.get().code_bytes
    assert summary["usage"]["storage_bytes"] == 3 * MiB + code and summary["quota"]["storage_bytes"] == 3 * MiB
    assert summary["storage"]["state"] == "full"
    refused = submit(alice)
    assert refused.status_code == 400 and refused.json()["field"] == "storage"
    assert "tenant storage quota reached: 3.0 MiB of 3.0 MiB" in refused.json()["detail"]
    quotas.set_quota(alice.tenant, storage_bytes=4 * MiB)
    assert submit(alice).status_code == 201


def test_code_archives_count_against_the_storage_quota():
    """A job's code archive is kept as long as the job: without it counted, submitting and terminating
    jobs would fill the platform's disk past any storage quota."""
    alice = member()
    quotas.set_quota(alice.tenant, storage_bytes=1)
    assert submit(alice).status_code == 201
    job = Job.objects.get()
    assert job.code_bytes > 1 and quotas.stored_bytes(alice.tenant) == job.code_bytes
    refused = submit(alice)
    assert refused.status_code == 400 and refused.json()["field"] == "storage"
    assert "(results, checkpoints, logs and code archives)" in refused.json()["detail"]
