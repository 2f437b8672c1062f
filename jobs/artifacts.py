"""A job's stored output: its log written to storage, every result, checkpoint and log recorded as
an Artifact, and all of it pushed to the job's result stores (jobs.transfers)."""
import os

from jobs import checkpoints, storage, transfers
from jobs.models import Artifact, LogLine


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
    seen = set()
    for name, kind, path in storage.list_artifacts(job.tenant.slug, job.id):
        seen.add(name)
        values = {"kind": kind, "size": path.stat().st_size, "sha256": storage.sha256_of(path),
                  "complete": kind != Artifact.Kind.CHECKPOINT or checkpoints.is_complete(path)}
        artifact, created = Artifact.objects.get_or_create(job=job, name=name, defaults=dict(values, attempt=job.attempt))
        if not created and (artifact.size, artifact.sha256) != (values["size"], values["sha256"]):
            Artifact.objects.filter(pk=artifact.pk).update(**values)
    job.artifacts.exclude(name__in=seen).delete()  # removed by retention
