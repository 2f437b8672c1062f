"""A training job, its learners, its history, and what its learners reported."""
import secrets
import string

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models import Tenant

ID_ALPHABET = string.ascii_lowercase + string.digits


def new_job_id():
    return "training-" + "".join(secrets.choice(ID_ALPHABET) for _ in range(10))


class Status(models.TextChoices):
    QUEUED = "QUEUED"
    PENDING = "PENDING"
    DOWNLOADING = "DOWNLOADING"
    PROCESSING = "PROCESSING"
    STORING = "STORING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    HALTING = "HALTING"
    HALTED = "HALTED"
    TERMINATED = "TERMINATED"


# A job in a final state never changes again; an active one holds resources (its usage record is open).
FINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.TERMINATED})
# Nothing more happens to a job at rest unless someone asks (a halted job waits to be resumed): what
# a script waits for (trainyard.Client.wait).
AT_REST = FINAL | {Status.HALTED}
ACTIVE = frozenset({Status.PENDING, Status.DOWNLOADING, Status.PROCESSING, Status.STORING, Status.HALTING})


class Job(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_job_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="jobs")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    framework = models.CharField(max_length=40)
    manifest = models.JSONField()
    manifest_yaml = models.TextField()
    learners = models.PositiveIntegerField(default=1)
    gpus = models.PositiveIntegerField(default=0)  # per learner
    cpus = models.FloatField(default=1.0)  # per learner
    memory_bytes = models.BigIntegerField()  # per learner
    priority = models.CharField(max_length=10, default="normal")
    # A private job is seen only by its owner, the tenant's admins and the users it is shared with
    # (django-guardian object permissions: view_job to see it, change_job to halt/resume/terminate it).
    private = models.BooleanField(default=False)
    code_sha256 = models.CharField(max_length=64)
    code_bytes = models.BigIntegerField(default=0)
    # What the steps after submission need from the manifest (jobs.runtime, versioned), written once at
    # submission: later steps read this, never the stored manifest, so a rule tightened since cannot
    # break a job that was accepted under the old one.
    runtime = models.JSONField(default=dict, blank=True)

    # Written only by jobs.states.transition().
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    attempt = models.PositiveIntegerField(default=1)
    retries = models.PositiveIntegerField(default=0)  # automatic restarts used (manifest restart_policy)
    exit_code = models.IntegerField(null=True, blank=True)
    # Why a QUEUED job waits, written by each scheduling pass ("waiting: needs 2 GPUs ...").
    wait_reason = models.TextField(blank=True)
    # Where the current attempt's learners run: [{"node": ..., "gpu_ids": [...]}, ...]
    placement = models.JSONField(default=list, blank=True)
    # Set when the scheduler halts the job to make room for other work: once its checkpoint is
    # stored it goes back to QUEUED instead of staying HALTED.
    preempted_reason = models.TextField(blank=True)
    # Set by the idle-GPU pass (jobs.idle) when the job's GPUs stayed below its tenant's threshold for
    # the tenant's window: since when they were idle, and in which attempt (a new attempt is not flagged).
    gpus_idle_since = models.DateTimeField(null=True, blank=True)
    gpus_idle_attempt = models.PositiveIntegerField(default=0)
    # A batch change asked of the running attempt's learners and not yet acknowledged
    # (jobs.elastic_timeline.request_batch): {"id": its Allocation row, "global_batch", "local_batch",
    # "lr_scale"}. Ingest answers every post of the attempt's agents with it (a column of the row
    # ingest locks anyway), until learner 0 reports it applied.
    batch_request = models.JSONField(null=True, blank=True)

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(default=timezone.now)
    admitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    # Job-wide counter behind LogLine.seq; bumped under the job's row lock during ingest.
    log_seq = models.BigIntegerField(default=0)
    # The log's bytes stored, and the lines and bytes counted but not stored past a log cap (jobs.logcap).
    log_bytes = models.BigIntegerField(default=0)
    log_dropped_lines = models.BigIntegerField(default=0)
    log_dropped_bytes = models.BigIntegerField(default=0)

    # Set when a member deletes the ended job (jobs.deletion): from then on nobody sees it and it never
    # moves again; the purge pass removes its files, logs and metrics and sets purged_at. The row stays,
    # with its events and usage records, so the GPU-hours it held still count.
    deleted_at = models.DateTimeField(null=True, blank=True)
    deleted_by = models.CharField(max_length=150, blank=True)
    purged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        # (tenant, created_at) serves the jobs page's default order; with status in between, its status
        # filter (jobs.listing keyset pages stay one index range at 100,000 jobs). On PostgreSQL the
        # table leaves 30% of each page free for rewritten wait reasons (migration 0012). The tenant's
        # queued jobs alone: a submission counts them (jobs.submission) in an index a fraction of the
        # table's size, where a tenant's long queue made the count a scan of the whole table.
        indexes = [models.Index(fields=["tenant", "-created_at"]),
                   models.Index(fields=["tenant", "status", "-created_at"], name="job_tenant_status_created"),
                   models.Index(fields=["tenant"], condition=models.Q(status=Status.QUEUED), name="job_queued_per_tenant"),
                   # The purge pass's work: deleted jobs not purged yet, few at any time.
                   models.Index(fields=["tenant", "deleted_at"], name="job_to_purge",
                                condition=models.Q(deleted_at__isnull=False, purged_at=None))]

    @property
    def is_first_attempt(self):
        """Attempt 1 becomes PENDING once and before anything of the job ran: every way back to QUEUED
        starts a new attempt (jobs.states' attempt_next), and a resize writes the rows of the attempt
        after the running one. So nothing of an earlier attempt (an open allocation or usage record)
        and no samples reported can exist for it: its status changes skip those lookups
        (jobs.elastic_timeline, tenants.quotas), three queries of its first scheduling cycle among them."""
        return self.attempt == 1

    def __str__(self):
        return self.id

    @property
    def gpus_idle(self):
        """Since when this attempt's GPUs have been idle by its tenant's policy, or None."""
        return self.gpus_idle_since if self.gpus_idle_attempt == self.attempt else None

    @property
    def total_gpus(self):
        return self.gpus * self.learners


