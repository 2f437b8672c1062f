"""What happens to an admitted job: deploy, what its learners report, finish (store, then settle the
status, or restart), and the user's halt, resume and terminate.

Status changes go through jobs.states.transition(), which also writes the follow-up work a change
requires (jobs.outbox); the functions here named by jobs.tasks (deploy, halt_learners,
finish_attempt, teardown) are that work, run by whichever worker claims its row. Each may run more
than once (a worker dies after doing it, before marking it done), so each is safe to repeat. Steps
read what they need of the manifest from jobs.runtime, never the stored manifest.
"""
import hashlib
import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import artifacts, checkpoints, credentials, dispatch, elastic_timeline, outbox, runtime, storage, transfers
from jobs.backends import get_backend
from jobs.backends.base import BackendError, DeploySpec, LearnerSpec, LearnerState
from jobs.models import ACTIVE, Allocation, FollowUp, Job, Learner, LearnerUid, LogLine, Status
from jobs.states import require_transition, transition
from jobs.submission import code_archive
from trainyard import elasticity, experiment, frameworks

log = logging.getLogger(__name__)
SYSTEM = "lifecycle-manager"
PREEMPTOR = "scheduler"  # jobs.admission.ACTOR: who requeues a job it preempted
ENDED = (Learner.State.EXITED, Learner.State.LOST)  # a learner's end, once recorded, is final


class TeardownIncomplete(BackendError):
    """The backend still runs something of the attempt after it was asked to delete it."""


# --- deploy --------------------------------------------------------------------------------------
DEPLOYING = (Status.PENDING, Status.DOWNLOADING, Status.PROCESSING)


def deploy(job_id, attempt):
    """Start the learners of an admitted attempt. Repeating it is harmless (deterministic names).

    A failure is retried (jobs.outbox) until DEPLOY_TRIES tries in a row have failed; then the attempt
    ends (_give_up_deploy): a deploy that cannot succeed must not hold its GPUs from other tenants for
    ever."""
    try:
        _deploy(job_id, attempt)
    except outbox.NotYet:
        raise
    except Exception as exc:
        tries = (FollowUp.objects.filter(job_id=job_id, attempt=attempt, kind=FollowUp.Kind.DEPLOY, done_at=None)
                 .values_list("tries", flat=True).first() or 0)
        if tries < settings.DEPLOY_TRIES:
            raise
        log.warning("%s: deploy of attempt %d failed %d times in a row; giving up", job_id, attempt, tries,
                    exc_info=True)
        _give_up_deploy(job_id, attempt, f"deploy failed {tries} times in a row, the last time: "
                                         f"{type(exc).__name__}: {str(exc)[:500]}")


def _give_up_deploy(job_id, attempt, failure):
    """End an attempt whose learners could not be started: queued again as the next attempt while the
    job has restarts left (restart_policy.max_retries), failed otherwise. The attempt's teardown
    deletes whatever of it the backend did make."""
    job = Job.objects.filter(pk=job_id, attempt=attempt, status__in=DEPLOYING).first()
    if job is None:
        return  # halted or ended meanwhile: that change saw to it
    try:
        run = runtime.of(job)
    except runtime.RuntimeUnavailable:
        run = None
    if run is not None and job.retries < run.max_retries:
        _restart(job, run, failure)
    else:
        transition(job.id, Status.FAILED, actor=SYSTEM, reason=failure, attempt=attempt)


