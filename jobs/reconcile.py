"""The reconcile pass (celery beat, every RECONCILE_INTERVAL_S): bring every active job in line with
what the backend reports about its learners, make sure each step an active job waits for has its
outbox row, send again every outbox row nobody works on (final jobs' teardowns too), and wake the
scheduling loop (jobs.scheduler_loop: what the pass settled may have freed resources).

A pass reads what it judges in a fixed number of queries, whatever the number of active jobs (the
jobs, their current attempts' learners, the open outbox rows); only what it changes costs queries
per job: a query or two per job made a pass over a large cluster take seconds.

`sweep_storage` (celery beat, every 10 minutes) does the same for storage: what a process killed
between staging a folder and committing its row left there, which no row owns, is removed.
"""
import logging
import time
from collections import defaultdict
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from jobs import datastores, dispatch, lifecycle, outbox, runtime, storage
from jobs.backends import get_backend
from jobs.backends.base import LearnerState
from jobs.models import ACTIVE, FINAL, Experiment, FollowUp, Job, Learner, Status
from tenants.models import Tenant
from trainyard.manifest import MAX_GRACE_SECONDS

log = logging.getLogger(__name__)
Kind = FollowUp.Kind
# Past a halt's grace (the learner's checkpoint), how long (the agent's own shutdown included) before what
# still runs is deleted.
HALT_SLACK_S = 120


def reconcile():
    backend = get_backend()
    jobs = list(Job.objects.select_related("tenant").filter(status__in=ACTIVE))
    learners = _current_learners(jobs)
    due = [step for job in jobs if (step := _reconcile_one(job, learners[job.id], backend))]
    outbox.ensure(due)
    outbox.sweep()
    dispatch.wake_scheduler()


def _current_learners(jobs):
    """{job id: {index: Learner}} of each job's current attempt, in one query."""
    # By job only, the attempt picked here: earlier attempts' rows are few (retries x learners), and
    # an OR of (job, attempt) pairs would hit SQLite's expression depth limit at 1,000 jobs.
    attempts = {job.id: job.attempt for job in jobs}
    found = defaultdict(dict)
    for learner in Learner.objects.filter(job_id__in=list(attempts)):
        if learner.attempt == attempts[learner.job_id]:
            found[learner.job_id][learner.index] = learner
    return found


def _reconcile_one(job, learners, backend):
    """_reconcile_job, with what fails for one job (a backend's answer about it, a record its learner
    left) logged and left to the next pass: it must not stop the pass for every other job."""
    try:
        return _reconcile_job(job, learners, backend)
    except Exception:
        log.exception("%s: reconciling it failed; the next pass tries again", job.id)
        return None


def _reconcile_job(job, learners, backend):
    """The follow-up (job id, attempt, kind) this job waits for, if any; settles its learners."""
    if job.status == Status.STORING:
        return job.id, job.attempt, Kind.FINISH
    if job.status == Status.HALTING and learners and _halt_overdue(job):
        _end_overdue_halt(job, learners, backend)
    elif learners:
        _settle_learners(job, learners, backend.status(tenant=job.tenant.slug, job_id=job.id,
                                                       attempt=job.attempt, learners=job.learners))
    # What this pass read or settled; a learner's own report ending it meanwhile adds the finish itself.
    if len(learners) == job.learners and all(lr.state in lifecycle.ENDED for lr in learners.values()):
        return job.id, job.attempt, Kind.FINISH
    if job.status in (Status.PENDING, Status.DOWNLOADING) and len(learners) < job.learners:
        # DOWNLOADING: a data download cut short; some learners' rows only: a deploy cut short
        # between its learners (the others' agents posted), whose ends do not finish the attempt.
        return job.id, job.attempt, Kind.DEPLOY
    if job.status == Status.HALTING:
        # Repeated while learners run: it reaches an agent that started after the first halt.
        return job.id, job.attempt, Kind.HALT if learners else Kind.FINISH
    return None


