"""Small builders for tenants, users, tokens and jobs, and an agent's ingest post."""
import io
import tarfile
import zipfile

from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone

from jobs import runtime, storage
from jobs.states import transition
from trainyard.manifest import parse_manifest
from jobs.models import FollowUp, Job, Learner, Status
from tenants.models import ApiToken, Membership, Tenant

MANIFEST = b"""
name: test-job
cpus: 1
memory: 1GiB
framework: {name: custom, command: sh run.sh}
"""
# An elastic job of two learners that may run on 1-4, its global batch 64 within 32..256.
ELASTIC_MANIFEST = """
name: elastic
learners: 2
gpus: 1
cpus: 1
memory: 1GiB
framework: {name: custom, command: sh run.sh}
elastic: {min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256}, lr_scaling: sqrt}
"""


def member(tenant_slug="team-a", username="alice", role="researcher"):
    tenant, _ = Tenant.objects.get_or_create(slug=tenant_slug)
    user, _ = get_user_model().objects.get_or_create(username=username)
    membership, _ = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
    return membership


def token_for(membership_or_user):
    return ApiToken.issue(getattr(membership_or_user, "user", membership_or_user))[1]


def client_for(membership_or_user):
    """A REST client authenticated with a fresh API token of the member (or user)."""
    from rest_framework.test import APIClient
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(membership_or_user)}")
    return client


def logged_in(membership):
    """A browser-like client with the member's session (the portal pages)."""
    from django.test import Client
    client = Client()
    client.force_login(membership.user)
    return client


def tar_gz(files):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zip_bytes(files):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def upload(data, name="code.tar.gz"):
    return SimpleUploadedFile(name, data)


def job(membership, **fields):
    """A job row as submission writes it: its runtime fields come from its manifest (jobs.runtime)."""
    values = dict(tenant=membership.tenant, owner=membership.user, name="j", framework="custom",
                  manifest={}, manifest_yaml=MANIFEST.decode(), memory_bytes=2**30, code_sha256="0" * 64)
    values.update(fields)
    values.setdefault("runtime", runtime.from_manifest(parse_manifest(values["manifest_yaml"])))
    return Job.objects.create(**values)


def running_on(row, gpus):
    """The job admitted on these GPUs of the node "local", one learner on each, its folder made and
    every learner running."""
    storage.job_dir(row.tenant.slug, row.id).mkdir(parents=True, exist_ok=True)
    row = transition(row.id, Status.PENDING, actor="scheduler", learners=len(gpus),
                     placement=[{"node": "local", "gpu_ids": [g]} for g in gpus])
    for index in range(row.learners):
        Learner.objects.create(job=row, attempt=row.attempt, index=index, state=Learner.State.RUNNING)
    return transition(row.id, Status.PROCESSING, actor="lifecycle-manager", reason="training")


def torn_down(row):
    """The job's open teardown done, as a worker marks it once the backend says none of its learners
    runs: until then the scheduler counts the ended job's GPUs as held (jobs.admission.being_torn_down)."""
    FollowUp.objects.filter(job_id=row.id, kind=FollowUp.Kind.TEARDOWN, done_at=None).update(done_at=timezone.now())


WAKE_SCHEDULER = ("wake_scheduler", ())  # how record_sends records a wake of the scheduling loop


def record_sends(monkeypatch):
    """The tasks jobs.dispatch sends, as (name, args), and its wakes of the scheduling loop, as
    WAKE_SCHEDULER, recorded at once instead of sent to a broker or Redis (the tests' transaction
    never commits, so on-commit sends are recorded when asked for)."""
    sent = []
    monkeypatch.setattr("jobs.dispatch.send", lambda task, *args, countdown=None: sent.append((task, args)))
    monkeypatch.setattr("jobs.dispatch.send_on_commit", lambda task, *args: sent.append((task, args)))
    monkeypatch.setattr("jobs.dispatch.wake_scheduler", lambda: sent.append(WAKE_SCHEDULER))
    monkeypatch.setattr("jobs.dispatch.wake_scheduler_on_commit", lambda: sent.append(WAKE_SCHEDULER))
    return sent


def open_follow_ups(target):
    """{(kind, attempt)} of the job's outbox rows not done yet."""
    return set(FollowUp.objects.filter(job_id=target.id, done_at=None).values_list("kind", "attempt"))


def post(target, records, *, attempt=1, learner=0, token=None):
    """POST `records` to the job's ingest endpoint as its learner's agent (the running_job fixture's tokens)."""
    token = token or target.tokens[learner]
    return Client().post(f"/api/v1/ingest/{target.id}/", {"attempt": attempt, "learner": learner, "records": records},
                         content_type="application/json", HTTP_AUTHORIZATION=f"Ingest {token}")