def _deploy(job_id, attempt):
    job = Job.objects.select_related("tenant").filter(pk=job_id).first()
    if job is None:
        return
    if job.attempt != attempt or job.status not in ACTIVE:
        # The attempt is over. A worker that made its learners and was killed before it could see
        # that (below) left them to this repeat: the attempt's teardown may have run before they
        # existed. It is done again, confirmed by the backend like any.
        outbox.add(job_id, attempt, FollowUp.Kind.TEARDOWN)
        return
    if job.status not in DEPLOYING:
        return  # deployed: the learners run
    try:
        spec = deploy_spec(job)
    except runtime.RuntimeUnavailable as exc:
        transition(job.id, Status.FAILED, actor=SYSTEM, reason=f"cannot deploy: {exc}", attempt=attempt)
        return
    if not transfers.fetch_training_data(job) or not _still_deploying(job_id, attempt):
        return
    backend = get_backend()
    try:
        backend.deploy(spec)
    except BackendError as exc:
        if exc.permanent:
            transition(job.id, Status.FAILED, actor=SYSTEM, reason=f"deploy failed: {exc}", attempt=attempt)
            return
        raise
    if not _still_deploying(job_id, attempt):
        # Halted or ended while its learners were being made: that change's teardown may have run
        # before they existed, and nothing else would delete them.
        backend.delete(tenant=job.tenant.slug, job_id=job_id, attempt=attempt, learners=job.learners)
        return
    # The rows only once the backend has the learners: reconcile judges every learner that has a
    # row by what the backend reports, and one whose agent is not started yet would look vanished
    # (lost). Until then reconcile sees no rows and re-drives this deploy, which is harmless.
    for index in range(job.learners):
        Learner.objects.get_or_create(job=job, attempt=attempt, index=index)


def _still_deploying(job_id, attempt):
    """Whether the attempt may still get its learners (a data download may have taken an hour)."""
    return Job.objects.filter(pk=job_id, attempt=attempt, status__in=DEPLOYING).exists()


def deploy_spec(job):
    folder = storage.job_dir(job.tenant.slug, job.id)
    run = runtime.of(job)
    env = {
        "TRAINYARD_JOB_ID": job.id,
        "TRAINYARD_ATTEMPT": str(job.attempt),
        "DATA_DIR": str(folder / "data"),
        "RESULT_DIR": str(folder / "results"),
        "CHECKPOINT_DIR": str(checkpoints.attempt_dir(folder, job.attempt)),
        "NUM_LEARNERS": str(job.learners),
        "GPU_COUNT": str(job.gpus),
    }
    if run.elastic is not None:
        env.update(_attempt_shape(job).env())
    resume_from = checkpoints.last_good(folder, job.attempt)
    if resume_from:
        env["RESUME_FROM"] = str(resume_from)
    if run.hyperparameters:
        env.update(experiment.environment(run.hyperparameters))
        env["TRAINYARD_HPARAMS_FILE"] = str(folder / "results" / "hparams.json")
    framework = frameworks.REGISTRY[run.framework]
    env.update(framework.env)
    # Learners of one job share a private network namespace on `local`, so any port is free there;
    # it still differs per job and attempt for a machine that cannot create namespaces.
    port = 20000 + int(hashlib.sha256(f"{job.id}:{job.attempt}".encode()).hexdigest()[:6], 16) % 20000
    # Each learner's agent gets its own ingest credential, good only for this attempt and learner.
    tokens = credentials.issue_for_attempt(job)
    learners = []
    for index in range(job.learners):
        placement = job.placement[index] if index < len(job.placement) else {"gpu_ids": []}
        # FfDL's per-learner state folder; TensorBoard event files go to $LOG_DIR/tb by convention.
        state_dir = storage.learner_dir(job.tenant.slug, job.id, job.attempt, index) / "state"
        learner_env = {"LEARNER_ID": str(index), "JOB_STATE_DIR": str(state_dir), "LOG_DIR": str(state_dir / "logs")}
        if job.learners > 1:
            learner_env.update(RANK=str(index), WORLD_SIZE=str(job.learners), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port))
            learner_env.update(framework.distributed_env(index=index, learners=job.learners,
                                                         hosts=["127.0.0.1"] * job.learners, port=port))
        learners.append(LearnerSpec(index=index, env=learner_env, gpu_ids=tuple(placement["gpu_ids"]),
                                    node=placement.get("node", ""), ingest_token=tokens[index]))
    return DeploySpec(
        job_id=job.id, attempt=job.attempt, tenant=job.tenant.slug, command=run.command,
        code_archive=str(code_archive(job)), job_dir=str(folder), learners=tuple(learners), cpus=job.cpus,
        memory_bytes=job.memory_bytes, gpus=job.gpus, env=env, metric_regexes=run.metric_regexes,
        checkpoint_signal=run.checkpoint_signal, grace_seconds=run.grace_seconds,
        ingest_url=ingest_url(job.id), framework=run.framework,
        framework_version=run.framework_version, image=framework.image_for(run.framework_version),
        tensorboard_dir=run.tensorboard_dir, disk=run.disk,
        uid_number=LearnerUid.objects.get_or_create(job=job)[0].pk)


