"""The reconcile pass (celery beat, every RECONCILE_INTERVAL_S): bring every active job in line with
what the backend reports about its learners, make sure each step an active job waits for has its
outbox row, send again every outbox row nobody works on (final jobs' teardowns too), and run a
scheduling cycle."""
from django.db import transaction
from django.utils import timezone

from jobs import admission, lifecycle, outbox
from jobs.backends import get_backend
from jobs.backends.base import LearnerState
from jobs.models import ACTIVE, FollowUp, Job, Learner, Status

Kind = FollowUp.Kind
ENDED = (Learner.State.EXITED, Learner.State.LOST)


def reconcile():
    backend = get_backend()
    for job in Job.objects.select_related("tenant").filter(status__in=ACTIVE):
        _reconcile_job(job, backend)
    outbox.sweep()
    admission.run_cycle()


def _reconcile_job(job, backend):
    if job.status == Status.STORING:
        outbox.add(job.id, job.attempt, Kind.FINISH)  # no-op while its row is open
        return
    learners = {lr.index: lr for lr in Learner.objects.filter(job=job, attempt=job.attempt)}
    if learners:
        _settle_learners(job, learners, backend.status(tenant=job.tenant.slug, job_id=job.id,
                                                       attempt=job.attempt, learners=job.learners))
    ended = len(learners) == job.learners and all(lr.state in ENDED for lr in _reload(learners))
    if ended:
        outbox.add(job.id, job.attempt, Kind.FINISH)
    elif job.status in (Status.PENDING, Status.DOWNLOADING) and not learners:
        outbox.add(job.id, job.attempt, Kind.DEPLOY)  # DOWNLOADING: a data download cut short
    elif job.status == Status.HALTING:
        # Repeated while learners run: it reaches an agent that started after the first halt.
        outbox.add(job.id, job.attempt, Kind.HALT if learners else Kind.FINISH)


def _settle_learners(job, learners, statuses):
    for status in statuses:
        learner = learners.get(status.index)
        if learner is None or learner.state in ENDED:
            continue
        with transaction.atomic():
            if status.state == LearnerState.EXITED:
                # The agent ended but its report never arrived: its exit record on disk says how.
                lifecycle.learner_exited(job, learner, exit_code=status.exit_code, reason=status.reason,
                                         when=timezone.now())
            elif status.state == LearnerState.MISSING:
                lifecycle.learner_exited(job, learner, exit_code=None, reason=status.reason, when=timezone.now(),
                                         state=Learner.State.LOST)


def _reload(learners):
    return Learner.objects.filter(pk__in=[lr.pk for lr in learners.values()])
