"""How jobs, events, log lines and metric points look in JSON (REST and websockets alike)."""
from urllib.parse import quote

from rest_framework import serializers

from gpu_scheduler.reasons import split_position
from jobs import datastores, disk, elastic_timeline
from jobs.models import Allocation, Artifact, Job, JobEvent, MetricPoint, Status
from jobs.models import FINAL


def log_line_json(line):
    return {"seq": line.seq, "learner": line.learner, "stream": line.stream,
            "time": line.time.isoformat(), "line": line.line}


def metric_json(point):
    return {"name": point.name, "step": point.step, "value": point.value,
            "time": point.time.isoformat(), "learner": point.learner, "attempt": point.attempt}


def queue_position(job):
    """1-based place in its tenant's queue as the scheduler's latest cycle ordered it (the place its
    wait_reason begins with), or None: not queued, or no cycle has seen it yet (a cycle follows each
    submission). One home for the place: a count of the jobs ahead by priority and submission time
    disagreed with the scheduler's order (service levels, requeued jobs keeping theirs) and cost every
    queued job in an answer a count of its tenant's queue, which slowed submissions to a long queue
    under load. Places past the head of a long queue are as
    fresh as the positions' refresh (jobs.admission._reasons_to_write)."""
    if job.status != Status.QUEUED:
        return None
    return split_position(job.wait_reason or "")[0]


def latest_metrics(job):
    """{name: {value, step}} of each metric's most recent point."""
    latest = {}
    for point in MetricPoint.objects.filter(job=job).order_by("id").only("name", "value", "step"):
        latest[point.name] = {"value": point.value, "step": point.step}
    return latest


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    tenant = serializers.CharField(source="tenant.slug")
    final = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField()
    page_url = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "name", "description", "framework", "status", "status_reason", "wait_reason", "attempt",
                  "retries", "exit_code", "priority", "learners", "gpus", "cpus", "memory_bytes", "owner", "tenant",
                  "created_at", "admitted_at", "started_at", "finished_at", "queue_position", "final",
                  "page_url", "code_sha256", "code_bytes", "private"]

    def get_final(self, job) -> bool:
        return job.status in FINAL

    def get_queue_position(self, job) -> int | None:
        return queue_position(job)

    def get_page_url(self, job) -> str:
        return f"/jobs/{job.id}/"


class JobDetailSerializer(JobSerializer):
    """A job in full. With context {"just_submitted": True} (the job the request itself created and
    nobody has run yet), what it cannot have yet (metric points, usage) is not looked up: under load
    each query of a submission's answer waited for a turn on the busy cores."""
    latest_metrics = serializers.SerializerMethodField()
    usage = serializers.SerializerMethodField()
    elastic = serializers.SerializerMethodField()
    log_lines = serializers.IntegerField(source="log_seq", read_only=True)  # stored so far, all attempts
    disk = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + ["manifest", "manifest_yaml", "placement", "latest_metrics", "usage",
                                              "log_lines", "log_bytes", "log_dropped_lines", "log_dropped_bytes",
                                              "elastic", "disk"]

    def get_latest_metrics(self, job) -> dict:
        return {} if self.context.get("just_submitted") else latest_metrics(job)

    def get_usage(self, job) -> dict:
        from tenants.quotas import job_usage, records_usage
        return records_usage([]) if self.context.get("just_submitted") else job_usage(job)

    def get_disk(self, job) -> dict:
        """The job's disk caps (jobs.disk): bytes, and log_lines a count."""
        return disk.stored_caps((job.runtime or {}).get("disk"))

    def get_elastic(self, job) -> dict | None:
        return elastic_timeline.summary(job)

    def to_representation(self, job):
        data = super().to_representation(job)
        if self.context.get("just_submitted"):
            return data  # stored redacted by this very request (jobs.submission), not read back
        # Data-store credentials are never shown back: stored redacted already, and redacted again
        # here so that no stored form (an older row, a manual edit) can leak them.
        data["manifest"] = datastores.redact(data.get("manifest"))
        data["manifest_yaml"] = datastores.redact_yaml(data.get("manifest_yaml") or "")
        return data


class JobEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobEvent
        fields = ["time", "from_status", "to_status", "attempt", "actor", "reason"]


class AllocationSerializer(serializers.ModelSerializer):
    """One stretch of an elastic job's allocation timeline (jobs.elastic_timeline)."""

    samples_per_s = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = Allocation
        fields = ["attempt", "learners", "gpus_per_learner", "global_batch", "local_batch", "lr_scale", "placement",
                  "reason", "resize_requested_at", "resize_cost_s", "started_at", "ended_at", "samples_start",
                  "samples_end", "samples_per_s"]


class ArtifactSerializer(serializers.ModelSerializer):
    url = serializers.SerializerMethodField()

    class Meta:
        model = Artifact
        fields = ["name", "kind", "size", "sha256", "attempt", "complete", "created_at", "url"]

    def get_url(self, artifact) -> str:
        return f"/api/v1/jobs/{artifact.job_id}/artifacts/{quote(artifact.name)}"  # "#" and "?" are a name's too
