"""Where a job's files live: its code archive, data, results and checkpoints.

`file://` storage is a directory tree, one folder per tenant and job; the local backend's learners
work directly inside it. Names handed in from outside (artifact downloads) are resolved here only,
so no path can escape a job's folder.

`s3://bucket/prefix` storage keeps the same tree as a working copy on local disk (learners need a
file system; it lives in TRAINYARD_DATA_DIR/storage-s3) and mirrors every job's results,
checkpoints and log into the bucket when the job stores its results (jobs.transfers, through the
same Store interface as the manifests' data stores, jobs.datastores).
"""
import contextlib
import hashlib
import os
import stat
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from django.conf import settings
from django.db import transaction

from jobs.datastores import regular_files
from learner_agent import trees

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


UPLOAD_PREFIX = ".tmp-upload-"  # an upload being checked, in uploads_dir(), until its job is stored


def uploads_dir():
    path = root() / ".uploads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def uploads_older_than(cutoff):
    """The uploads saved before `cutoff` (a time.time()) that are still there."""
    return [Path(entry.path) for entry in _entries(uploads_dir())
            if entry.name.startswith(UPLOAD_PREFIX) and _changed_before(entry, cutoff)]


def folders_holding(file_name, tenant_slugs, *, before=None):
    """(tenant slug, folder name) of every folder in these tenants' storage (a job's or an experiment's,
    named by its id) holding `file_name`, last changed before `before` (a time.time()) when given."""
    found = []
    for slug in sorted(tenant_slugs):
        for entry in _entries(root() / slug):
            try:
                changed = os.stat(Path(entry.path, file_name), follow_symlinks=False).st_mtime
            except (FileNotFoundError, NotADirectoryError):
                continue
            if before is None or changed < before:
                found.append((slug, entry.name))
    return found


def _entries(folder):
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except FileNotFoundError:  # a tenant that never stored anything
        return []


def _changed_before(entry, cutoff):
    try:
        return entry.stat(follow_symlinks=False).st_mtime < cutoff
    except FileNotFoundError:  # removed meanwhile
        return False


# A job's or an experiment's folder is made before its row commits, so a process killed in between leaves
# a folder no row owns. It is made staged, with this mark in it, and the row's commit removes the mark
# (unstage_on_commit): only a staged folder can be such a leftover (jobs.reconcile.sweep_storage), and a
# folder a committed row once owned is never taken for one, whatever the database says later.
STAGED_MARK = ".staged"


def stage_dir(tenant_slug, name):
    """A new folder for the job or experiment `name`, staged until unstage_on_commit's commit."""
    path = job_dir(tenant_slug, name)
    path.mkdir(parents=True, exist_ok=True)
    (path / STAGED_MARK).touch()
    return path


def unstage_on_commit(tenant_slug, name):
    """The folder is its row's once the transaction saving the row commits."""
    transaction.on_commit(lambda: unstage(tenant_slug, name))


def unstage(tenant_slug, name):
    (job_dir(tenant_slug, name) / STAGED_MARK).unlink(missing_ok=True)


@contextlib.contextmanager
def removed_on_error(tenant_slug, name):
    """The staged folder is removed if the block fails. Keep a commit out of the block: one that fails may
    have happened after all, and its folder is then left to the sweep, which looks for the row."""
    try:
        yield
    except Exception:
        remove_job_dir(tenant_slug, name)
        raise


def create_job_dir(tenant_slug, job_id):
    path = stage_dir(tenant_slug, job_id)
    for sub in JOB_SUBDIRS:
        (path / sub).mkdir(parents=True, exist_ok=True)
    return path


def remove_job_dir(tenant_slug, job_id):
    """Whether it is gone. Its learners' folders may nest past what rmtree can remove."""
    return trees.remove(job_dir(tenant_slug, job_id))


def learner_dir(tenant_slug, job_id, attempt, index):
    return job_dir(tenant_slug, job_id) / f"attempt-{attempt}" / f"learner-{index}"


def sha256_of(path, chunk=1024 * 1024):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def list_artifacts(tenant_slug, job_id, folders=tuple(ARTIFACT_DIRS), *, refused=None):
    """Yield (name, kind, path) for every regular file under results/, checkpoints/ and logs/ (lazily,
    a folder at a time, in the order of `folders`). A file whose name cannot be an artifact's
    (artifact_name_problem) is not yielded; it is appended to `refused`, when given, as (name, why)."""
    base = job_dir(tenant_slug, job_id)
    for folder in folders:
        kind = ARTIFACT_DIRS[folder]
        top = base / folder
        if not top.is_dir():
            continue
        for path in regular_files(top):
            if path.name.startswith(".tmp"):
                continue
            name = path.relative_to(base).as_posix()
            if (why := artifact_name_problem(name)) is not None:
                if refused is not None:
                    refused.append((name, why))
                continue
            yield name, kind, path


MAX_ARTIFACT_NAME = 500  # Artifact.name


def artifact_name_problem(name):
    """Why a file's name (relative to the job's folder) cannot be an artifact's, or None.

    An artifact's name is its row's key, its download URL's path and its download's file name, so
    every one of them must carry it unchanged: a newline was recorded but could never be downloaded
    (a URL path cannot match it, a header cannot hold it). Learners' files are hostile, so names with
    control or other unprintable characters (bidi overrides that disguise an extension, bytes that are
    not UTF-8, which the database cannot store) and names longer than the column are refused."""
    if len(name) > MAX_ARTIFACT_NAME:
        return f"longer than {MAX_ARTIFACT_NAME} characters"
    if not name.isprintable():
        return "it holds a control or other unprintable character (a newline, a byte that is not UTF-8)"
    return None


def open_artifact(tenant_slug, job_id, name):
    """The file behind an artifact name, open for reading, or None if the name leaves the artifact
    folders or no plain file is there.

    Opened one folder at a time, each without following a link (O_NOFOLLOW), never by its path: the
    learner writes its results folder, and one swapping a link to any file of the platform's (its
    secret key, another tenant's results) in for a checked file between a check and an open would
    have the web process read that file for it."""
    parts = PurePosixPath(name).parts
    if len(parts) < 2 or parts[0] not in ARTIFACT_DIRS or any(part in ("/", ".", "..") for part in parts):
        return None
    folder_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        folder = os.open(job_dir(tenant_slug, job_id), folder_flags)  # the platform's own folders
        try:
            for part in parts[:-1]:
                inner = os.open(part, folder_flags, dir_fd=folder)
                os.close(folder)
                folder = inner
            # O_NONBLOCK: a FIFO put there must not hold the request; a plain file reads the same.
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError:  # not there, a link, not a folder
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")
