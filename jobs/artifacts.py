"""A job's stored output: its log written to storage, every result, checkpoint and log recorded as
an Artifact, and all of it pushed to the job's result stores (jobs.transfers).

Recording is bounded, because it runs on a shared worker: at most `MAX_RECORDED_FILES` files per job
(its log and checkpoints first, then results) and at most `RECORD_SECONDS` of hashing; what is left
over stays in storage, unlisted, and the job's log says how much and which limit stopped it."""
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings

from jobs import checkpoints, storage, transfers
from jobs.models import Artifact, LogLine

PARALLEL_HASH_BYTES = 4 * 1024 * 1024  # below this, starting threads costs more than it saves
RECORD_BATCH = 500  # files hashed between two looks at the clock
RECORD_ORDER = ("logs", "checkpoints", "results")  # what a job's page needs most first


def store_results(job, run):
    """Store the job's output; returns None when everything was stored and pushed, else what failed
    (the files stay downloadable from the platform either way). `run`: the job's jobs.runtime.Runtime.

    The caller decides what a failed push means for the job (the attempt failed and will be retried:
    nothing; it succeeded: the job fails saying so), so this never changes the job's status."""
    folder = storage.job_dir(job.tenant.slug, job.id)
    _write_log(job, folder)
    checkpoints.apply_retention(folder, job.attempt)
    refused = []
    if notice := _record_artifacts(job, refused):
        transfers.system_log(job.id, notice)
    if refused:
        transfers.system_log(job.id, _refused_notice(refused))
    return transfers.push_results(job, run)


def _write_log(job, folder):
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    tmp = logs / ".tmp-training.log"
    with open(tmp, "w", encoding="utf-8") as out:
        for line in LogLine.objects.filter(job=job).order_by("seq").values_list("line", flat=True).iterator(5000):
            out.write(line + "\n")
    os.replace(tmp, logs / "training.log")


def _record_artifacts(job, refused=None):
    """Record the job's files as Artifacts, within the limits; returns None, or the notice saying
    what was left unrecorded and why. Files whose names no artifact may have are added to `refused`
    as (name, why) (storage.artifact_name_problem).

    One query for what is recorded already, one insert per thousand new rows, an update only for what
    changed, rather than queries per file, which made a job of many checkpoints slow to complete."""
    deadline = time.monotonic() + settings.RECORD_SECONDS
    # "job" too: read through the reverse relation, Django sets the job on each row from its job_id,
    # which only() would defer: one query per file recorded (a job of thousands of files, thousands of
    # round trips).
    recorded = {artifact.name: artifact for artifact in job.artifacts.only("id", "job", "name", "size", "sha256")}
    listing = storage.list_artifacts(job.tenant.slug, job.id, folders=RECORD_ORDER, refused=refused)
    files = list(itertools.islice(listing, settings.MAX_RECORDED_FILES))
    fresh, done = [], 0
    while done < len(files) and time.monotonic() < deadline:
        batch = files[done:done + RECORD_BATCH]
        for (name, kind, path), sha256 in zip(batch, _digests([path for _, _, path in batch])):
            values = {"kind": kind, "size": path.stat().st_size, "sha256": sha256,
                      "complete": kind != Artifact.Kind.CHECKPOINT or checkpoints.is_complete(path)}
            artifact = recorded.pop(name, None)
            if artifact is None:
                fresh.append(Artifact(job=job, name=name, attempt=job.attempt, **values))
            elif (artifact.size, artifact.sha256) != (values["size"], values["sha256"]):
                Artifact.objects.filter(pk=artifact.pk).update(**values)
        done += len(batch)
    # Only the worker holding the job's finish writes here (jobs.outbox claims it); a row another
    # wrote meanwhile regardless is kept, as get_or_create kept it.
    Artifact.objects.bulk_create(fresh, ignore_conflicts=True, batch_size=1000)
    left, counted = _count_rest(listing, deadline)
    left += len(files) - done
    if left and recorded:  # not every file was seen: only rows whose file is gone are stale
        base = storage.job_dir(job.tenant.slug, job.id)
        recorded = {name: a for name, a in recorded.items() if not (base / name).is_file()}
    if recorded:  # files retention removed
        Artifact.objects.filter(pk__in=[artifact.pk for artifact in recorded.values()]).delete()
    if not left:
        return None
    stopped = (f"at most {settings.MAX_RECORDED_FILES:,} files are recorded per job (TRAINYARD_MAX_RECORDED_FILES)"
               if done == len(files) else
               f"recording stops after {settings.RECORD_SECONDS:g}s (TRAINYARD_RECORD_SECONDS)")
    return (f"[trainyard] {'at least ' if not counted else ''}{left:,} files of this job's output were not "
            f"recorded ({done:,} were): {stopped}. They stay in the job's storage and result stores, but are "
            "not listed or downloadable here.")


def _refused_notice(refused, shown=3):
    """The job's log line for files left unrecorded for their names."""
    named = "; ".join(f"{name!r}: {why}" for name, why in refused[:shown])
    more = f"; and {len(refused) - shown} more" if len(refused) > shown else ""
    return (f"[trainyard] {len(refused):,} files of this job's output were not recorded because of their names "
            f"({named}{more}). They stay in the job's storage, but are not listed or downloadable here.")


def _count_rest(listing, deadline):
    """(how many files the listing still holds, whether all were counted before the deadline)."""
    left = 0
    for left, _ in enumerate(listing, start=1):
        if left % RECORD_BATCH == 0 and time.monotonic() > deadline:
            return left, False
    return left, True


def _digests(paths):
    """The files' SHA-256, several at once where there is much to read: hashlib lets go of the GIL
    while it hashes, and the learners have ended, so their cores are free (hashing a job's checkpoints
    one after another was most of the time spent storing its results)."""
    if len(paths) < 2 or sum(path.stat().st_size for path in paths) < PARALLEL_HASH_BYTES:
        return [storage.sha256_of(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(storage.sha256_of, paths))
