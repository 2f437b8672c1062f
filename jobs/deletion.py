"""Deleting a job or an experiment: what a tenant frees of the storage it keeps, once they have ended.

`delete` is the member's request: a compare-and-swap marks the ended (or halted) job deleted and writes a
PURGE follow-up in the same transaction, so from that commit on nobody sees the job, it never moves
again (jobs.states), and its files no longer count against the tenant's storage quota. The follow-up
(jobs.outbox, restart-safe like every other) then removes the job's folder (code archive, results,
checkpoints, log files) and its log lines, metric points and artifact rows.

Kept for good: the job's row, its events and its usage records, so the GPU-hours it held stay in the
tenant's accounting and its history in the audit log. Data the job wrote to the user's own data store
is the user's, and is not touched.

A finished experiment is deleted with its trials' jobs, each as above, in one transaction. Its own folder
(the code archive its trials share) is staged again first (jobs.storage.stage_dir's mark) and removed once
the deletion commits; should that removal not happen, beat's storage sweep removes a staged folder whose
experiment is deleted, and unstages it again if the deletion never committed.
"""
from django.db import transaction
from django.utils import timezone

from jobs import outbox, storage
from jobs.models import AT_REST, Artifact, Experiment, FollowUp, Job, LearnerCredential, LogLine, MetricPoint
from jobs.states import InvalidTransition
from tenants import audit

CHUNK = 10_000  # rows deleted a statement: a long log goes without one statement holding its table for long


class NotDeletable(InvalidTransition):
    """The job or experiment cannot be deleted now (it runs, or the job belongs to an experiment); 409."""


def delete(job, *, actor):
    """Mark the job deleted and queue its purge; NotDeletable with the reason when it cannot be."""
    trial = getattr(job, "trial", None)  # None unless an experiment made the job
    if trial is not None:
        raise NotDeletable(f"job {job.id} is trial {trial.number} of experiment {trial.experiment_id}: "
                           "it goes when its experiment is deleted")
    now = timezone.now()
    with transaction.atomic():
        if not _mark_jobs([job], now=now, actor=actor):
            status = Job.objects.filter(pk=job.pk).values_list("status", flat=True).first()
            raise NotDeletable(f"job {job.id} is {status}; only a job that has ended or is halted can be deleted "
                               "(terminate it first)")
        with audit.acting_as(actor):
            audit.record("deleted", "job", job.id, tenant=job.tenant,
                         before={"name": job.name, "owner": job.owner.get_username(), "status": job.status})
    job.deleted_at, job.deleted_by = now, actor
    return job


def delete_experiment(experiment, *, actor):
    """Mark the finished experiment and its trials' jobs deleted, queue the jobs' purges and remove its
    folder once that commits; NotDeletable with the reason when it cannot be."""
    slug, now = experiment.tenant.slug, timezone.now()
    storage.stage_dir(slug, experiment.id)
    try:
        with transaction.atomic():
            row = _finished_experiment(experiment)
            trials = list(Job.objects.filter(trial__experiment=row, deleted_at=None))
            if _mark_jobs(trials, now=now, actor=actor) < len(trials):
                raise NotDeletable(f"experiment {row.id} has trials still stopping; try again in a moment")
            Experiment.objects.filter(pk=row.pk).update(deleted_at=now, deleted_by=actor)
            with audit.acting_as(actor):
                audit.record("deleted", "experiment", row.id, tenant=experiment.tenant,
                             before={"name": row.name, "owner": experiment.owner.get_username(), "state": row.state,
                                     "trials": len(trials)})
            transaction.on_commit(lambda: storage.remove_job_dir(slug, row.id))
    except NotDeletable:  # refused, so nothing committed: the folder is its experiment's again
        storage.unstage(slug, experiment.id)
        raise
    experiment.deleted_at, experiment.deleted_by = now, actor
    return experiment


def _finished_experiment(experiment):
    """The experiment's row, locked, if it has finished and is not deleted; else NotDeletable."""
    row = Experiment.objects.select_for_update().filter(pk=experiment.pk, deleted_at=None).first()
    if row is None or row.finished_at is None:
        state = row.state if row else "deleted"
        stopping = " and its trials are still stopping" if state == Experiment.State.TERMINATED else ""
        raise NotDeletable(f"experiment {experiment.id} is {state}{stopping}; only a finished experiment can be "
                           "deleted (kill it first)")
    return row


def _mark_jobs(jobs, *, now, actor):
    """Mark those of `jobs` at rest deleted and queue their purges, in the caller's transaction; how many."""
    marked = Job.objects.filter(pk__in=[job.pk for job in jobs], status__in=AT_REST, deleted_at=None)
    attempts = dict(marked.select_for_update().values_list("pk", "attempt"))  # held until the caller commits
    count = marked.update(deleted_at=now, deleted_by=actor)
    for job_id, attempt in attempts.items():
        outbox.add(job_id, attempt, FollowUp.Kind.PURGE)
    return count


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