class Learner(models.Model):
    """One learner process (or pod) of one attempt of a job."""

    class State(models.TextChoices):
        DEPLOYING = "deploying"
        RUNNING = "running"
        EXITED = "exited"
        LOST = "lost"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="learner_set")
    attempt = models.PositiveIntegerField()
    index = models.PositiveIntegerField()
    state = models.CharField(max_length=20, choices=State.choices, default=State.DEPLOYING)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.TextField(blank=True)
    # Highest agent sequence number stored: records at or below it are resends and are dropped.
    acked_seq = models.BigIntegerField(default=0)
    # What ingest keeps of this learner between posts (jobs.ingest): its TensorBoard event files read so
    # far (jobs.tensorboard: each file's last stored record offset, which of each run's tags are
    # scalars), its metric points stored and counted past a cap (jobs.logcap.MetricMeter), and its
    # refused-record notes (jobs.ingest).
    ingest_state = models.JSONField(default=dict, blank=True)
    # This learner's log lines and bytes stored, and those counted but not stored past a log cap (jobs.logcap).
    log_lines = models.BigIntegerField(default=0)
    log_bytes = models.BigIntegerField(default=0)
    log_dropped_lines = models.BigIntegerField(default=0)
    log_dropped_bytes = models.BigIntegerField(default=0)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "index"], name="one_learner_per_slot")]


