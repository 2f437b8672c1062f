"""Deleting a job or an experiment: what a tenant frees of the storage it keeps, once they have ended.

`delete` is the member's request: a compare-and-swap marks the ended (or halted) job deleted, so from
that commit on nobody sees the job and it never moves again (jobs.states). `purge_pass` (celery beat,
every RECONCILE_INTERVAL_S) then removes each deleted job's folder (code archive, results, checkpoints,
log files) and its log lines, metric points and artifact rows, and marks it purged; its files count
against the tenant's storage quota until then, as they take the disk until then. The marks are the
record, so a pass killed midway leaves the rest to the next. A pass takes a few jobs of each tenant in
turn within a time budget: one tenant deleting an experiment of 10,000 trials does not hold the
lifecycle worker from the others' deploys.

Kept for good: the job's row, its events and its usage records, so the GPU-hours it held stay in the
tenant's accounting and its history in the audit log. Data the job wrote to the user's own data store
is the user's, and is not touched.

Once a deletion commits, the sockets that follow its jobs hear of it (jobs.live): open jobs lists drop
them, their own pages say so, and scripts waiting on them stop.

A finished experiment is deleted with its trials' jobs, each as above, in one transaction. Its own folder
(the code archive its trials share) is staged again first (jobs.storage.stage_dir's mark) and removed once
the deletion commits; should that removal not happen, beat's storage sweep removes a staged folder whose
experiment is deleted, and unstages it again if the deletion never committed.
"""
import logging
import time

from django.db import transaction
from django.utils import timezone

from jobs import live, storage
from jobs.models import AT_REST, Artifact, Experiment, FollowUp, Job, LearnerCredential, LogLine, MetricPoint
from jobs.states import InvalidTransition
from tenants import audit

log = logging.getLogger(__name__)
CHUNK = 10_000  # rows deleted a statement: a long log goes without one statement holding its table for long
PASS_BUDGET_S = 2.0  # a pass starts no purge past this, so it never holds its worker for long
PER_TENANT = 5  # jobs of one tenant a round of the pass takes before the next tenant's


class NotDeletable(InvalidTransition):
    """The job or experiment cannot be deleted now (it runs, or the job belongs to an experiment); 409."""


class AlreadyDeleted(NotDeletable):
    """Another request deleted it after this one found it: it is gone, a 404 (portal.api) as for every
    request after."""


def delete(job, *, actor):
    """Mark the job deleted (the purge pass removes its data); NotDeletable with the reason when it cannot be."""
    trial = getattr(job, "trial", None)  # None unless an experiment made the job
    if trial is not None:
        raise NotDeletable(f"job {job.id} is trial {trial.number} of experiment {trial.experiment_id}: "
                           "it goes when its experiment is deleted")
    now = timezone.now()
    with transaction.atomic():
        if not _mark_jobs([job], now=now, actor=actor):
            status, gone = Job.objects.filter(pk=job.pk).values_list("status", "deleted_at").first()
            if gone:
                raise AlreadyDeleted(f"job {job.id} is deleted")
            raise NotDeletable(f"job {job.id} is {status}; only a job that has ended or is halted can be deleted "
                               "(terminate it first)")
        with audit.acting_as(actor):
            audit.record("deleted", "job", job.id, tenant=job.tenant,
                         before={"name": job.name, "owner": job.owner.get_username(), "status": job.status})
        live.publish_deleted_on_commit([job], when=now)
    job.deleted_at, job.deleted_by = now, actor
    return job


def delete_experiment(experiment, *, actor):
    """Mark the finished experiment and its trials' jobs deleted and remove its folder once that commits;
    NotDeletable with the reason when it cannot be."""
    slug, now = experiment.tenant.slug, timezone.now()
    storage.stage_dir(slug, experiment.id)
    try:
        with transaction.atomic():
            row = _finished_experiment(experiment)
            # Newest first: their pages are the likeliest open, and the first are the ones told (jobs.live).
            trials = list(Job.objects.filter(trial__experiment=row, deleted_at=None).order_by("-trial__number"))
            if _mark_jobs(trials, now=now, actor=actor) < len(trials):
                raise NotDeletable(f"experiment {row.id} has trials still stopping; try again in a moment")
            Experiment.objects.filter(pk=row.pk).update(deleted_at=now, deleted_by=actor)
            with audit.acting_as(actor):
                audit.record("deleted", "experiment", row.id, tenant=experiment.tenant,
                             before={"name": row.name, "owner": experiment.owner.get_username(), "state": row.state,
                                     "trials": len(trials)})
            live.publish_deleted_on_commit(trials, when=now)
            transaction.on_commit(lambda: storage.remove_job_dir(slug, row.id))
    except AlreadyDeleted:  # the other deletion removed the folder, which staging here made again
        storage.remove_job_dir(slug, experiment.id)
        raise
    except NotDeletable:  # refused, so nothing committed: the folder is its experiment's again
        storage.unstage(slug, experiment.id)
        raise
    experiment.deleted_at, experiment.deleted_by = now, actor
    return experiment


