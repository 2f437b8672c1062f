"""Fair between tenants, on the real platform (one CPU-only node of 2 CPUs, so one whole-node job
fills it):

- a tenant's long backlog, submitted first, cannot starve another tenant's small job: ties go to
  the tenant that has had the least recent service, not to submission order;
- a researcher cannot ask for `priority: high` unless the rules say so (default: tenant admins only);
- a high-priority job halts another tenant's work only while its own tenant stays within its fair
  share (half the node between two tenants); at its share it halts its own lower-priority work.
"""
import shutil
import tempfile
import time

import pytest

from learner_agent import sandbox
from portal.runner import PROJECT_ROOT
from tests.support.harness import start_session
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.e2e

RESUMABLE = PROJECT_ROOT / "tests" / "e2e" / "jobs" / "resumable"
BACKLOG = 200
# The backlog is queued faster than a tenant may submit by default (TRAINYARD_SUBMITS_PER_MINUTE, and a
# sixth of it in ten seconds): this test is about the queue's order once it is long, not about how fast
# it may grow (test_shared_capacity).
ONE_NODE = {"TRAINYARD_LOCAL_CPUS": "2", "TRAINYARD_LOCAL_GPUS": "0", "TRAINYARD_RECONCILE_INTERVAL": "2",
            "TRAINYARD_SANDBOX": "bwrap", "TRAINYARD_SUBMITS_PER_MINUTE": "10000"}


@pytest.fixture
def one_node():
    """A platform of its own: a node of 2 CPUs, no GPUs; alice (researcher) in team-a."""
    if sandbox.bwrap_problem() is not None:
        skip_or_fail(f"the hostile-learner suite needs bubblewrap: {sandbox.bwrap_problem()}")
    data_dir = tempfile.mkdtemp(prefix="trainyard-fair-", dir="/var/tmp")
    session = start_session(data_dir, **ONE_NODE)
    try:
        yield session
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def manifest(name, *, cpus, command, priority="normal"):
    return (f"name: {name}\ncpus: {cpus}\nmemory: 64MiB\npriority: {priority}\n"
            f"framework: {{name: custom, command: '{command}'}}\n"
            "checkpoint: {signal: SIGTERM, grace_seconds: 10}\n")


def submit(session, token, name, *, cpus, command="bash run.sh 300", priority="normal"):
    return session.submit(str(RESUMABLE), token=token, manifest_text=manifest(
        name, cpus=cpus, command=command, priority=priority))["id"]


# --- the backlog ------------------------------------------------------------------------------------
# team-b's backlog, queued through the platform's own submission code in one process (the finding
# queued 2,000 at 27/s over HTTP; what matters here is that they are queued before team-a's job).
QUEUE_BACKLOG = f"""
import io, tarfile
from django.core.files.uploadedfile import SimpleUploadedFile
from django.contrib.auth import get_user_model
from jobs import submission
from tenants.access import membership_for

membership = membership_for(get_user_model().objects.get(username="mallory"), "team-b")
buffer = io.BytesIO()
with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
    archive.addfile(tarfile.TarInfo("run.sh"), io.BytesIO(b""))
manifest = b"name: whole-node\\ncpus: 2\\nmemory: 64MiB\\nframework: {{name: custom, command: 'sleep 1'}}\\n"
for _ in range({BACKLOG}):
    submission.submit(membership, manifest_bytes=manifest, code_file=SimpleUploadedFile("c.tar.gz", buffer.getvalue()))
print("queued")
"""


def queued(session, token):
    return session.api("GET", "/api/v1/tenants/current/", token=token).json()["queued"]["jobs"]


def test_a_long_backlog_of_another_tenant_does_not_starve_a_small_job(one_node):
    session = one_node
    mallory = session.add_member("team-b", "mallory")
    assert session.manage("shell", "-c", QUEUE_BACKLOG).endswith("queued")
    before = queued(session, mallory)
    assert before >= BACKLOG // 2  # one whole-node job at a time: most of it is still queued
    small = submit(session, None, "small", cpus=0.5, command="echo hello; echo done")
    done = session.wait_for(small, timeout=90)
    assert done["status"] == "COMPLETED", done["status_reason"]
    # team-a's job went in when the whole-node job running at its submission ended, not after the backlog
    ran_meanwhile = before - queued(session, mallory)
    assert ran_meanwhile <= 3, f"{ran_meanwhile} of team-b's backlog started before team-a's half-CPU job"