def ingest_url(job_id):
    """Where the agents of `job_id` post (the ingest protocol, DEVELOPERS.md), at the platform's public
    address; with learner_agent.address.JOB_ID for the job, what a moved platform tells its agents."""
    return f"{settings.PUBLIC_URL.rstrip('/')}/api/v1/ingest/{job_id}/"


def _attempt_shape(job):
    """An elastic attempt's batch sizes and learning-rate factor now: as its allocation row records them
    (a resize or a batch change chose them), else the manifest's batch at the job's learners."""
    row = elastic_timeline.of_attempt(job)
    if row is not None and row.learners == job.learners:
        return elasticity.Shape(row.learners, row.global_batch, row.local_batch, row.lr_scale)
    return elastic_timeline.shape_of(job)


def latest_checkpoint(job):
    """The newest complete checkpoint of this attempt or, failing that, of the ones before it."""
    return checkpoints.last_good(storage.job_dir(job.tenant.slug, job.id), job.attempt + 1)


# --- learners report -----------------------------------------------------------------------------
def learner_preparing(job):
    transition(job.id, Status.DOWNLOADING, actor=SYSTEM, reason="fetching code and data", attempt=job.attempt)


def learner_running(job, learner, when):
    # A learner's end, once recorded, is final: a late (or forged) `running` must not reopen it, nor
    # let a second `exited` rewrite the exit code the attempt is judged by.
    updated = (Learner.objects.filter(pk=learner.pk).exclude(state__in=ENDED)
               .update(state=Learner.State.RUNNING, started_at=when))
    if not updated:
        return
    running = Learner.objects.filter(job=job, attempt=job.attempt, state=Learner.State.RUNNING).count()
    if running == job.learners:
        transition(job.id, Status.PROCESSING, actor=SYSTEM, reason="training", attempt=job.attempt)


def learner_exited(job, learner, *, exit_code, reason, when, state=Learner.State.EXITED):
    """Record a learner's end; the last one of the attempt makes finishing it due (an outbox row, in
    the caller's transaction)."""
    updated = (Learner.objects.filter(pk=learner.pk).exclude(state__in=ENDED)
               .update(state=state, exit_code=exit_code, reason=reason, finished_at=when))
    if not updated:
        return
    pending = Learner.objects.filter(job=job, attempt=learner.attempt).exclude(state__in=ENDED).exists()
    if not pending:
        outbox.add(job.id, learner.attempt, FollowUp.Kind.FINISH)
    elif (state == Learner.State.LOST or exit_code != 0) and job.status != Status.HALTING:
        # Gang-stop: the other learners of a distributed job would wait in a collective for the
        # failed one forever, so they are stopped now and the attempt ends (and fails) as one.
        outbox.add(job.id, learner.attempt, FollowUp.Kind.TEARDOWN)


# --- finish --------------------------------------------------------------------------------------
def finish_attempt(job_id, attempt):
    """All learners of the attempt have ended: store results and settle the job's status. The
    change out of an active status writes the attempt's teardown (jobs.outbox)."""
    job = Job.objects.select_related("tenant").filter(pk=job_id, attempt=attempt).first()
    if job is None or job.status not in ACTIVE:
        return
    learners = list(Learner.objects.filter(job=job, attempt=attempt).order_by("index"))
    if job.status == Status.HALTING or (job.status == Status.STORING and _halt_requested(job)):
        _finish_halt(job, learners)
        return
    try:
        run = runtime.of(job)
    except runtime.RuntimeUnavailable as exc:
        transition(job.id, Status.FAILED, actor=SYSTEM, attempt=attempt, reason=f"cannot finish: {exc}")
        return
    failed = [lr for lr in learners if lr.state == Learner.State.LOST or lr.exit_code != 0]
    if failed:
        _finish_failed(job, run, failed)
        return
    if job.status != Status.STORING and len(learners) < learners_of(job, attempt):
        # A learner without a row was never started: a deploy killed between its learners (its row
        # stays open and is sent again) starts it, and the end of the last one makes finishing due
        # again. A failure waits for none: it ends the attempt, every learner of it with it.
        return
    if job.status != Status.STORING and not transition(job.id, Status.STORING, actor=SYSTEM,
                                                        reason="storing results", attempt=attempt):
        return
    problem = artifacts.store_results(job, run)
    if problem:
        transition(job.id, Status.FAILED, actor=SYSTEM, attempt=attempt, reason=f"storing results failed: {problem}")
        return
    transition(job.id, Status.COMPLETED, actor=SYSTEM, reason="all learners exited 0", attempt=attempt, exit_code=0)


