"""Where a job's files live: its code archive, data, results and checkpoints.

`file://` storage is a directory tree, one folder per tenant and job; the local backend's learners
work directly inside it. Names handed in from outside (artifact downloads) are resolved here only,
so no path can escape a job's folder.

`s3://bucket/prefix` storage keeps the same tree as a working copy on local disk (learners need a
file system; it lives in TRAINYARD_DATA_DIR/storage-s3) and mirrors every job's results,
checkpoints and log into the bucket when the job stores its results (jobs.transfers, through the
same Store interface as the manifests' data stores, jobs.datastores).
"""
import hashlib
import shutil
from pathlib import Path
from urllib.parse import urlparse

from django.conf import settings

from jobs.datastores import regular_files

JOB_SUBDIRS = ("data", "results", "checkpoints")
ARTIFACT_DIRS = {"results": "result", "checkpoints": "checkpoint", "logs": "log"}


class StorageError(Exception):
    pass


def root():
    parsed = urlparse(settings.STORAGE_URL)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "s3":
        return Path(settings.DATA_DIR) / "storage-s3"
    raise StorageError(f"storage {settings.STORAGE_URL!r} is not supported; use file:///path or s3://bucket/prefix")


def mirror_url():
    """The object-store URL results are mirrored to (s3:// storage), or None for file:// storage."""
    return settings.STORAGE_URL if urlparse(settings.STORAGE_URL).scheme == "s3" else None


def job_dir(tenant_slug, job_id):
    return root() / tenant_slug / job_id


def uploads_dir():
    path = root() / ".uploads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def create_job_dir(tenant_slug, job_id):
    path = job_dir(tenant_slug, job_id)
    for sub in JOB_SUBDIRS:
        (path / sub).mkdir(parents=True, exist_ok=True)
    return path


def remove_job_dir(tenant_slug, job_id):
    shutil.rmtree(job_dir(tenant_slug, job_id), ignore_errors=True)


def learner_dir(tenant_slug, job_id, attempt, index):
    return job_dir(tenant_slug, job_id) / f"attempt-{attempt}" / f"learner-{index}"


def sha256_of(path, chunk=1024 * 1024):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def list_artifacts(tenant_slug, job_id, folders=tuple(ARTIFACT_DIRS)):
    """Yield (name, kind, path) for every regular file under results/, checkpoints/ and logs/ (lazily,
    a folder at a time, in the order of `folders`)."""
    base = job_dir(tenant_slug, job_id)
    for folder in folders:
        kind = ARTIFACT_DIRS[folder]
        top = base / folder
        if not top.is_dir():
            continue
        for path in regular_files(top):
            if not path.name.startswith(".tmp"):
                yield path.relative_to(base).as_posix(), kind, path


def artifact_path(tenant_slug, job_id, name):
    """The file behind an artifact name, or None if the name leaves the artifact folders."""
    base = job_dir(tenant_slug, job_id).resolve()
    candidate = (base / name).resolve()
    if base not in candidate.parents or candidate.relative_to(base).parts[0] not in ARTIFACT_DIRS:
        return None
    return candidate if candidate.is_file() else None