def _finished_experiment(experiment):
    """The experiment's row, locked, if it has finished and is not deleted; else NotDeletable."""
    row = Experiment.objects.select_for_update().filter(pk=experiment.pk, deleted_at=None).first()
    if row is None:
        raise AlreadyDeleted(f"experiment {experiment.id} is deleted")
    if row.finished_at is None:
        stopping = " and its trials are still stopping" if row.state == Experiment.State.TERMINATED else ""
        raise NotDeletable(f"experiment {experiment.id} is {row.state}{stopping}; only a finished experiment can be "
                           "deleted (kill it first)")
    return row


def _mark_jobs(jobs, *, now, actor):
    """Mark those of `jobs` at rest deleted, in the caller's transaction; how many."""
    return Job.objects.filter(pk__in=[job.pk for job in jobs], status__in=AT_REST, deleted_at=None).update(
        deleted_at=now, deleted_by=actor)


# --- the purge pass ----------------------------------------------------------------------------------------
def purge_pass(budget_s=PASS_BUDGET_S):
    """Purge deleted jobs, a few of each tenant in turn, until none is left or the budget is spent; how
    many. A job whose teardown is still open (it may be stopping what ran in its folder) waits. A purge
    that fails (a folder a learner made unremovable) is left to the next pass and not taken again in
    this one, so it never holds up the jobs after it, its tenant's or the others'."""
    deadline, purged, passed_over = time.monotonic() + budget_s, 0, set()
    while time.monotonic() < deadline:
        batch = _next_round(passed_over)
        if not batch:
            break
        for job_id in batch:
            if time.monotonic() >= deadline:
                break
            try:
                done = _purge(job_id)
            except Exception:  # noqa: BLE001 - left unpurged for the next pass; the others go on
                log.exception("purge of deleted job %s failed; the next pass tries again", job_id)
                done = 0
            purged += done
            if not done:  # failed, or another pass has it
                passed_over.add(job_id)
    return purged


def _next_round(passed_over=()):
    """Up to PER_TENANT ids of each tenant's deleted jobs not purged, oldest deletions first, less
    those this pass has passed over."""
    waiting = (Job.objects.filter(deleted_at__isnull=False, purged_at=None)
               .exclude(pk__in=FollowUp.objects.filter(done_at=None).values("job_id"))
               .exclude(pk__in=list(passed_over)))
    tenants = list(waiting.order_by().values_list("tenant_id", flat=True).distinct())
    return [job_id for tenant_id in tenants for job_id in
            waiting.filter(tenant_id=tenant_id).order_by("deleted_at").values_list("id", flat=True)[:PER_TENANT]]


def _purge(job_id):
    """Remove one deleted job's data and mark it purged; 0 when another pass did it meanwhile. Each chunk
    commits on its own (a long log is no transaction held for minutes) and the mark comes last: a pass
    killed midway leaves the rest to the next, and two passes on one job delete nothing twice."""
    job = (Job.objects.select_related("tenant")
           .filter(pk=job_id, deleted_at__isnull=False, purged_at=None).first())
    if job is None:
        return 0
    for model in (LogLine, MetricPoint, Artifact, LearnerCredential):
        _delete_in_chunks(model.objects.filter(job_id=job_id))
    if not storage.remove_job_dir(job.tenant.slug, job_id):
        raise OSError(f"the folder of job {job_id} could not all be removed")
    return Job.objects.filter(pk=job_id, purged_at=None).update(purged_at=timezone.now())


def _delete_in_chunks(rows):
    while ids := list(rows.values_list("pk", flat=True)[:CHUNK]):
        rows.model.objects.filter(pk__in=ids).delete()