def _finish_failed(job, run, failed):
    # The one that failed first is the cause; the others may just have been gang-stopped.
    first = min(failed, key=lambda lr: (lr.finished_at or timezone.now(), lr.index))
    failure = _failure_reason(job, first)
    # A failed push of this attempt's output is in the job's log; it does not take away the retries.
    problem = artifacts.store_results(job, run)
    if job.retries < run.max_retries:
        _restart(job, run, failure)
        return
    if problem:
        failure += f"; storing results failed: {problem}"
    transition(job.id, Status.FAILED, actor=SYSTEM, attempt=job.attempt, reason=failure, exit_code=first.exit_code)


def _restart(job, run, failure):
    """Queue the whole job again (every learner, together) as the next attempt, from its checkpoint."""
    resume = _resume_text(job, "starts over: no checkpoint yet")
    if transition(job.id, Status.QUEUED, actor=SYSTEM, attempt=job.attempt, attempt_next=True,
                  reason=f"restart {job.retries + 1} of {run.max_retries} ({resume}) after: {failure}",
                  retries=job.retries + 1):
        dispatch.wake_scheduler_on_commit()


def _resume_text(job, otherwise="starts over: no checkpoint was written"):
    checkpoint = latest_checkpoint(job)
    return f"resumes from {checkpoint.name}" if checkpoint else otherwise


def _halt_requested(job):
    last = job.events.filter(to_status__in=[Status.HALTING, Status.PROCESSING, Status.PENDING]).last()
    return last is not None and last.to_status == Status.HALTING


def _finish_halt(job, learners):
    """A halted attempt: keep what it wrote, say whether a new checkpoint came out, release it (or,
    for a resize, go on as the next attempt at the new size)."""
    resizing = pending_resize(job)
    stage = "storing checkpoint before resize" if resizing else "storing checkpoint after halt"
    if job.status == Status.HALTING and not transition(job.id, Status.STORING, actor=SYSTEM, attempt=job.attempt,
                                                       reason=stage):
        return
    try:
        problem = artifacts.store_results(job, runtime.of(job))
    except runtime.RuntimeUnavailable as exc:
        problem = str(exc)
    if problem:
        transition(job.id, Status.FAILED, actor=SYSTEM, attempt=job.attempt,
                   reason=f"storing the checkpoint after halt failed: {problem}")
        return
    checkpoint = latest_checkpoint(job)
    halted_at = job.events.filter(to_status=Status.HALTING).last().time
    killed = [lr.index for lr in learners if "killed" in lr.reason]
    if checkpoint is not None and checkpoints.written_at(checkpoint) >= halted_at.timestamp():
        reason = f"halted; resume continues from checkpoint {checkpoint.name}"
    elif checkpoint is not None:
        reason = f"halted, but no new checkpoint was written; resume continues from {checkpoint.name}"
    else:
        reason = "halted, but no checkpoint was written; resume starts from the beginning"
    killed_note = (f"learner {', '.join(map(str, killed))} ignored the signal and was killed after the grace period"
                   if killed else "")
    if resizing:
        _continue_resized(job, resizing, killed_note)
        return
    if killed:
        reason += f" ({killed_note})"
    with transaction.atomic():  # a preempted job is HALTED and queued again at once, or neither
        halted = transition(job.id, Status.HALTED, actor=SYSTEM, attempt=job.attempt, reason=reason)
        if halted and halted.preempted_reason:
            _requeue_preempted(halted)


