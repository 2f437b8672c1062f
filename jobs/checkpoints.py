"""Checkpoints: where each attempt writes them, which ones are complete, which one is "last good",
and how many are kept.

Every attempt writes into its own folder (`checkpoints/attempt-<n>/`) and sees the earlier
attempts' folders read-only, so a crashing attempt can never damage the checkpoint it resumed from.
A checkpoint is offered for resuming only when it passes `is_complete`: temporary names never do,
and zip-based formats (PyTorch's `torch.save`, NumPy's `.npz`, Keras' `.keras`) must have an intact
central directory, which a write cut short never has.

A learner may fill its folder with files (up to its disk caps' entries), and these scans run on the
workers every tenant shares, at every store, halt and deploy. Opening files is their cost: the one to
resume from is the newest complete one, so files are opened newest first until it is found, and
retention opens no more than the newest MAX_CHECKED. Listing is cheaper, and bounded too (MAX_FILES).
"""
import itertools
import zipfile
from pathlib import Path

from django.conf import settings

from jobs.datastores import regular_files

TEMPORARY_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock")
ZIP_FORMATS = (".pt", ".pth", ".npz", ".zip", ".keras", ".ckpt")
MAX_FILES = 100_000  # entries of one attempt's folder listed; a folder holding more is seen in part
MAX_CHECKED = 10_000  # files retention opens to check, newest first; older ones are left as they are


def attempt_dir(job_folder, attempt):
    return Path(job_folder) / "checkpoints" / f"attempt-{attempt}"


def is_complete(path):
    """Whether a checkpoint file is whole enough to resume from."""
    path = Path(path)
    name = path.name
    if name.startswith(".") or name.endswith(TEMPORARY_SUFFIXES) or not path.is_file():
        return False
    if path.stat().st_size == 0:
        return False
    if path.suffix in ZIP_FORMATS:
        if not zipfile.is_zipfile(path):
            # torch.save(..., _use_new_zipfile_serialization=False) writes a plain pickle; those
            # cannot be checked, so only a file that starts like a zip must end like one.
            with open(path, "rb") as handle:
                return handle.read(4) != b"PK\x03\x04"
    return True


def newest_first(folder):
    """The files in `folder` (at most MAX_FILES of them, found as jobs.datastores.regular_files walks), newest first."""
    files = []
    for path in itertools.islice(regular_files(folder), MAX_FILES):
        try:
            if path.is_file():
                files.append((path.stat().st_mtime, path))
        except OSError:  # gone meanwhile
            continue
    return [path for _, path in sorted(files, key=lambda found: found[0], reverse=True)]


def complete_ones(folder, *, checked=None):
    """The complete checkpoints in `folder`, newest first, each checked only when it is reached (and only
    the newest `checked` files, when given)."""
    return (path for path in newest_first(folder)[:checked] if is_complete(path))


def last_good(job_folder, before_attempt):
    """The newest complete checkpoint of the latest attempt before `before_attempt` that left one."""
    root = Path(job_folder) / "checkpoints"
    for attempt in range(before_attempt - 1, 0, -1):
        folder = root / f"attempt-{attempt}"
        if folder.is_dir() and (found := next(complete_ones(folder), None)) is not None:
            return found
    return None


def apply_retention(job_folder, attempt, keep=None):
    """Delete all but the newest `keep` complete checkpoints of an attempt; return what was removed."""
    keep = settings.CHECKPOINTS_KEPT_PER_ATTEMPT if keep is None else keep
    if keep <= 0:
        return []
    folder = attempt_dir(job_folder, attempt)
    if not folder.is_dir():
        return []
    removed = list(itertools.islice(complete_ones(folder, checked=MAX_CHECKED), keep, None))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
