"""What happens to jobs: submission, admission, deployment, completion, termination, reconcile.

Views and tasks call these functions; status changes go through jobs.states.transition().
"""
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import admission, checkpoints, storage
from jobs import credentials, datastores, frameworks, transfers
from jobs.backends import get_backend
from jobs.backends.base import BackendError, DeploySpec, LearnerSpec, LearnerState
from jobs.manifest import ManifestError, parse_manifest
from jobs.models import Artifact, Job, Learner, LogLine, Status
from jobs.states import ACTIVE, transition
from learner_agent.archive import ArchiveError, inspect_archive

log = logging.getLogger(__name__)
SYSTEM = "lifecycle-manager"


class SubmitError(Exception):
    def __init__(self, detail, *, field=None, status=400):
        super().__init__(detail)
        self.detail, self.field, self.status = detail, field, status


# --- submit --------------------------------------------------------------------------------------
def submit(membership, *, manifest_bytes, code_file, private=False):
    """Validate and store a new job; nothing is stored or reserved unless everything is valid."""
    if not membership.can_submit:
        raise SubmitError(f"your role in {membership.tenant.slug!r} ({membership.role}) cannot submit jobs",
                          status=403)
    try:
        manifest = parse_manifest(manifest_bytes)
    except ManifestError as exc:
        raise SubmitError(str(exc), field=exc.field) from None
    if code_file is None:
        raise SubmitError("a code archive (zip or tar.gz) is required", field="code")
    if code_file.size > settings.MAX_CODE_BYTES:
        raise SubmitError(f"code archive is {code_file.size / 2**20:.1f} MiB; the limit is "
                          f"{settings.MAX_CODE_BYTES / 2**20:.0f} MiB", field="code", status=413)
    upload = _save_upload(code_file)
    try:
        try:
            info = inspect_archive(upload, max_unpacked_bytes=settings.MAX_UNPACKED_BYTES,
                                   max_members=settings.MAX_ARCHIVE_MEMBERS)
        except ArchiveError as exc:
            raise SubmitError(f"code archive refused: {exc}", field="code") from None
        job = _create_job(membership, manifest, manifest_bytes, upload, info, private=private)
    finally:
        upload.unlink(missing_ok=True)
    return job


def _save_upload(code_file):
    fd, name = tempfile.mkstemp(dir=storage.uploads_dir(), prefix=".tmp-upload-")
    with os.fdopen(fd, "wb") as out:
        for chunk in code_file.chunks():
            out.write(chunk)
    return Path(name)


def _create_job(membership, manifest, manifest_bytes, upload, info, *, private):
    digest = storage.sha256_of(upload)
    # Data-store credentials never reach the database: stored redacted, sealed beside the job instead.
    job = Job(tenant=membership.tenant, owner=membership.user, name=manifest.name,
              description=manifest.description, framework=manifest.framework,
              manifest=datastores.redact(manifest.raw),
              manifest_yaml=datastores.redact_yaml(manifest_bytes.decode("utf-8")), learners=manifest.learners,
              gpus=manifest.gpus,
              cpus=manifest.cpus, memory_bytes=manifest.memory_bytes, priority=manifest.priority,
              code_sha256=digest, code_bytes=upload.stat().st_size)
    job.private = private
    folder = storage.create_job_dir(membership.tenant.slug, job.id)
    try:
        shutil.copyfile(upload, folder / f"code.{info.kind}")
        transfers.seal_submitted_credentials(folder, manifest)
        with transaction.atomic():
            job.save(force_insert=True)
            job.events.create(to_status=Status.QUEUED, actor=membership.user.username, reason="submitted")
            enqueue("schedule")
    except Exception:
        storage.remove_job_dir(membership.tenant.slug, job.id)
        raise
    return job