# --- resize (elastic jobs) ------------------------------------------------------------------------
def resize(job, *, learners, placement, why, actor, wanted_batch=None):
    """Have a running elastic job go on at `learners` learners on `placement` (the new attempt's,
    one {"node", "gpu_ids"} per learner): a coordinated checkpoint-restart. Its learners get the
    checkpoint signal as for a halt (all save at the same step and exit; one that ignores it is
    killed after the grace period), then the job's next attempt starts at the new shape without
    going through the queue (`_continue_resized`). The new attempt's Allocation row is written now
    (reason, time of the signal); while the resize is under way the job holds the GPUs of both
    shapes, so a grow's new GPUs are not given to anyone else meanwhile.

    Returns that row, or None when the job is no longer running (nothing changed then)."""
    elastic = elasticity.of(job)
    if elastic is None:
        raise ValueError(f"job {job.id} has no elastic block; only elastic jobs are resized")
    if not elastic.min_learners <= learners <= elastic.max_learners or len(placement) != learners:
        raise ValueError(f"job {job.id}: {learners} learners on {len(placement)} placements is outside "
                         f"{elastic.min_learners}..{elastic.max_learners}")
    before = _attempt_shape(job)
    after = elasticity.shape(elastic, learners, wanted_batch or before.global_batch)
    holding = list(job.placement) + [p for p in placement if p not in job.placement]
    now = timezone.now()
    with transaction.atomic():
        Allocation.objects.filter(job=job, attempt=job.attempt + 1, started_at=None).delete()
        row = Allocation.objects.create(
            job=job, attempt=job.attempt + 1, kind=Allocation.Kind.RESIZE, learners=learners, gpus_per_learner=job.gpus,
            global_batch=after.global_batch, local_batch=after.local_batch, lr_scale=after.lr_scale,
            placement=list(placement), reason=f"{resize_text(before, after)}: {why}", resize_requested_at=now)
        moved = transition(job.id, Status.HALTING, actor=actor, reason=f"resizing: {row.reason}",
                           attempt=job.attempt, only_from={Status.PROCESSING}, placement=holding)
        if moved is None:
            transaction.set_rollback(True)
            return None
    log.info("%s: %s", job.id, row.reason)
    return row


def change_batch(job, *, wanted_batch, why, actor):
    """Have a running elastic job's learners switch to the global batch nearest `wanted_batch` at their
    learners (trainyard.elasticity.shape) without a restart: the request goes to their agents in the
    answers to their posts, learner 0 switches all of them after one step and says so
    (learner_agent.batch_changes), and the timeline's new stretch starts then
    (jobs.elastic_timeline.batch_applied). For jobs whose learners said they can
    (elastic_timeline.listens_for_batch_changes); others change their batch through `resize`.

    Returns the change's Allocation row, or None when nothing was asked: the job is not running, a
    change is still waiting to be applied, or the batch would not change."""
    elastic = elasticity.of(job)
    if elastic is None or elastic.batch is None:
        raise ValueError(f"job {job.id} declares no elastic batch_size; its batch cannot change")
    with transaction.atomic():
        locked = Job.objects.select_for_update().filter(pk=job.pk, status=Status.PROCESSING,
                                                        attempt=job.attempt).first()
        if locked is None or locked.batch_request is not None:
            return None
        before = _attempt_shape(locked)
        after = elasticity.shape(elastic, locked.learners, wanted_batch)
        if after.global_batch == before.global_batch:
            return None
        row = Allocation.objects.create(
            job=locked, attempt=locked.attempt, kind=Allocation.Kind.BATCH, learners=locked.learners,
            gpus_per_learner=locked.gpus, global_batch=after.global_batch, local_batch=after.local_batch,
            lr_scale=after.lr_scale, placement=list(locked.placement),
            reason=f"batch {before.global_batch}→{after.global_batch}, no restart: {why}",
            resize_requested_at=timezone.now())
        locked.batch_request = {"id": row.id, "global_batch": after.global_batch, "local_batch": after.local_batch,
                                "lr_scale": after.lr_scale}
        Job.objects.filter(pk=locked.pk).update(batch_request=locked.batch_request)
    log.info("%s: %s (asked by %s)", job.id, row.reason, actor)
    return row


def resize_text(before, after):
    """"resized 2→4 learners, batch 128→256" (what the events and the timeline say)."""
    text = f"resized {before.learners}→{after.learners} learners"
    if before.global_batch is not None and after.global_batch is not None:
        text += f", batch {before.global_batch}→{after.global_batch}"
    return text


def pending_resize(job):
    """The Allocation row of a resize requested for the job's current attempt, or None."""
    return Allocation.objects.filter(job=job, attempt=job.attempt + 1, started_at=None,
                                     resize_requested_at__isnull=False).first()


