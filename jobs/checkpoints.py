"""Checkpoints: where each attempt writes them, which ones are complete, which one is "last good",
and how many are kept.

Every attempt writes into its own folder (`checkpoints/attempt-<n>/`) and sees the earlier
attempts' folders read-only, so a crashing attempt can never damage the checkpoint it resumed from.
A checkpoint is offered for resuming only when it passes `is_complete`: temporary names never do,
and zip-based formats (PyTorch's `torch.save`, NumPy's `.npz`, Keras' `.keras`) must have an intact
central directory, which a write cut short never has.
"""
import zipfile
from pathlib import Path

from django.conf import settings

TEMPORARY_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock")
ZIP_FORMATS = (".pt", ".pth", ".npz", ".zip", ".keras", ".ckpt")


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


def candidates(job_folder, before_attempt):
    """Complete checkpoints of attempts before `before_attempt`, newest first."""
    root = Path(job_folder) / "checkpoints"
    found = []
    for attempt in range(before_attempt - 1, 0, -1):
        folder = root / f"attempt-{attempt}"
        if folder.is_dir():
            found += sorted((p for p in folder.rglob("*") if is_complete(p)),
                            key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            break  # the most recent attempt that left a good checkpoint wins
    return found


def last_good(job_folder, before_attempt):
    found = candidates(job_folder, before_attempt)
    return found[0] if found else None


def apply_retention(job_folder, attempt, keep=None):
    """Delete all but the newest `keep` complete checkpoints of an attempt; return what was removed."""
    keep = settings.CHECKPOINTS_KEPT_PER_ATTEMPT if keep is None else keep
    if keep <= 0:
        return []
    folder = attempt_dir(job_folder, attempt)
    if not folder.is_dir():
        return []
    files = sorted((p for p in folder.rglob("*") if p.is_file() and is_complete(p)),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    removed = files[keep:]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