def _halt_overdue(job):
    """Whether the halt began more than the learners' grace and HALT_SLACK_S ago. A job whose runtime
    cannot be read gets the longest grace a manifest may ask: its halt still ends, its GPUs are not
    held for ever."""
    began = (job.events.filter(to_status=Status.HALTING, attempt=job.attempt)
             .order_by("-time").values_list("time", flat=True).first())
    try:
        grace = runtime.of(job).grace_seconds
    except runtime.RuntimeUnavailable:
        grace = MAX_GRACE_SECONDS
    allowed = timedelta(seconds=grace + HALT_SLACK_S)
    return began is not None and timezone.now() - began > allowed


def _end_overdue_halt(job, learners, backend):
    """Delete what still runs of a halt that did not end by itself, and count those learners lost:
    the agent in a pod runs on the job's own image and may ignore the halt, and the job's GPUs
    would then be held for ever (a preemption never done). The last checkpoint is what resumes."""
    backend.delete(tenant=job.tenant.slug, job_id=job.id, attempt=job.attempt, learners=job.learners)
    for learner in learners.values():
        if learner.state in lifecycle.ENDED:
            continue
        with transaction.atomic():
            lifecycle.learner_exited(job, learner, exit_code=None, state=Learner.State.LOST, when=timezone.now(),
                                     reason="did not stop within its halt grace; it was deleted")
        learner.state = Learner.State.LOST


def _settle_learners(job, learners, statuses):
    for status in statuses:
        learner = learners.get(status.index)
        if learner is None or learner.state in lifecycle.ENDED:
            continue
        if status.state == LearnerState.EXITED:
            # The agent ended but its report never arrived: its exit record on disk says how.
            ended = {"exit_code": status.exit_code, "state": Learner.State.EXITED}
        elif status.state == LearnerState.MISSING:
            ended = {"exit_code": None, "state": Learner.State.LOST}
        else:
            continue  # running or starting: nothing to write (and no transaction to open)
        with transaction.atomic():
            lifecycle.learner_exited(job, learner, reason=status.reason, when=timezone.now(), **ended)
        learner.state = ended["state"]


# --- storage no row refers to -------------------------------------------------------------------------
# A staged folder (jobs.storage.stage_dir) is one whose row has not committed; a submission or a pass in
# flight commits within seconds, so one staged this long ago with no row is a leftover.
ORPHAN_GRACE_S = 3600
SWEEP_CHUNK = 500  # folders looked up a query


def sweep_storage():
    """Remove the leftovers of processes killed mid-submission or mid-pass: uploads, and staged folders
    that neither a job nor an experiment row owns. A job or experiment that has ended loses its sealed
    data-store credentials, which its end deletes after its commit: a process killed in between kept them."""
    cutoff = time.time() - ORPHAN_GRACE_S
    for upload in storage.uploads_older_than(cutoff):
        log.warning("storage: removing the upload %s, left by a submission killed before its job was stored", upload)
        upload.unlink(missing_ok=True)
    slugs = list(Tenant.objects.values_list("slug", flat=True))
    for slug, name, ended in _owners(storage.folders_holding(storage.STAGED_MARK, slugs, before=cutoff)):
        if ended is not None:  # its row committed; the process was killed before it unstaged the folder
            storage.unstage(slug, name)
            continue
        log.warning("storage: removing %s/%s, left by a process killed before its row was stored", slug, name)
        if not storage.remove_job_dir(slug, name):
            log.error("storage: %s/%s could not all be removed; the next sweep tries again", slug, name)
    for slug, name, ended in _owners(storage.folders_holding(datastores.SEALED_FILE, slugs)):
        if ended:
            datastores.delete_credentials(storage.job_dir(slug, name))


def _owners(folders):
    """(slug, name, whether its job or experiment has ended, or None when no row owns it) of `folders`."""
    for start in range(0, len(folders), SWEEP_CHUNK):
        chunk = folders[start:start + SWEEP_CHUNK]
        names = [name for _, name in chunk]
        # A deleted job's or experiment's row owns nothing any more (jobs.deletion).
        ended = {job_id: status in FINAL for job_id, status in
                 Job.objects.filter(id__in=names, deleted_at=None).values_list("id", "status")}
        ended.update((experiment_id, finished_at is not None) for experiment_id, finished_at in
                     Experiment.objects.filter(id__in=names, deleted_at=None).values_list("id", "finished_at"))
        for slug, name in chunk:
            yield slug, name, ended.get(name)