class LearnerCredential(models.Model):
    """What one learner's agent posts to ingest with (jobs.credentials): good for one job, one attempt
    and one learner. Only its SHA-256 is kept; the token itself exists only in the agent's config.

    Whether its attempt is over is not stored here but read from the job row in the same query, so it
    can never disagree with the job's state."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="credentials")
    attempt = models.PositiveIntegerField()
    learner = models.PositiveIntegerField()
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    time = models.DateTimeField(default=timezone.now)
    from_status = models.CharField(max_length=20, blank=True)
    to_status = models.CharField(max_length=20)
    attempt = models.PositiveIntegerField(default=1)
    actor = models.CharField(max_length=150)
    reason = models.TextField(blank=True)

    class Meta:
        ordering = ["time", "id"]


class LogLine(models.Model):
    # No index of its own: the (job, seq) unique index serves every lookup and one index fewer
    # makes the hottest insert path cheaper.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_lines", db_index=False)
    seq = models.BigIntegerField()  # dense, job-wide, from 1: clients resume with ?since=
    attempt = models.PositiveIntegerField(default=1)
    learner = models.PositiveIntegerField(default=0)
    stream = models.CharField(max_length=6)  # stdout | stderr
    time = models.DateTimeField()
    line = models.TextField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="one_log_line_per_seq")]


class MetricPoint(models.Model):
    # Indexed by (job, id) below: a job's points in the order they came, one range of it a page (by the
    # job alone, a page after a job's last points walked every later point of every tenant).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_points", db_index=False)
    attempt = models.PositiveIntegerField(default=1)
    learner = models.PositiveIntegerField(default=0)
    name = models.CharField(max_length=100)
    step = models.BigIntegerField(null=True, blank=True)
    value = models.FloatField()
    time = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["job", "name", "id"]),
                   models.Index(fields=["job", "id"], name="metric_point_job_id")]


class ResourceSample(models.Model):
    """What one learner used at one moment, as its agent sampled it (learner_agent.telemetry): CPU
    cores over the last period, memory now and at its highest against the limit, and each of its GPUs
    ({index, utilization, memory_used_bytes, memory_total_bytes, power_watts, learner_memory_bytes})."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="resource_samples")
    attempt = models.PositiveIntegerField(default=1)
    learner = models.PositiveIntegerField(default=0)
    time = models.DateTimeField()
    cpu_cores = models.FloatField()
    memory_bytes = models.BigIntegerField()
    memory_peak_bytes = models.BigIntegerField()
    memory_limit_bytes = models.BigIntegerField(null=True, blank=True)
    gpus = models.JSONField(default=list, blank=True)
    # The busiest of `gpus` (utilisation %), kept as a column so that the idle-GPU pass (jobs.idle) and
    # the usage report read it in SQL; None when the sample has no GPU utilisation.
    gpu_utilization = models.FloatField(null=True, blank=True)
    # The sum of `gpus`' utilisations as GPUs (two GPUs at 50%: 1.0), what the usage report counts as GPU
    # time used (jobs.usage); None when the sample has no GPU utilisation.
    gpus_busy = models.FloatField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["job", "id"]), models.Index(fields=["job", "time"], name="sample_job_time"),
                   models.Index(fields=["time"], name="sample_time")]  # the cluster's history (jobs.node_use)


class ResourceDay(models.Model):
    """What one learner's samples of one day added up to, kept once they are pruned (jobs.retention): the
    sums the usage report takes of samples (jobs.usage), so a period of old days reads the same."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="resource_days")
    attempt = models.PositiveIntegerField()
    learner = models.PositiveIntegerField()
    day = models.DateField()  # UTC
    samples = models.PositiveIntegerField()
    cpu_cores = models.FloatField()  # the sum of the samples' cpu_cores
    gpus_busy = models.FloatField()  # the sum of their gpus_busy, over the `gpu_samples` that had one
    gpu_samples = models.PositiveIntegerField()
    first = models.DateTimeField()
    last = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "learner", "day"], name="one_resource_day")]
        indexes = [models.Index(fields=["day"], name="resource_day")]


class IdleGpuPolicy(models.Model):
    """A tenant's rule for GPUs held and not used (jobs.idle): a running job whose GPUs all stay below
    `below_percent` utilisation for `minutes` is flagged and a GPUS_IDLE webhook event sent; with
    `action` halt it is also halted through its checkpoint, which frees its GPUs."""

    class Action(models.TextChoices):
        FLAG = "flag"
        HALT = "halt"

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="idle_gpu_policy")
    below_percent = models.FloatField(help_text="GPU utilisation (%) under which a GPU counts as idle")
    minutes = models.FloatField(help_text="how long all of a job's GPUs must stay idle")
    action = models.CharField(max_length=10, choices=Action.choices, default=Action.FLAG)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True)

    def __str__(self):
        return f"idle GPUs of {self.tenant}: below {self.below_percent:g}% for {self.minutes:g} min: {self.action}"

    def as_dict(self):
        return {"below_percent": self.below_percent, "minutes": self.minutes, "action": self.action}


class IdleWatch(models.Model):
    """How far the idle-GPU pass (jobs.idle) has read a running job's resource samples, with the newest
    of them and the newest busy one, so that a pass reads only the samples stored since the one before,
    whatever the tenant's window. It holds for one attempt under one policy: a change of either starts
    it again."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, primary_key=True, related_name="+")
    attempt = models.PositiveIntegerField()
    below_percent = models.FloatField()
    minutes = models.FloatField()
    read_through = models.BigIntegerField(default=0)  # the highest sample id read; 0: none yet
    latest = models.DateTimeField(null=True, blank=True)  # of the samples read that have a GPU utilisation
    last_busy = models.DateTimeField(null=True, blank=True)  # of those at or above below_percent