def enqueue(task_name, *args):
    """Send a lifecycle task once the current transaction commits (at once outside one).

    The state the task acts on is already in the database, and the reconcile pass re-drives every
    active job from there, so a broker that is down makes the send log a warning rather than fail
    the request or task that changed the state.
    """
    def send():
        from jobs import tasks
        try:
            getattr(tasks, task_name).delay(*args)
        except Exception as exc:  # noqa: BLE001 - kombu raises many kinds of connection errors
            log.warning("could not enqueue %s%s (%s); reconcile will retry", task_name, args, exc)

    transaction.on_commit(send)


def code_archive(job):
    folder = storage.job_dir(job.tenant.slug, job.id)
    return next(iter(sorted(folder.glob("code.*"))), None)


# --- admission -----------------------------------------------------------------------------------
def used_resources():
    """{node: {gpus, cpus, memory_bytes, gpu_ids}} held by the learners of active jobs."""
    used = {}
    for job in Job.objects.filter(status__in=ACTIVE).only("placement", "cpus", "memory_bytes"):
        for learner in job.placement:
            node = used.setdefault(learner["node"], {"gpus": 0, "cpus": 0.0, "memory_bytes": 0, "gpu_ids": set()})
            node["gpus"] += len(learner["gpu_ids"])
            node["cpus"] += job.cpus
            node["memory_bytes"] += job.memory_bytes
            node["gpu_ids"].update(learner["gpu_ids"])
    return used


# --- deploy --------------------------------------------------------------------------------------
def deploy(job_id, attempt):
    """Start the learners of an admitted attempt. Repeating it is harmless (deterministic names)."""
    job = Job.objects.select_related("tenant").filter(pk=job_id, attempt=attempt).first()
    if job is None or job.status not in (Status.PENDING, Status.DOWNLOADING, Status.PROCESSING):
        return
    if not transfers.fetch_training_data(job):
        return
    try:
        get_backend().deploy(deploy_spec(job))
    except BackendError as exc:
        if exc.permanent:
            transition(job.id, Status.FAILED, actor=SYSTEM, reason=f"deploy failed: {exc}", attempt=attempt)
            return
        raise
    # The rows only once the backend has the learners: reconcile judges every learner that has a
    # row by what the backend reports, and one whose agent is not started yet would look vanished
    # (lost). Until then reconcile sees no rows and re-drives this deploy, which is harmless.
    for index in range(job.learners):
        Learner.objects.get_or_create(job=job, attempt=attempt, index=index)


def deploy_spec(job):
    folder = storage.job_dir(job.tenant.slug, job.id)
    manifest = parse_manifest(job.manifest_yaml)
    env = {
        "TRAINYARD_JOB_ID": job.id,
        "TRAINYARD_ATTEMPT": str(job.attempt),
        "DATA_DIR": str(folder / "data"),
        "RESULT_DIR": str(folder / "results"),
        "CHECKPOINT_DIR": str(checkpoints.attempt_dir(folder, job.attempt)),
        "NUM_LEARNERS": str(job.learners),
        "GPU_COUNT": str(job.gpus),
    }
    resume_from = checkpoints.last_good(folder, job.attempt)
    if resume_from:
        env["RESUME_FROM"] = str(resume_from)
    framework = frameworks.REGISTRY[manifest.framework]
    env.update(framework.env)
    # Learners of one job share a private network namespace on `local`, so any port is free there;
    # it still differs per job and attempt for a machine that cannot create namespaces.
    port = 20000 + int(hashlib.sha256(f"{job.id}:{job.attempt}".encode()).hexdigest()[:6], 16) % 20000
    # Each learner's agent gets its own ingest credential, good only for this attempt and learner.
    tokens = credentials.issue_for_attempt(job)
    learners = []
    for index in range(job.learners):
        placement = job.placement[index] if index < len(job.placement) else {"gpu_ids": []}
        learner_env = {"LEARNER_ID": str(index)}
        if job.learners > 1:
            learner_env.update(RANK=str(index), WORLD_SIZE=str(job.learners), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port))
            learner_env.update(framework.distributed_env(index=index, learners=job.learners,
                                                         hosts=["127.0.0.1"] * job.learners, port=port))
        learners.append(LearnerSpec(index=index, env=learner_env, gpu_ids=tuple(placement["gpu_ids"]),
                                    node=placement.get("node", ""), ingest_token=tokens[index]))
    return DeploySpec(
        job_id=job.id, attempt=job.attempt, tenant=job.tenant.slug, command=manifest.command,
        code_archive=str(code_archive(job)), job_dir=str(folder), learners=tuple(learners), cpus=job.cpus,
        memory_bytes=job.memory_bytes, gpus=job.gpus, env=env, metric_regexes=manifest.metric_regexes,
        checkpoint_signal=manifest.checkpoint_signal, grace_seconds=manifest.grace_seconds,
        ingest_url=f"{settings.PUBLIC_URL.rstrip('/')}/api/v1/ingest/{job.id}/", framework=manifest.framework,
        framework_version=manifest.framework_version, image=framework.image_for(manifest.framework_version))


