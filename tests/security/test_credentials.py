"""Learner credentials and the platform's secret key, attacked from outside a job (issue 12, findings 2, 3, 11).

Ingest is the one endpoint learners' agents reach, so whoever can post there can write another tenant's
logs and metrics, and a status record can end a running job. These tests post what an attacker could:
a token signed with the old predictable key, a finished attempt's credential, a credential of another
learner, and junk with a bad credential; every one must be refused and leave no trace in the job.
"""
import json
import stat
import time
import uuid

import pytest
import requests
from django.core import signing

from portal.runner import PROJECT_ROOT

pytestmark = pytest.mark.e2e

SLEEPER = """\
name: sleeper
version: "1.0"
learners: {learners}
gpus: 0
cpus: 0.25
memory: 128MiB
framework:
  name: custom
  command: {command}
checkpoint: {{signal: SIGTERM, grace_seconds: 5}}
"""
# What the platform signed ingest tokens with before issue 12 when TRAINYARD_SECRET_KEY was unset.
PREDICTABLE_KEY = "trainyard-insecure-dev-key-" + str(PROJECT_ROOT)


def submit(platform, *, learners=1, command="sleep 600"):
    return platform.submit("custom-shell", manifest_text=SLEEPER.format(learners=learners, command=command))


def credential(platform, job_id, *, attempt=1, learner=0):
    """The credential the platform handed to one learner's agent (agent.json, read here as root)."""
    folder = platform.data_dir / "storage" / platform.tenant / job_id / f"attempt-{attempt}" / f"learner-{learner}"
    return json.loads((folder / "agent.json").read_text())["ingest_token"]


def post(platform, job_id, token, *, attempt=1, learner=0, records=None, data=None):
    """The platform's answer to one ingest post; a throttled post (429: this suite's other refused posts
    share our address) is sent again once the throttle allows, as an agent would."""
    body = data if data is not None else json.dumps({"attempt": attempt, "learner": learner, "records": records})
    deadline = time.monotonic() + 180
    while True:
        response = requests.post(f"{platform.url}/api/v1/ingest/{job_id}/", data=body, timeout=120,
                                 headers={"Authorization": f"Ingest {token}", "Content-Type": "application/json"})
        if response.status_code != 429 or time.monotonic() > deadline:
            return response
        time.sleep(float(response.headers.get("Retry-After", 5)))


def marker_records(marker, *, first_seq=1, count=50, exit_record=True):
    """Log lines carrying `marker` (from `first_seq` on, so some land past what the agent sent) and, at
    the end, an `exited` status record that would end the learner's attempt."""
    records = [{"seq": first_seq + i, "kind": "log", "stream": "stdout", "time": time.time(), "line": marker}
               for i in range(count)]
    if exit_record:
        records.append({"seq": first_seq + count, "kind": "status", "state": "exited", "exit_code": 1,
                        "reason": marker, "time": time.time()})
    return records


def logged(platform, job_id, marker):
    return any(marker in line["line"] for line in platform.all_logs(job_id))


@pytest.fixture(scope="module")
def running_pair(platform):
    """A two-learner job of team-a, running until the module is done."""
    job = submit(platform, learners=2)
    platform.wait_for(job["id"], {"PROCESSING"}, timeout=120)
    yield job
    platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/")


def test_a_token_forged_with_the_old_predictable_key_is_refused(platform, running_pair):
    forged = signing.dumps({"job": running_pair["id"], "attempt": 1}, key=PREDICTABLE_KEY, salt="trainyard.ingest")
    marker = f"forged-{uuid.uuid4().hex}"
    response = post(platform, running_pair["id"], forged, records=marker_records(marker, first_seq=1, count=5000))
    assert response.status_code == 401, response.text
    time.sleep(1)
    assert platform.job(running_pair["id"])["status"] == "PROCESSING"
    assert not logged(platform, running_pair["id"], marker)


def test_a_learners_credential_cannot_post_as_another_learner(platform, running_pair):
    first = credential(platform, running_pair["id"], learner=0)
    marker = f"impostor-{uuid.uuid4().hex}"
    response = post(platform, running_pair["id"], first, learner=1,
                    records=marker_records(marker, first_seq=1, count=5000, exit_record=False))
    assert response.status_code == 401, response.text
    assert not logged(platform, running_pair["id"], marker)


def test_a_credential_of_another_job_is_refused(platform, running_pair):
    other = submit(platform, command="sleep 600")
    try:
        platform.wait_for(other["id"], {"PROCESSING"}, timeout=120)
        marker = f"crossjob-{uuid.uuid4().hex}"
        response = post(platform, running_pair["id"], credential(platform, other["id"]),
                        records=marker_records(marker, count=5000, exit_record=False))
        assert response.status_code == 401, response.text
        assert not logged(platform, running_pair["id"], marker)
    finally:
        platform.api("POST", f"/api/v1/jobs/{other['id']}/terminate/")