def _continue_resized(job, row, killed_note):
    """The resized job's learners have stopped and its checkpoint is stored: its next attempt starts
    at once at the new size (PENDING writes its deploy; the attempt before is torn down)."""
    resume = _resume_text(job)
    reason = f"{row.reason} ({resume}{'; ' + killed_note if killed_note else ''})"
    transition(job.id, Status.PENDING, actor=SYSTEM, attempt=job.attempt, attempt_next=True,
               only_from={Status.STORING}, reason=reason, learners=row.learners, placement=list(row.placement))


def _requeue_preempted(job):
    """A job halted to make room goes back to the queue at once, keeping its place (submission order)."""
    resume = _resume_text(job)
    if transition(job.id, Status.QUEUED, actor=PREEMPTOR, attempt=job.attempt, attempt_next=True,
                  only_from={Status.HALTED}, reason=f"requeued after preemption ({resume})", preempted_reason=""):
        dispatch.wake_scheduler_on_commit()


def _failure_reason(job, learner):
    if learner.state == Learner.State.LOST:
        what = f"learner {learner.index} was lost: {learner.reason}"
    elif learner.exit_code is None:
        what = f"learner {learner.index} did not start: {learner.reason}"
    else:
        what = f"learner {learner.index} exited with code {learner.exit_code}"
        if learner.reason:
            what += f" ({learner.reason})"
    last = (LogLine.objects.filter(job=job, attempt=learner.attempt, learner=learner.index)
            .exclude(stream="system")  # the platform's own lines (data transfers) are not the learner's
            .order_by("-seq").values_list("line", flat=True).first())
    return f"{what}; last output: {last[:300]}" if last else what


# --- user actions --------------------------------------------------------------------------------
def terminate(job, *, actor):
    """Stop a job for good; its teardown is an outbox row written with the status change."""
    return require_transition(job.id, Status.TERMINATED, actor=actor, reason=f"terminated by {actor}")


def halt(job, *, actor, reason=None):
    """Ask the learners to checkpoint and stop; the job becomes HALTED once they have."""
    return require_transition(job.id, Status.HALTING, actor=actor, reason=reason or f"halt requested by {actor}",
                              attempt=job.attempt)


def resume(job, *, actor):
    """Queue a halted job again as a new attempt; its learners start from the last checkpoint. A job once
    halted for preemption is no longer being preempted (the scheduler counts such a job as stopping)."""
    job = require_transition(job.id, Status.QUEUED, actor=actor, reason=f"resumed by {actor}", attempt=job.attempt,
                             attempt_next=True, only_from={Status.HALTED}, preempted_reason="")
    dispatch.wake_scheduler_on_commit()
    return job


# --- follow-up work on the backend ---------------------------------------------------------------
def learners_of(job, attempt):
    """How many learners an attempt had: an elastic job's earlier attempts may have had another count
    than the job has now."""
    if attempt == job.attempt:
        return job.learners
    counts = [Learner.objects.filter(job=job, attempt=attempt).count()]
    counts += list(Allocation.objects.filter(job=job, attempt=attempt).values_list("learners", flat=True))
    return max(counts) or job.learners


def halt_learners(job_id, attempt):
    job = Job.objects.select_related("tenant").filter(pk=job_id, attempt=attempt, status=Status.HALTING).first()
    if job is not None:
        get_backend().halt(tenant=job.tenant.slug, job_id=job.id, attempt=attempt, learners=job.learners)


def teardown(job_id, attempt):
    """Delete everything the backend runs or keeps for the attempt, and confirm that nothing of it
    still runs; TeardownIncomplete (the outbox row is tried again) until the backend says so."""
    job = Job.objects.select_related("tenant").filter(pk=job_id).first()
    if job is None:
        return
    backend = get_backend()
    where = {"tenant": job.tenant.slug, "job_id": job.id, "attempt": attempt, "learners": learners_of(job, attempt)}
    backend.delete(**where)
    left = [s.index for s in backend.status(**where) if s.state in (LearnerState.RUNNING, LearnerState.PENDING)]
    if left:
        raise TeardownIncomplete(f"learner(s) {', '.join(map(str, left))} of attempt {attempt} still run after delete")