class Artifact(models.Model):
    """A stored result file or checkpoint, recorded when the job's results are stored."""

    class Kind(models.TextChoices):
        RESULT = "result"
        CHECKPOINT = "checkpoint"
        LOG = "log"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="artifacts")
    attempt = models.PositiveIntegerField(default=1)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    name = models.CharField(max_length=500)  # path under the job's storage, e.g. results/model.pt
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    # False for a checkpoint that was cut short (see jobs.checkpoints.is_complete): listed, never resumed from.
    complete = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="one_artifact_per_name")]


class LearnerUid(models.Model):
    """A number of a job's own, made at its first deploy: its id numbers the uid the job's learners run
    as on the local backend (learner_agent.sandbox.learner_identity), so no two of any 2**24 jobs in a
    row share one. A uid from a hash of the job's id could be the same for two tenants' running jobs,
    which could then signal each other's processes and reach each other's files."""
    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="learner_uid")


class FollowUp(models.Model):
    """The outbox (jobs.outbox): work a status change requires, written in the transaction that made
    the change, and done by whichever worker claims it. The row, not the Celery message that wakes
    a worker, is the record: a lost message delays the work until the reconcile pass sends another."""

    class Kind(models.TextChoices):
        DEPLOY = "deploy"
        HALT = "halt"
        FINISH = "finish"
        TEARDOWN = "teardown"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="follow_ups")
    attempt = models.PositiveIntegerField()
    kind = models.CharField(max_length=20, choices=Kind.choices)
    created = models.DateTimeField(default=timezone.now)
    # Not before this time (backoff after a failure).
    due_at = models.DateTimeField(default=timezone.now)
    # A claim older than jobs.outbox.CLAIM_TTL_S is stale: its worker died (a live one renews it).
    claimed_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.CharField(max_length=100, blank=True)
    done_at = models.DateTimeField(null=True, blank=True)
    tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "kind"], condition=models.Q(done_at=None),
                                               name="one_open_follow_up")]
        indexes = [models.Index(fields=["done_at", "due_at"], name="follow_up_open")]

    def __str__(self):
        return f"{self.kind} {self.job_id} attempt {self.attempt}"


class Allocation(models.Model):
    """One stretch of a job's allocation timeline: a shape it ran at (learners, global/local batch,
    learning-rate factor), why it got that shape, and what the change cost and what the stretch yielded.

    Two kinds of change open a stretch (`kind`). A change of learners is a coordinated
    checkpoint-restart: it opens a new attempt and its row (RESIZE). A change of the batch alone is
    made inside the running learners (BATCH): a second row of the same attempt, started when learner
    0 reports it applied. Either closes the row before it (`ended_at`). `resize_cost_s` is measured on
    the row the change opened: from its request (`resize_requested_at`) to all learners of the new
    attempt running, or to the batch change applied. `samples_*` come from the learners' cumulative
    `samples` metric (`report(samples=...)`), so throughput per stretch is
    (samples_end - samples_start) / (ended_at - started_at)."""

    class Kind(models.TextChoices):
        START = "start"  # the attempt's first shape: admitted, resumed or requeued
        RESIZE = "resize"  # learners changed: a new attempt, through the checkpoint
        BATCH = "batch"  # batch changed inside the running attempt, no restart

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="allocations")
    attempt = models.PositiveIntegerField()
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.START)
    learners = models.PositiveIntegerField()
    gpus_per_learner = models.PositiveIntegerField(default=0)
    global_batch = models.PositiveIntegerField(null=True, blank=True)  # null: the job declares no batch
    local_batch = models.PositiveIntegerField(null=True, blank=True)
    lr_scale = models.FloatField(default=1.0)
    # Where the attempt's learners run, as Job.placement: [{"node": ..., "gpu_ids": [...]}] per learner.
    placement = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True)  # e.g. "resized 2→4 learners, batch 256→512: idle GPUs"
    # The signal that ended the last shape (or the batch change's request), and the seconds from it to
    # every learner of the new attempt running (or to the batch change applied).
    resize_requested_at = models.DateTimeField(null=True, blank=True)
    resize_cost_s = models.FloatField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)  # every learner running
    ended_at = models.DateTimeField(null=True, blank=True)
    samples_start = models.BigIntegerField(null=True, blank=True)
    samples_end = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        # An attempt has one row per shape it ran at; at most one of them starts it.
        constraints = [models.UniqueConstraint(fields=["job", "attempt"], condition=~models.Q(kind="batch"),
                                               name="one_allocation_per_attempt")]
        ordering = ["job", "attempt", "id"]

    def __str__(self):
        return f"{self.job_id} attempt {self.attempt} ({self.kind}): {self.learners} learners"

    @property
    def samples_per_s(self):
        """Measured throughput of this stretch, or None while it is unknown."""
        if None in (self.samples_start, self.samples_end, self.started_at, self.ended_at):
            return None
        seconds = (self.ended_at - self.started_at).total_seconds()
        return (self.samples_end - self.samples_start) / seconds if seconds > 0 else None