def latest_checkpoint(job):
    """The newest complete checkpoint of this attempt or, failing that, of the ones before it."""
    return checkpoints.last_good(storage.job_dir(job.tenant.slug, job.id), job.attempt + 1)


# --- learners report -----------------------------------------------------------------------------
def learner_preparing(job):
    transition(job.id, Status.DOWNLOADING, actor=SYSTEM, reason="fetching code and data", attempt=job.attempt)


def learner_running(job, learner, when):
    Learner.objects.filter(pk=learner.pk).update(state=Learner.State.RUNNING, started_at=when)
    running = Learner.objects.filter(job=job, attempt=job.attempt, state=Learner.State.RUNNING).count()
    if running == job.learners:
        transition(job.id, Status.PROCESSING, actor=SYSTEM, reason="training", attempt=job.attempt)


def learner_exited(job, learner, *, exit_code, reason, when, state=Learner.State.EXITED):
    """Record a learner's end; the last one of the attempt triggers finish_attempt."""
    updated = (Learner.objects.filter(pk=learner.pk).exclude(state__in=[Learner.State.EXITED, Learner.State.LOST])
               .update(state=state, exit_code=exit_code, reason=reason, finished_at=when))
    if not updated:
        return
    pending = Learner.objects.filter(job=job, attempt=learner.attempt).exclude(
        state__in=[Learner.State.EXITED, Learner.State.LOST]).exists()
    if not pending:
        enqueue("finish_attempt", job.id, learner.attempt)
    elif (state == Learner.State.LOST or exit_code != 0) and job.status != Status.HALTING:
        # Gang-stop: the other learners of a distributed job would wait in a collective for the
        # failed one forever, so they are stopped now and the attempt ends (and fails) as one.
        enqueue("teardown", job.id, learner.attempt)


# --- finish --------------------------------------------------------------------------------------
def finish_attempt(job_id, attempt):
    """All learners of the attempt have ended: store results and settle the job's status."""
    _settle_attempt(job_id, attempt)
    # Whatever the outcome, release what the backend still holds for the attempt (finished pods and
    # their Service/Secret/ConfigMap on Kubernetes; leftovers on `local`). Deleting twice is harmless.
    if not Job.objects.filter(pk=job_id, attempt=attempt, status__in=ACTIVE).exists():
        enqueue("teardown", job_id, attempt)


def _settle_attempt(job_id, attempt):
    job = Job.objects.select_related("tenant").filter(pk=job_id, attempt=attempt).first()
    if job is None or job.status not in ACTIVE:
        return
    learners = list(Learner.objects.filter(job=job, attempt=attempt).order_by("index"))
    if job.status == Status.HALTING or (job.status == Status.STORING and _halt_requested(job)):
        _finish_halt(job, learners)
        return
    failed = [lr for lr in learners if lr.state == Learner.State.LOST or lr.exit_code != 0]
    if failed:
        # The one that failed first is the cause; the others may just have been gang-stopped.
        first = min(failed, key=lambda lr: (lr.finished_at or timezone.now(), lr.index))
        _store_results(job)
        if job.retries < parse_manifest(job.manifest_yaml).max_retries:
            _restart(job, _failure_reason(job, first))
        else:
            transition(job.id, Status.FAILED, actor=SYSTEM, attempt=attempt, reason=_failure_reason(job, first),
                       exit_code=first.exit_code)
        return
    if job.status != Status.STORING and not transition(job.id, Status.STORING, actor=SYSTEM,
                                                        reason="storing results", attempt=attempt):
        return
    _store_results(job)
    transition(job.id, Status.COMPLETED, actor=SYSTEM, reason="all learners exited 0", attempt=attempt, exit_code=0)


