"""A job's stored output: its log written to storage, every result, checkpoint and log recorded as
an Artifact, and all of it pushed to the job's result stores (jobs.transfers)."""
import os
from concurrent.futures import ThreadPoolExecutor

from jobs import checkpoints, storage, transfers
from jobs.models import Artifact, LogLine

PARALLEL_HASH_BYTES = 4 * 1024 * 1024  # below this, starting threads costs more than it saves


def store_results(job, run):
    """Store the job's output; returns None when everything was stored and pushed, else what failed
    (the files stay downloadable from the platform either way). `run`: the job's jobs.runtime.Runtime.

    The caller decides what a failed push means for the job (the attempt failed and will be retried:
    nothing; it succeeded: the job fails saying so), so this never changes the job's status."""
    folder = storage.job_dir(job.tenant.slug, job.id)
    _write_log(job, folder)
    checkpoints.apply_retention(folder, job.attempt)
    _record_artifacts(job)
    return transfers.push_results(job, run)


def _write_log(job, folder):
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    tmp = logs / ".tmp-training.log"
    with open(tmp, "w", encoding="utf-8") as out:
        for line in LogLine.objects.filter(job=job).order_by("seq").values_list("line", flat=True).iterator(5000):
            out.write(line + "\n")
    os.replace(tmp, logs / "training.log")


def _record_artifacts(job):
    """Record every file as an Artifact: one query for what is recorded already, one insert for what
    is new, an update only for what changed. (Two queries per file before: a quarter of the time from
    STORING to COMPLETED for a job with a dozen checkpoints, in bench frameworks' timeline.)"""
    # "job" too: read through the reverse relation, Django sets the job on each row from its job_id,
    # which only() would defer: one query per file recorded (a PyTorch example's second store: 8 more
    # queries, about 1 ms of its 12 on SQLite; a job of thousands of files, thousands of round trips).
    recorded = {artifact.name: artifact for artifact in job.artifacts.only("id", "job", "name", "size", "sha256")}
    files = list(storage.list_artifacts(job.tenant.slug, job.id))
    fresh = []
    for (name, kind, path), sha256 in zip(files, _digests([path for _, _, path in files])):
        values = {"kind": kind, "size": path.stat().st_size, "sha256": sha256,
                  "complete": kind != Artifact.Kind.CHECKPOINT or checkpoints.is_complete(path)}
        artifact = recorded.pop(name, None)
        if artifact is None:
            fresh.append(Artifact(job=job, name=name, attempt=job.attempt, **values))
        elif (artifact.size, artifact.sha256) != (values["size"], values["sha256"]):
            Artifact.objects.filter(pk=artifact.pk).update(**values)
    # Only the worker holding the job's finish writes here (jobs.outbox claims it); a row another
    # wrote meanwhile regardless is kept, as get_or_create kept it.
    Artifact.objects.bulk_create(fresh, ignore_conflicts=True)
    if recorded:  # files retention removed
        Artifact.objects.filter(pk__in=[artifact.pk for artifact in recorded.values()]).delete()


def _digests(paths):
    """The files' SHA-256, several at once where there is much to read: hashlib lets go of the GIL
    while it hashes, and the learners have ended, so their cores are free (a PyTorch example's four
    4 MB checkpoints took 16 of the 24 ms of storing its results, one after another)."""
    if len(paths) < 2 or sum(path.stat().st_size for path in paths) < PARALLEL_HASH_BYTES:
        return [storage.sha256_of(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(storage.sha256_of, paths))