def test_the_credential_of_a_finished_job_is_refused(platform):
    job = submit(platform, command="echo finished")
    assert platform.wait_for(job["id"], timeout=120)["status"] == "COMPLETED"
    marker = f"afterlife-{uuid.uuid4().hex}"
    # The web process has seen this credential valid (its agent's posts) and remembers it
    # (jobs.credentials): the attempt's end must still be checked at this post.
    # Far past anything the agent sent, so nothing of it would be dropped as a resend.
    response = post(platform, job["id"], credential(platform, job["id"]),
                    records=marker_records(marker, first_seq=1, count=5000, exit_record=False))
    assert response.status_code == 410, response.text
    assert not logged(platform, job["id"], marker)


def test_attempt_one_credential_is_refused_after_a_halt_and_resume(platform):
    job = submit(platform)
    platform.wait_for(job["id"], {"PROCESSING"}, timeout=120)
    first = credential(platform, job["id"], attempt=1)
    try:
        assert platform.api("POST", f"/api/v1/jobs/{job['id']}/halt/").status_code == 202
        platform.wait_for(job["id"], {"HALTED"}, timeout=120)
        assert platform.api("POST", f"/api/v1/jobs/{job['id']}/resume/").status_code == 202
        platform.wait_for(job["id"], {"PROCESSING"}, timeout=120)
        marker = f"replay-{uuid.uuid4().hex}"
        # Whatever attempt it claims, the old credential only tells its agent to stop.
        for claimed in (1, 2):
            response = post(platform, job["id"], first, attempt=claimed, records=marker_records(marker, count=5000))
            assert response.status_code == 410, response.text
        assert not logged(platform, job["id"], marker)
        assert platform.job(job["id"])["status"] == "PROCESSING"
    finally:
        platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/")


@pytest.mark.parametrize("body", [b"{not json", b"[" * 100_000, b"\xff\xfe garbage"])
def test_junk_with_a_bad_credential_is_refused_before_it_is_read(platform, running_pair, body):
    assert post(platform, running_pair["id"], "not-a-credential", data=body).status_code == 401


@pytest.mark.parametrize("size_mib, refused", [(50, 413), (15, 401)])  # past any ingest body; within it
def test_a_huge_body_with_a_bad_credential_is_refused_quickly(platform, running_pair, size_mib, refused):
    body = b"x" * (size_mib * 2**20)
    started = time.monotonic()
    response = requests.post(f"{platform.url}/api/v1/ingest/{running_pair['id']}/", data=body, timeout=120,
                             headers={"Authorization": "Ingest not-a-credential"})
    assert time.monotonic() - started < 20
    assert response.status_code in (refused, 429), response.text[:300]  # refused either way, never read
    if response.status_code == 429:
        assert post(platform, running_pair["id"], "not-a-credential", data=body).status_code == refused


def test_the_secret_key_is_generated_private_and_unpredictable(platform):
    if platform.env.get("TRAINYARD_SECRET_KEY") or platform.env.get("DJANGO_SECRET_KEY"):
        pytest.skip("this run sets an explicit secret key, which wins over a generated one")
    path = platform.data_dir / "secret_key"
    assert path.exists(), "the platform did not keep a generated secret key in its data directory"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert len(key) >= 50 and key != PREDICTABLE_KEY
    # Every process of the platform signs with that key: manage.py (same environment as web, worker, beat)
    # reads it back, and nothing sealed with the old predictable key can be read there.
    probe = ("from django.conf import settings; from django.core import signing; "
             f"print(settings.SECRET_KEY == {key!r}, signing.dumps('x', key={PREDICTABLE_KEY!r}) "
             "== signing.dumps('x'))")
    assert platform.manage("shell", "-c", probe).splitlines()[-1].split() == ["True", "False"]


# Everything a learner could look through for its agent's credential: its environment, every process's
# command line and environment, its working folder, its agent's folder and config.
SNOOPER = """\
name: snooper
version: "1.0"
learners: 1
gpus: 0
cpus: 0.25
memory: 128MiB
framework:
  name: custom
  command: |
    env
    for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < "$f" 2>/dev/null; echo; done
    cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'
    learner="$(dirname "$RESULT_DIR")/attempt-1/learner-0"
    ls -la . "$learner" 2>&1
    cat "$learner/agent.json" ./agent.json ../agent.json 2>&1
    grep -rI . . 2>/dev/null | head -1000
    echo snooped
"""


def test_the_learner_cannot_find_its_own_credential(platform):
    job = platform.submit("custom-shell", manifest_text=SNOOPER)
    finished = platform.wait_for(job["id"], timeout=120)
    lines = [line["line"] for line in platform.all_logs(job["id"])]
    assert "snooped" in lines, (finished["status_reason"], lines[-20:])
    token = credential(platform, job["id"])
    assert not any(token in line for line in lines)