def _restart(job, failure):
    """Queue the whole job again (every learner, together) as the next attempt, from its checkpoint."""
    checkpoint = latest_checkpoint(job)
    limit = parse_manifest(job.manifest_yaml).max_retries
    resume = f"resumes from {checkpoint.name}" if checkpoint else "starts over: no checkpoint yet"
    if transition(job.id, Status.QUEUED, actor=SYSTEM, attempt=job.attempt, attempt_next=True,
                  reason=f"restart {job.retries + 1} of {limit} ({resume}) after: {failure}",
                  retries=job.retries + 1):
        enqueue("schedule")


def _halt_requested(job):
    last = job.events.filter(to_status__in=[Status.HALTING, Status.PROCESSING, Status.PENDING]).last()
    return last is not None and last.to_status == Status.HALTING


def _finish_halt(job, learners):
    """A halted attempt: keep what it wrote, say whether a new checkpoint came out, release it."""
    if job.status == Status.HALTING and not transition(job.id, Status.STORING, actor=SYSTEM, attempt=job.attempt,
                                                       reason="storing checkpoint after halt"):
        return
    _store_results(job)
    checkpoint = latest_checkpoint(job)
    halted_at = job.events.filter(to_status=Status.HALTING).last().time
    killed = [lr.index for lr in learners if "killed" in lr.reason]
    if checkpoint is not None and checkpoint.stat().st_mtime >= halted_at.timestamp():
        reason = f"halted; resume continues from checkpoint {checkpoint.name}"
    elif checkpoint is not None:
        reason = f"halted, but no new checkpoint was written; resume continues from {checkpoint.name}"
    else:
        reason = "halted, but no checkpoint was written; resume starts from the beginning"
    if killed:
        reason += f" (learner {', '.join(map(str, killed))} ignored the signal and was killed after the grace period)"
    halted = transition(job.id, Status.HALTED, actor=SYSTEM, attempt=job.attempt, reason=reason)
    if halted and halted.preempted_reason:
        _requeue_preempted(halted)


def _requeue_preempted(job):
    """A job halted to make room goes back to the queue at once, keeping its place (submission order)."""
    checkpoint = latest_checkpoint(job)
    resume = f"resumes from {checkpoint.name}" if checkpoint else "starts over: no checkpoint was written"
    if transition(job.id, Status.QUEUED, actor=admission.ACTOR, attempt=job.attempt, attempt_next=True,
                  only_from={Status.HALTED}, reason=f"requeued after preemption ({resume})", preempted_reason=""):
        enqueue("schedule")


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


def _store_results(job):
    """Write the job's log to storage and record every result, checkpoint and log as an artifact."""
    folder = storage.job_dir(job.tenant.slug, job.id)
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    tmp = logs / ".tmp-training.log"
    with open(tmp, "w", encoding="utf-8") as out:
        for line in LogLine.objects.filter(job=job).order_by("seq").values_list("line", flat=True).iterator(5000):
            out.write(line + "\n")
    os.replace(tmp, logs / "training.log")
    checkpoints.apply_retention(folder, job.attempt)
    seen = set()
    for name, kind, path in storage.list_artifacts(job.tenant.slug, job.id):
        seen.add(name)
        values = {"kind": kind, "size": path.stat().st_size, "sha256": storage.sha256_of(path),
                  "complete": kind != Artifact.Kind.CHECKPOINT or checkpoints.is_complete(path)}
        artifact, created = Artifact.objects.get_or_create(job=job, name=name, defaults=dict(values, attempt=job.attempt))
        if not created and (artifact.size, artifact.sha256) != (values["size"], values["sha256"]):
            Artifact.objects.filter(pk=artifact.pk).update(**values)
    job.artifacts.exclude(name__in=seen).delete()  # removed by retention
    transfers.push_results(job)


