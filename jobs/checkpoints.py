"""Checkpoints: where each attempt writes them, which ones are complete, which one is "last good",
and how many are kept.

Every attempt writes into its own folder (`checkpoints/attempt-<n>/`) and sees the earlier
attempts' folders read-only, so a crashing attempt can never damage the checkpoint it resumed from.
A checkpoint is what stands at the top of that folder: a file, or a folder saved as one (a Hugging
Face `checkpoint-N/`, a sharded save), as new as the newest file in it. It is offered for resuming
only when it passes `is_complete`: temporary names never do, and a file that starts like a zip
(PyTorch's `torch.save` whatever its name, NumPy's `.npz`, Keras' `.keras`) must have an intact
central directory, a `.safetensors` file the length its header gives, which a write cut short never
has. Retention keeps whole checkpoints, so no file of one it keeps is deleted.

A learner may fill its folder with files (up to its disk caps' entries), and these scans run on the
workers every tenant shares, at every store, halt and deploy. Opening files is their cost: the one to
resume from is the newest complete one, so checkpoints are opened newest first until it is found, and
retention opens no more than the newest MAX_CHECKED files. Listing is cheaper, and bounded too
(MAX_FILES).
"""
import itertools
import os
import struct
import zipfile
from pathlib import Path

from django.conf import settings

from jobs.datastores import regular_files
from learner_agent import trees

TEMPORARY_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock")
ZIP_MAGIC = b"PK\x03\x04"
MAX_FILES = 100_000  # files of one attempt's folder listed; a folder holding more is seen in part
MAX_CHECKED = 10_000  # files retention opens to check, newest checkpoints first; older ones are left as they are


def attempt_dir(job_folder, attempt):
    return Path(job_folder) / "checkpoints" / f"attempt-{attempt}"


def is_complete(path):
    """Whether a checkpoint (a file, or a folder of them) is whole enough to resume from."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        files = list(itertools.islice(regular_files(path), MAX_FILES))
        return bool(files) and all(_file_complete(file) for file in files)
    return _file_complete(path)


def _file_complete(path):
    name = path.name
    if name.startswith(".") or name.endswith(TEMPORARY_SUFFIXES) or not path.is_file() or path.is_symlink():
        return False
    size = path.stat().st_size
    if size == 0:
        return False
    with open(path, "rb") as handle:
        head = handle.read(8)
    if ZIP_MAGIC.startswith(head[:4]):  # a zip, or the start of one cut short
        return zipfile.is_zipfile(path)
    if path.suffix == ".safetensors":  # 8 bytes of header length, the JSON header, then the tensors
        return len(head) == 8 and 8 + struct.unpack("<Q", head)[0] <= size
    # Anything else (a pickle, HDF5, ...) cannot be checked without reading it whole.
    return True


def newest_first(folder):
    """The checkpoints in `folder`, newest first: each file at its top, and each folder at its top that
    holds files, as new as its newest file (at most MAX_FILES files are looked at in all)."""
    found, budget = [], MAX_FILES
    try:
        with os.scandir(folder) as listing:
            entries = list(itertools.islice(listing, MAX_FILES))
    except OSError:
        return []
    for entry in entries:
        if budget <= 0:
            break
        try:
            if entry.is_file(follow_symlinks=False):
                budget -= 1
                found.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
            elif entry.is_dir(follow_symlinks=False):
                files = list(itertools.islice(regular_files(entry.path), budget))
                budget -= len(files)
                if files:
                    found.append((max(file.stat().st_mtime for file in files), Path(entry.path)))
        except OSError:  # gone meanwhile
            continue
    return [path for _, path in sorted(found, key=lambda unit: unit[0], reverse=True)]


def written_at(checkpoint):
    """When a checkpoint was last written (a folder: its newest file)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return checkpoint.stat().st_mtime
    return max((file.stat().st_mtime for file in itertools.islice(regular_files(checkpoint), MAX_FILES)),
               default=checkpoint.stat().st_mtime)


def complete_ones(folder, *, checked=None):
    """The complete checkpoints in `folder`, newest first, each checked only when it is reached (and, when
    `checked` is given, only until that many files have been opened)."""
    opened = 0
    for unit in newest_first(folder):
        if checked is not None:
            opened += 1 if not unit.is_dir() else sum(1 for _ in itertools.islice(regular_files(unit), MAX_FILES))
            if opened > checked:
                return
        if is_complete(unit):
            yield unit


def last_good(job_folder, before_attempt):
    """The newest complete checkpoint of the latest attempt before `before_attempt` that left one."""
    for attempt in range(before_attempt - 1, 0, -1):
        folder = attempt_dir(job_folder, attempt)
        if folder.is_dir() and (found := next(complete_ones(folder), None)) is not None:
            return found
    return None


def apply_retention(job_folder, attempt, keep=None):
    """Delete all but the newest `keep` complete checkpoints of an attempt, each whole; return what was removed."""
    keep = settings.CHECKPOINTS_KEPT_PER_ATTEMPT if keep is None else keep
    if keep <= 0:
        return []
    folder = attempt_dir(job_folder, attempt)
    if not folder.is_dir():
        return []
    removed = list(itertools.islice(complete_ones(folder, checked=MAX_CHECKED), keep, None))
    for path in removed:
        if path.is_dir():
            trees.remove(path)
        else:
            path.unlink(missing_ok=True)
    return removed
