"""Submission: a new job is validated (manifest and code archive), stored, queued, and announced.

Nothing is stored or reserved unless everything is valid. What later steps need from the manifest is
kept on the job (jobs.runtime), so they never parse the manifest again.
"""
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction

from jobs import datastores, disk, dispatch, live, runtime, storage, transfers
from jobs.models import Job, Status
from learner_agent.archive import ArchiveError, InspectBounds, inspect_archive
from tenants import priority, quotas, throttling
from tenants.models import Tenant
from trainyard.manifest import ManifestError, parse_manifest
from trainyard.units import format_bytes


class SubmitError(Exception):
    def __init__(self, detail, *, field=None, status=400, retry_after=None):
        super().__init__(detail)
        self.detail, self.field, self.status, self.retry_after = detail, field, status, retry_after

    def headers(self):
        """The answer's headers: Retry-After (seconds) when waiting that long is what it takes."""
        return {"Retry-After": str(self.retry_after)} if self.retry_after else {}


# --- submit --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    """A submission admit() let through, with the tenant's quota it read (None: the platform's
    defaults), which the rest of the submission checks against rather than reading it again."""
    quota: object

    @property
    def intake(self):
        return quotas.intake_of(self.quota)


def admit(membership):
    """Refuse a member who may not submit now: 403 for the role, 429 with Retry-After past the
    tenant's submissions per minute (tenants.quotas.intake_of; every call counts as an attempt). It
    reads no upload: the API calls it before parsing one, so refused submits cost no parsing. The
    queue's limit is checked once, where the job is queued (store_job, under the tenant's lock)."""
    if not membership.can_submit:
        raise SubmitError(f"your role in {membership.tenant.slug!r} ({membership.role}) cannot submit jobs",
                          status=403)
    admitted = Admitted(quotas.quota_of(membership.tenant))
    tenant, intake = membership.tenant, admitted.intake
    per_minute = intake.submissions_per_minute
    retry_s = throttling.submission_retry_after(tenant.pk, per_minute)
    if retry_s:
        raise SubmitError(f"too many submissions: tenant {tenant.slug!r} may submit {per_minute} jobs per minute "
                          f"({intake.source('submissions_per_minute')}), at most "
                          f"{throttling.submission_burst(per_minute)} of them in any ten seconds; try again in "
                          f"{retry_s}s", status=429, retry_after=retry_s)
    return admitted


def submit(membership, *, manifest_bytes, code_file, private=False, admitted=None):
    """Validate and store a new job; nothing is stored or reserved unless everything is valid.
    `admitted`: what admit() answered, when the caller has called it for this submission already."""
    admitted = admitted or admit(membership)
    try:
        manifest = parse_manifest(manifest_bytes)
    except ManifestError as exc:
        raise SubmitError(str(exc), field=exc.field) from None
    disk_caps = disk_caps_for(membership.tenant, manifest, admitted.quota)
    check_priority(membership, manifest)
    upload, info = checked_code(code_file)
    try:
        return store_job(membership.tenant, membership.user, manifest, manifest_bytes.decode("utf-8"), upload,
                         info.kind, private=private, disk_caps=disk_caps, queue_limit=admitted.intake)
    finally:
        upload.unlink(missing_ok=True)


def check_priority(membership, manifest):
    try:
        priority.may_ask(membership, manifest.priority)
    except priority.PriorityRefused as exc:
        raise SubmitError(str(exc), field="priority", status=403) from None


def checked_code(code_file):
    """The uploaded code archive saved and inspected: (the saved file, what inspect_archive found). The
    caller removes the file; a refused archive is removed here."""
    if code_file is None:
        raise SubmitError("a code archive (zip or tar.gz) is required", field="code")
    if code_file.size > settings.MAX_CODE_BYTES:
        raise SubmitError(f"code archive is {format_bytes(code_file.size)}; the limit is "
                          f"{format_bytes(settings.MAX_CODE_BYTES)}", field="code", status=413)
    upload = _save_upload(code_file)
    try:
        try:
            info = inspect_archive(upload, max_unpacked_bytes=settings.MAX_UNPACKED_BYTES,
                                   max_members=settings.MAX_ARCHIVE_MEMBERS,
                                   bounds=InspectBounds(max_ratio=settings.MAX_ARCHIVE_RATIO,
                                                        max_seconds=settings.ARCHIVE_INSPECT_SECONDS))
        except ArchiveError as exc:
            raise SubmitError(f"code archive refused: {exc}", field="code") from None
        if info.files == 0:
            raise SubmitError("code archive refused: it holds no files (an empty code folder?); a job "
                              "runs its command in the unpacked code", field="code")
    except BaseException:
        upload.unlink(missing_ok=True)
        raise
    return upload, info


def disk_caps_for(tenant, manifest, quota):
    """The job's disk caps within its tenant's limits (jobs.disk; `quota`, the tenant's, None for
    none); refused while the tenant's stored output fills its storage quota, since the job's results
    could only be stored past it."""
    try:
        caps = disk.caps_for(manifest.disk, quota)
    except disk.DiskError as exc:
        raise SubmitError(str(exc), field=exc.field) from None
    limited = quota is not None and quota.storage_bytes is not None  # counting what is stored costs a query
    state, reason = quotas.storage_state(quota, quotas.stored_bytes(tenant) if limited else 0)
    if state != "ok":
        raise SubmitError(reason, field="storage")
    return caps


def _hold_queue_place(tenant, intake):
    """Inside the transaction that queues the job: 429 while the tenant has as many jobs queued as its
    intake allows, counted under its row lock, so submissions racing each other cannot pass the limit
    together."""
    Tenant.objects.select_for_update(no_key=True).filter(pk=tenant.pk).first()
    queued = tenant.jobs.filter(status=Status.QUEUED).count()
    if queued >= intake.queued_jobs:
        raise SubmitError(f"too many queued jobs: tenant {tenant.slug!r} has {queued} jobs queued, the most it may "
                          f"have ({intake.source('queued_jobs')}); submit again once some have started or "
                          "been terminated", status=429)


def queue_room(tenant):
    """How many more jobs the tenant may have queued now (its intake's queued_jobs)."""
    intake = quotas.intake_of(quotas.quota_of(tenant))
    return max(0, intake.queued_jobs - tenant.jobs.filter(status=Status.QUEUED).count())


def _save_upload(code_file):
    fd, name = tempfile.mkstemp(dir=storage.uploads_dir(), prefix=storage.UPLOAD_PREFIX)
    with os.fdopen(fd, "wb") as out:
        for chunk in code_file.chunks():
            out.write(chunk)
    return Path(name)


def store_job(tenant, owner, manifest, manifest_text, code, kind, *, private=False, disk_caps=None,
              runtime_extra=None, credentials=None, queue_limit=None, code_sha256=None, link_code=False):
    """Store a validated job with its code (a copy of the archive `code`, of `kind` zip or tar.gz) and
    queue it. `credentials`: the data stores' secrets when they are not the manifest's own (an
    experiment's trial: they were sealed beside the experiment). `queue_limit`: the tenant's intake,
    whose queued_jobs is checked under its row lock (None: the caller keeps within it itself).
    `code_sha256`: the archive's digest when the caller knows it; `link_code`: the archive is a
    read-only one many jobs share (an experiment's), linked into the job's folder rather than copied."""
    # Data-store credentials never reach the database: stored redacted, sealed beside the job instead.
    job = Job(tenant=tenant, owner=owner, name=manifest.name, description=manifest.description,
              framework=manifest.framework, manifest=datastores.redact(manifest.raw),
              manifest_yaml=datastores.redact_yaml(manifest_text), learners=manifest.learners, gpus=manifest.gpus,
              cpus=manifest.cpus, memory_bytes=manifest.memory_bytes, priority=manifest.priority, private=private,
              code_sha256=code_sha256 or storage.sha256_of(code), code_bytes=Path(code).stat().st_size,
              runtime={**runtime.from_manifest(manifest, disk_caps=disk_caps), **(runtime_extra or {})})
    folder = storage.create_job_dir(tenant.slug, job.id)
    with storage.removed_on_error(tenant.slug, job.id):
        _place_code(code, folder / f"code.{kind}", link=link_code)
        if credentials is None:
            transfers.seal_submitted_credentials(folder, manifest)
        else:
            transfers.seal_credentials(folder, credentials)
    with transaction.atomic(), storage.removed_on_error(tenant.slug, job.id):
        if queue_limit is not None:
            _hold_queue_place(tenant, queue_limit)
        job.save(force_insert=True)
        storage.unstage_on_commit(tenant.slug, job.id)
        job.events.create(to_status=Status.QUEUED, actor=owner.username, reason="submitted")
        dispatch.wake_scheduler_on_commit()  # first: its wake is what the job waits for
        live.publish_status_on_commit(job)  # the jobs list shows it at once
    return job


def _place_code(code, target, *, link):
    if link:
        try:
            os.link(code, target)
            return
        except OSError:  # another file system, or the archive at its file system's most links
            pass
    shutil.copyfile(code, target)


def code_archive(job):
    folder = storage.job_dir(job.tenant.slug, job.id)
    return next(iter(sorted(folder.glob("code.*"))), None)