# --- user actions --------------------------------------------------------------------------------
def terminate(job, *, actor):
    """Stop a job for good; the learners are torn down right after the status change commits."""
    from jobs.states import require_transition
    job = require_transition(job.id, Status.TERMINATED, actor=actor, reason=f"terminated by {actor}")
    enqueue("teardown", job.id, job.attempt)
    return job


def halt(job, *, actor):
    """Ask the learners to checkpoint and stop; the job becomes HALTED once they have."""
    from jobs.states import require_transition
    job = require_transition(job.id, Status.HALTING, actor=actor, reason=f"halt requested by {actor}",
                             attempt=job.attempt)
    enqueue("halt_learners", job.id, job.attempt)
    return job


def halt_learners(job_id, attempt):
    job = Job.objects.select_related("tenant").filter(pk=job_id, attempt=attempt, status=Status.HALTING).first()
    if job is not None:
        get_backend().halt(tenant=job.tenant.slug, job_id=job.id, attempt=attempt, learners=job.learners)


def resume(job, *, actor):
    """Queue a halted job again as a new attempt; its learners start from the last checkpoint."""
    from jobs.states import require_transition
    job = require_transition(job.id, Status.QUEUED, actor=actor, reason=f"resumed by {actor}", attempt=job.attempt,
                             attempt_next=True, only_from={Status.HALTED})
    enqueue("schedule")
    return job


def teardown(job_id, attempt):
    job = Job.objects.select_related("tenant").filter(pk=job_id).first()
    if job is None:
        return
    get_backend().delete(tenant=job.tenant.slug, job_id=job.id, attempt=attempt, learners=job.learners)


# --- reconcile -----------------------------------------------------------------------------------
def reconcile():
    """Bring every active job in line with what the backend reports about its learners, and
    re-drive whatever step a lost task or a crashed worker left undone."""
    backend = get_backend()
    for job in Job.objects.select_related("tenant").filter(status__in=ACTIVE):
        if job.status == Status.STORING:
            enqueue("finish_attempt", job.id, job.attempt)
            continue
        learners = {lr.index: lr for lr in Learner.objects.filter(job=job, attempt=job.attempt)}
        if learners:
            _settle_learners(job, learners, backend.status(tenant=job.tenant.slug, job_id=job.id,
                                                           attempt=job.attempt, learners=job.learners))
        ended = len(learners) == job.learners and all(
            lr.state in (Learner.State.EXITED, Learner.State.LOST) for lr in _reload(learners))
        if ended:
            enqueue("finish_attempt", job.id, job.attempt)  # its task may have been lost
        elif job.status in (Status.PENDING, Status.DOWNLOADING) and not learners:
            enqueue("deploy_job", job.id, job.attempt)  # DOWNLOADING: a data download cut short
        elif job.status == Status.HALTING:
            if learners:
                enqueue("halt_learners", job.id, job.attempt)  # repeated: reaches a late-started agent
            else:
                enqueue("finish_attempt", job.id, job.attempt)
    admission.run_cycle()


def _settle_learners(job, learners, statuses):
    for status in statuses:
        learner = learners.get(status.index)
        if learner is None or learner.state in (Learner.State.EXITED, Learner.State.LOST):
            continue
        with transaction.atomic():
            if status.state == LearnerState.EXITED:
                # The agent ended but its report never arrived: its exit record on disk says how.
                learner_exited(job, learner, exit_code=status.exit_code, reason=status.reason, when=timezone.now())
            elif status.state == LearnerState.MISSING:
                learner_exited(job, learner, exit_code=None, reason=status.reason, when=timezone.now(),
                               state=Learner.State.LOST)


def _reload(learners):
    return Learner.objects.filter(pk__in=[lr.pk for lr in learners.values()])