def new_experiment_id():
    return "exp-" + "".join(secrets.choice(ID_ALPHABET) for _ in range(10))


class Experiment(models.Model):
    """A hyperparameter search: trials (jobs of the tenant) a searcher chooses (jobs.experiments).
    The searcher keeps no state of its own: what it decides from is these rows and their trials'."""

    class State(models.TextChoices):
        ACTIVE = "ACTIVE"  # trials start and run as the searcher decides
        PAUSED = "PAUSED"  # its running trials halted through their checkpoints; none starts
        COMPLETED = "COMPLETED"  # the searcher has nothing left to try and every trial is at rest
        TERMINATED = "TERMINATED"  # killed: every trial stopped

    FINAL_STATES = ("COMPLETED", "TERMINATED")

    id = models.CharField(primary_key=True, max_length=40, default=new_experiment_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="experiments")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="experiments")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    # trainyard.experiment.Experiment.to_json(): the job manifest's fields (data-store credentials
    # redacted), the hyperparameters and the searcher.
    spec = models.JSONField()
    manifest_yaml = models.TextField()  # as submitted, credentials redacted
    searcher = models.CharField(max_length=20)
    metric = models.CharField(max_length=100)
    smaller_is_better = models.BooleanField(default=False)
    private = models.BooleanField(default=False)
    code_sha256 = models.CharField(max_length=64)
    code_bytes = models.BigIntegerField(default=0)

    state = models.CharField(max_length=20, choices=State.choices, default=State.ACTIVE, db_index=True)
    state_reason = models.TextField(blank=True)
    trials_started = models.PositiveIntegerField(default=0)  # the next trial's number
    best_trial = models.PositiveIntegerField(null=True, blank=True)
    best_value = models.FloatField(null=True, blank=True)
    # The last of the trials' metric points its passes have read (MetricPoint.id).
    points_seen = models.BigIntegerField(default=0)

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Set when a member deletes the finished experiment with its trials' jobs (jobs.deletion).
    deleted_at = models.DateTimeField(null=True, blank=True)
    deleted_by = models.CharField(max_length=150, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"])]

    def __str__(self):
        return self.id

    @property
    def is_final(self):
        return self.state in self.FINAL_STATES


class Trial(models.Model):
    """One configuration of an experiment, run as one job (every attempt of it: a trial ASHA pauses at
    a rung is halted, and resumed from its checkpoint when promoted)."""

    class State(models.TextChoices):
        RUNNING = "running"  # its job is queued or running, or halted while the experiment is paused
        PAUSED = "paused"  # ASHA stopped it at a rung; it may be promoted (resumed) later
        COMPLETED = "completed"
        STOPPED = "stopped"  # paused at a rung when the experiment ended, or killed with it
        FAILED = "failed"

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="trials")
    number = models.PositiveIntegerField()
    job = models.OneToOneField(Job, on_delete=models.PROTECT, related_name="trial")
    params = models.JSONField()  # every hyperparameter's value, constants included
    system_attrs = models.JSONField(default=dict, blank=True)  # what the sampler noted (a grid's point)
    state = models.CharField(max_length=20, choices=State.choices, default=State.RUNNING)
    # ASHA: {rung index: the metric's value there}, and the highest rung it was let go on from.
    rungs = models.JSONField(default=dict, blank=True)
    promoted = models.IntegerField(default=-1)
    value = models.FloatField(null=True, blank=True)  # the metric's latest value (final once completed)
    step = models.BigIntegerField(null=True, blank=True)  # the step of that value
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["experiment", "number"], name="trial_number_once")]
        ordering = ["number"]

    def __str__(self):
        return f"{self.experiment_id}#{self.number}"
