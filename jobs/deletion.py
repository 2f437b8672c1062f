"""Deleting a job: what a tenant frees of the storage it keeps, once the job has ended.

`delete` is the member's request: a compare-and-swap marks the ended (or halted) job deleted and writes a
PURGE follow-up in the same transaction, so from that commit on nobody sees the job, it never moves
again (jobs.states), and its files no longer count against the tenant's storage quota. The follow-up
(jobs.outbox, restart-safe like every other) then removes the job's folder (code archive, results,
checkpoints, log files) and its log lines, metric points and artifact rows.

Kept for good: the job's row, its events and its usage records, so the GPU-hours it held stay in the
tenant's accounting and its history in the audit log. Data the job wrote to the user's own data store
is the user's, and is not touched.
"""
from django.db import transaction
from django.utils import timezone

from jobs import outbox, storage
from jobs.models import AT_REST, Artifact, FollowUp, Job, LearnerCredential, LogLine, MetricPoint
from jobs.states import InvalidTransition
from tenants import audit

CHUNK = 10_000  # rows deleted a statement: a long log goes without one statement holding its table for long


class NotDeletable(InvalidTransition):
    """The job cannot be deleted now (it runs, or it belongs to an experiment); answered 409."""


def delete(job, *, actor):
    """Mark the job deleted and queue its purge; NotDeletable with the reason when it cannot be."""
    trial = getattr(job, "trial", None)  # None unless an experiment made the job
    if trial is not None:
        raise NotDeletable(f"job {job.id} is trial {trial.number} of experiment {trial.experiment_id}: "
                           "it is kept with its experiment")
    now = timezone.now()
    with transaction.atomic():
        marked = Job.objects.filter(pk=job.pk, status__in=AT_REST, deleted_at=None).update(deleted_at=now,
                                                                                          deleted_by=actor)
        if not marked:
            status = Job.objects.filter(pk=job.pk).values_list("status", flat=True).first()
            raise NotDeletable(f"job {job.id} is {status}; only a job that has ended or is halted can be deleted "
                               "(terminate it first)")
        outbox.add(job.id, job.attempt, FollowUp.Kind.PURGE)
        with audit.acting_as(actor):
            audit.record("deleted", "job", job.id, tenant=job.tenant,
                         before={"name": job.name, "owner": job.owner.get_username(), "status": job.status})
    job.deleted_at, job.deleted_by = now, actor
    return job


def purge(job_id, attempt):
    """The PURGE follow-up: remove a deleted job's stored data. Waits (outbox.NotYet) while the job's other
    follow-ups are open: a teardown may still be stopping what ran in its folder."""
    job = Job.objects.select_related("tenant").filter(pk=job_id).exclude(deleted_at=None).first()
    if job is None:
        return
    if FollowUp.objects.filter(job_id=job_id, done_at=None).exclude(kind=FollowUp.Kind.PURGE).exists():
        raise outbox.NotYet(f"job {job_id} is still being torn down")
    for model in (LogLine, MetricPoint, Artifact, LearnerCredential):
        _delete_in_chunks(model.objects.filter(job_id=job_id))
    if not storage.remove_job_dir(job.tenant.slug, job_id):
        raise OSError(f"the folder of job {job_id} could not all be removed")


def _delete_in_chunks(rows):
    while ids := list(rows.values_list("pk", flat=True)[:CHUNK]):
        rows.model.objects.filter(pk__in=ids).delete()
