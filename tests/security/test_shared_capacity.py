"""One tenant cannot hold what every tenant shares (issue 40): a result of very many files is recorded
within a bound and listed in pages, archive bombs are refused at once without being inflated, and a
tenant cannot queue jobs faster or more than its intake allows (429s naming the limit).

The suite's platform records at most 1,000 files per job (TRAINYARD_MAX_RECORDED_FILES, set in
conftest.py), so a result of 3,000 files proves the bound in seconds. The intake tests use tenants of
their own with small limits on their quotas, so no other test's tenant is limited by them.
"""
import io
import os
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.bombs import tar_bomb
from tests.support.hostile import HOSTILE, submit_hostile

pytestmark = pytest.mark.e2e

RECORDED_CAP = 1000  # conftest.py's TRAINYARD_MAX_RECORDED_FILES


def test_a_result_of_many_files_is_recorded_within_the_cap_and_listed_in_pages(platform):
    job = submit_hostile(platform, "MANY_FILES=3000 python3 many_results.py")
    final = platform.wait_for(job["id"], timeout=180)
    assert final["status"] == "COMPLETED", final
    notices = [line["line"] for line in platform.all_logs(job["id"]) if line["stream"] == "system"]
    assert any("files of this job's output were not recorded (1,000 were): at most 1,000 files are recorded "
               "per job (TRAINYARD_MAX_RECORDED_FILES)" in line for line in notices), notices

    path = f"/api/v1/jobs/{job['id']}/artifacts/"
    first = platform.api("GET", path).json()
    assert first["count"] == RECORDED_CAP and len(first["results"]) == 200 and first["next"]
    names, url = [], path
    while url:  # the next links, as a client follows them
        page = platform.api("GET", url).json()
        names += [artifact["name"] for artifact in page["results"]]
        url = page["next"]
    assert len(names) == len(set(names)) == RECORDED_CAP and names == sorted(names)
    assert "logs/training.log" in names  # the log is recorded first, whatever the results hold
    assert platform.api("GET", path, params={"limit": 5000}).status_code == 400  # no page is unbounded


def test_archive_bombs_are_refused_at_once_without_being_inflated(platform, intruder, tmp_path):
    _, _, token = intruder
    bomb = tar_bomb(tmp_path / "bomb.tgz", [512 * 2**20])  # 512 MiB of zeros, within the 1 GiB unpacked limit
    assert os.path.getsize(bomb) < 2**20
    manifest = (HOSTILE / "manifest.yml").read_text()
    before = platform.api("GET", "/api/v1/jobs/", token=token).json()["count"]

    def submit_bomb(_):
        started = time.monotonic()
        with open(bomb, "rb") as code:
            response = platform.api("POST", "/api/v1/jobs/", token=token, files={
                "manifest": ("manifest.yml", manifest), "code": ("code.tar.gz", code)})
        return response, time.monotonic() - started

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(submit_bomb, range(4)))
    for response, seconds in answers:
        assert response.status_code == 400, response.text
        assert response.json()["field"] == "code"
        assert "more than 100 times its size" in response.json()["detail"], response.json()
        assert seconds < 5, f"a bomb took {seconds:.1f}s to refuse"
    assert platform.api("GET", "/api/v1/jobs/", token=token).json()["count"] == before


def _tenant_with_quota(platform, slug, *quota):
    """A tenant of this test's own, whose jobs stay QUEUED (a tenth of a CPU, borrowing nothing): a token."""
    platform.manage("tenant", "create", slug, "--cpus", "0.1", *quota)
    return platform.add_member(slug, f"{slug}-researcher")


def _submit(platform, token):
    code = io.BytesIO()
    with tarfile.open(fileobj=code, mode="w:gz") as tf:
        info = tarfile.TarInfo("run.sh")
        info.size = 8
        tf.addfile(info, io.BytesIO(b"sleep 1\n"))
    return platform.api("POST", "/api/v1/jobs/", token=token, files={
        "manifest": ("manifest.yml", (HOSTILE / "manifest.yml").read_text().replace("python3 escape.py", "sh run.sh")),
        "code": ("code.tar.gz", code.getvalue())})


def _terminate_all(platform, token):
    for job in platform.api("GET", "/api/v1/jobs/", token=token, params={"limit": 200}).json()["results"]:
        platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/", token=token)


def test_a_tenant_cannot_queue_more_jobs_than_its_cap(platform):
    token = _tenant_with_quota(platform, "team-queue", "--queued-jobs", "2")
    try:
        answers = [_submit(platform, token) for _ in range(3)]
        assert [a.status_code for a in answers] == [201, 201, 429], [a.text for a in answers]
        assert answers[-1].json()["detail"].startswith(
            "too many queued jobs: tenant 'team-queue' has 2 jobs queued, the most it may have (its quota's queued_jobs)")
        assert platform.api("GET", "/api/v1/jobs/", token=token).json()["count"] == 2
    finally:
        _terminate_all(platform, token)


def test_a_tenant_cannot_submit_faster_than_its_rate(platform):
    token = _tenant_with_quota(platform, "team-rate", "--submissions-per-minute", "3")
    if time.time() % 60 > 40:  # the minute's count starts again at the next one: not in the middle of this test
        time.sleep(61 - time.time() % 60)
    try:
        answers = [_submit(platform, token) for _ in range(4)]
        assert [a.status_code for a in answers] == [201, 201, 201, 429], [a.text for a in answers]
        refused = answers[-1]
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert refused.json()["detail"].startswith(
            "too many submissions: tenant 'team-rate' may submit 3 jobs per minute (its quota's submissions_per_minute)")
    finally:
        _terminate_all(platform, token)