# --- priority high across tenants -------------------------------------------------------------------
def wait_processing(session, token, *job_ids):
    for job_id in job_ids:
        session.wait_for(job_id, {"PROCESSING"}, timeout=90, token=token)


def history(session, token, job_id):
    """The job's events as `FROM->TO by ACTOR: REASON` lines, for a failure's message."""
    events = session.api("GET", f"/api/v1/jobs/{job_id}/events/", token=token).json()["results"]
    return [f"{e['from_status']}->{e['to_status']} by {e['actor']}: {e['reason']}" for e in events]


def halted_by_scheduler(session, token, job_id):
    events = session.api("GET", f"/api/v1/jobs/{job_id}/events/", token=token).json()["results"]
    return [e["reason"] for e in events if e["to_status"] == "HALTING" and e["actor"] == "scheduler"]


def test_a_researcher_of_another_tenant_cannot_preempt_with_priority_high(one_node):
    session = one_node
    mallory = session.add_member("team-b", "mallory")
    alices = submit(session, None, "alices", cpus=2)
    wait_processing(session, None, alices)

    with pytest.raises(AssertionError, match=": 403 ") as refused:
        submit(session, mallory, "urgent", cpus=1, command="true", priority="high")
    said = str(refused.value)
    assert '"field":"priority"' in said.replace(" ", "") and "for tenant admins only" in said, said
    assert "TRAINYARD_HIGH_PRIORITY=admins" in said and "your role is researcher" in said, said
    assert session.api("GET", "/api/v1/jobs/", token=mallory).json()["results"] == []  # nothing stored

    time.sleep(5)  # two reconcile passes, each with a scheduling cycle
    job = session.job(alices)
    assert (job["status"], job["attempt"]) == ("PROCESSING", 1)
    assert halted_by_scheduler(session, None, alices) == []
    assert session.api("POST", f"/api/v1/jobs/{alices}/terminate/").status_code == 202


def test_priority_high_takes_from_another_tenant_only_up_to_a_fair_share(one_node):
    session = one_node
    bea = session.add_member("team-b", "bea", role="admin")  # the default lets tenant admins ask for high

    # At its share: team-b holds half the node; its high job halts its own normal job, not team-a's
    # lower-priority one (that would give team-b the whole node).
    alices_low = submit(session, None, "alices-low", cpus=1, priority="low")
    beas_normal = submit(session, bea, "beas-normal", cpus=1)
    wait_processing(session, None, alices_low)
    wait_processing(session, bea, beas_normal)
    urgent = submit(session, bea, "urgent", cpus=1, command="bash run.sh 3", priority="high")
    assert session.wait_for(urgent, timeout=120, token=bea)["status"] == "COMPLETED"
    assert halted_by_scheduler(session, None, alices_low) == []
    assert session.job(alices_low)["attempt"] == 1
    assert halted_by_scheduler(session, bea, beas_normal) == [f"preempted: preempted for higher-priority job {urgent}"]

    # Under its share: team-b holds nothing and team-a the whole node; team-b's high job may halt
    # team-a's lowest-priority job (team-b then holds half, its fair share).
    stopped = session.api("POST", f"/api/v1/jobs/{beas_normal}/terminate/", token=bea)
    assert stopped.status_code == 202, (stopped.text, history(session, bea, beas_normal))
    session.wait_for(beas_normal, timeout=60, token=bea)
    alices_normal = submit(session, None, "alices-normal", cpus=1)
    wait_processing(session, None, alices_low, alices_normal)
    again = submit(session, bea, "urgent-again", cpus=1, command="bash run.sh 3", priority="high")
    assert session.wait_for(again, timeout=120, token=bea)["status"] == "COMPLETED"
    assert halted_by_scheduler(session, None, alices_low) == [
        "preempted: preempted for a higher-priority job of another tenant"]
    assert halted_by_scheduler(session, None, alices_normal) == []
