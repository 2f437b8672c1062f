"""How jobs, events, log lines and metric points look in JSON (REST and websockets alike)."""
from datetime import datetime
from urllib.parse import quote

from django.db.models import Max
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from gpu_scheduler.reasons import split_position
from jobs import datastores, disk, elastic_timeline
from jobs.models import Allocation, Artifact, Job, JobEvent, MetricPoint, ResourceSample, Status
from jobs.models import FINAL


def log_line_json(line):
    return {"seq": line.seq, "learner": line.learner, "stream": line.stream,
            "time": line.time.isoformat(), "line": line.line}


def metric_json(point):
    return {"name": point.name, "step": point.step, "value": point.value,
            "time": point.time.isoformat(), "learner": point.learner, "attempt": point.attempt}


RESOURCE_FIELDS = ("id", "attempt", "learner", "time", "cpu_cores", "memory_bytes", "memory_peak_bytes",
                   "memory_limit_bytes", "gpus")
_api_time = serializers.DateTimeField().to_representation


def resource_sample_json(sample):
    """ResourceSampleSerializer's shape of a `values(*RESOURCE_FIELDS)` row, built by hand: a page holds
    thousands of samples of up to 64 GPUs each (jobs.api.MAX_RESOURCE_LIMIT), which the serializer took
    seconds of a web thread over. Ingest stored each GPU with exactly its fields
    (jobs.ingest_records.resource_gpus), so they pass as they are."""
    return {**sample, "time": _api_time(sample["time"])}


def queue_position(job):
    """1-based place in its tenant's queue as the scheduler's latest cycle ordered it (the place its
    wait_reason begins with), or None: not queued, or no cycle has seen it yet. Read from the reason,
    not counted, so it agrees with the scheduler's order and costs no query; places past the head of a
    long queue are as fresh as the positions' refresh (jobs.admission._reasons_to_write)."""
    if job.status != Status.QUEUED:
        return None
    return split_position(job.wait_reason or "")[0]


def latest_metrics(job):
    """{name: {value, step}} of each metric's most recent point: found by the database (the index on
    job, name, id), so the web process reads one point per name, never the job's millions."""
    newest = MetricPoint.objects.filter(job=job).values("name").annotate(newest=Max("id")).values("newest")
    points = MetricPoint.objects.filter(id__in=newest).order_by("name").values_list("name", "value", "step")
    return {name: {"value": value, "step": step} for name, value, step in points}


# --- what the job detail's computed fields hold -----------------------------------------------------
class LatestMetricSerializer(serializers.Serializer):
    value = serializers.FloatField()
    step = serializers.IntegerField(allow_null=True)


class JobUsageSerializer(serializers.Serializer):
    """tenants.quotas.job_usage(): all attempts together."""
    gpu_hours = serializers.FloatField()
    cpu_hours = serializers.FloatField()
    seconds = serializers.FloatField(help_text="seconds holding resources")


class DiskCapsSerializer(serializers.Serializer):
    """jobs.disk.stored_caps(): bytes per folder, the log and the training data; log_lines a count."""
    results = serializers.IntegerField()
    checkpoints = serializers.IntegerField()
    work = serializers.IntegerField()
    tmp = serializers.IntegerField()
    logs = serializers.IntegerField()
    log_lines = serializers.IntegerField()
    data = serializers.IntegerField()


class ElasticBatchSerializer(serializers.Serializer):
    min = serializers.IntegerField()
    max = serializers.IntegerField()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["global"] = serializers.IntegerField()  # a Python keyword: no class attribute can name it


class ElasticSummarySerializer(serializers.Serializer):
    """jobs.elastic_timeline.summary(): an elastic job's bounds and the shape it runs at now."""
    min_learners = serializers.IntegerField()
    max_learners = serializers.IntegerField()
    batch = ElasticBatchSerializer(allow_null=True)
    lr_scaling = serializers.CharField()
    learners = serializers.IntegerField()
    global_batch = serializers.IntegerField(allow_null=True)
    local_batch = serializers.IntegerField(allow_null=True)
    lr_scale = serializers.FloatField(allow_null=True)
    allocation_attempt = serializers.IntegerField(allow_null=True)


class PlacementSerializer(serializers.Serializer):
    """Where one learner runs."""
    node = serializers.CharField()
    gpu_ids = serializers.ListField(child=serializers.IntegerField())


@extend_schema_field(PlacementSerializer(many=True))
class PlacementField(serializers.JSONField):
    """The stored placement as it is; the schema says its shape."""


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    tenant = serializers.CharField(source="tenant.slug")
    final = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField()
    page_url = serializers.SerializerMethodField()
    gpus_idle_since = serializers.SerializerMethodField(
        help_text="since when this attempt's GPUs have been idle by the tenant's idle-GPU policy; null: not flagged")

    class Meta:
        model = Job
        fields = ["id", "name", "description", "framework", "status", "status_reason", "wait_reason", "attempt",
                  "retries", "exit_code", "priority", "learners", "gpus", "cpus", "memory_bytes", "owner", "tenant",
                  "created_at", "admitted_at", "started_at", "finished_at", "queue_position", "final",
                  "page_url", "code_sha256", "code_bytes", "private", "gpus_idle_since"]

    def get_final(self, job) -> bool:
        return job.status in FINAL

    def get_gpus_idle_since(self, job) -> datetime | None:
        return job.gpus_idle

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
    placement = PlacementField(read_only=True)

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + ["manifest", "manifest_yaml", "placement", "latest_metrics", "usage",
                                              "log_lines", "log_bytes", "log_dropped_lines", "log_dropped_bytes",
                                              "elastic", "disk"]

    @extend_schema_field(serializers.DictField(child=LatestMetricSerializer(), help_text=(
        "each metric's most recent point, by name")))
    def get_latest_metrics(self, job) -> dict:
        return {} if self.context.get("just_submitted") else latest_metrics(job)

    @extend_schema_field(JobUsageSerializer)
    def get_usage(self, job) -> dict:
        from tenants.quotas import job_usage, records_usage
        return records_usage([]) if self.context.get("just_submitted") else job_usage(job)

    @extend_schema_field(DiskCapsSerializer)
    def get_disk(self, job) -> dict:
        """The job's disk caps (jobs.disk): bytes, and log_lines a count."""
        return disk.stored_caps((job.runtime or {}).get("disk"))

    @extend_schema_field(ElasticSummarySerializer(allow_null=True))
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
    """One stretch of an elastic job's allocation timeline (jobs.elastic_timeline): `kind` says what
    started it (start: admitted or resumed; resize: a restart at another number of learners; batch: a
    batch change inside the running attempt, `started_at` null until the learners applied it)."""

    samples_per_s = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = Allocation
        fields = ["attempt", "kind", "learners", "gpus_per_learner", "global_batch", "local_batch", "lr_scale",
                  "placement",
                  "reason", "resize_requested_at", "resize_cost_s", "started_at", "ended_at", "samples_start",
                  "samples_end", "samples_per_s"]


class ArtifactSerializer(serializers.ModelSerializer):
    url = serializers.SerializerMethodField()

    class Meta:
        model = Artifact
        fields = ["name", "kind", "size", "sha256", "attempt", "complete", "created_at", "url"]

    def get_url(self, artifact) -> str:
        return f"/api/v1/jobs/{artifact.job_id}/artifacts/{quote(artifact.name)}"  # "#" and "?" are a name's too


# --- the shapes of answers built by hand ------------------------------------------------------------
# Log lines, metric points, the cluster and the manifest summary are built as plain dicts on paths
# where a serializer per row would cost (log tails, websockets); these classes are what the OpenAPI
# schema says of them, and the API fuzz test checks every answer against it, keys included.
class LogLineSerializer(serializers.Serializer):
    """One line as log_line_json() builds it."""
    seq = serializers.IntegerField()
    learner = serializers.IntegerField()
    stream = serializers.CharField(help_text="stdout, stderr or system (the platform's and the agent's own)")
    time = serializers.DateTimeField()
    line = serializers.CharField(allow_blank=True)


class LogPageSerializer(serializers.Serializer):
    results = LogLineSerializer(many=True)
    next_since = serializers.IntegerField(help_text="pass as ?since= to read on")
    status = serializers.ChoiceField(choices=Status.choices)
    final = serializers.BooleanField(help_text="the job has finished: no line will follow")


class MetricPointSerializer(serializers.Serializer):
    """One point as metric_json() builds it."""
    name = serializers.CharField()
    step = serializers.IntegerField(allow_null=True)
    value = serializers.FloatField()
    time = serializers.DateTimeField()
    learner = serializers.IntegerField()
    attempt = serializers.IntegerField()


class MetricListSerializer(serializers.Serializer):
    results = MetricPointSerializer(many=True)
    next_after = serializers.IntegerField(help_text="pass as ?after= to read on")
    more = serializers.BooleanField(help_text="more points follow this page now")


class JobEventListSerializer(serializers.Serializer):
    results = JobEventSerializer(many=True)


class AllocationListSerializer(serializers.Serializer):
    results = AllocationSerializer(many=True)


class ArtifactPageSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="files in all")
    next = serializers.CharField(allow_null=True, help_text="the link to the page after; null on the last")
    results = ArtifactSerializer(many=True)


class ErrorSerializer(serializers.Serializer):
    """Every error answer of the API (portal.api.exception_handler)."""
    detail = serializers.CharField(help_text="what went wrong")
    field = serializers.CharField(required=False, help_text="the parameter or body field to blame, when one is")


class ElasticSizeSerializer(serializers.Serializer):
    """jobs.elastic_timeline.size()."""
    learners = serializers.IntegerField()
    min_learners = serializers.IntegerField()
    max_learners = serializers.IntegerField()


class ClusterJobSerializer(serializers.Serializer):
    """One of the caller's tenant's active jobs on a node."""
    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    owner = serializers.CharField()
    status = serializers.ChoiceField(choices=Status.choices)
    gpus = serializers.IntegerField(help_text="GPUs it holds on this node")
    learners = serializers.IntegerField(help_text="its learners on this node")
    elastic = ElasticSizeSerializer(allow_null=True)


class ClusterNodeSerializer(serializers.Serializer):
    name = serializers.CharField()
    gpus = serializers.IntegerField()
    cpus = serializers.FloatField()
    memory_bytes = serializers.IntegerField()
    gpus_used = serializers.IntegerField()
    gpus_free = serializers.IntegerField()
    cpus_used = serializers.FloatField()
    cpus_free = serializers.FloatField()
    memory_used = serializers.IntegerField()
    my_jobs = ClusterJobSerializer(many=True)


class ClusterSerializer(serializers.Serializer):
    """Capacity in tenant-neutral figures; only `my_jobs` names jobs, and only the caller's tenant's."""
    backend = serializers.CharField()
    nodes = ClusterNodeSerializer(many=True)
    gpus_total = serializers.IntegerField()
    gpus_used = serializers.IntegerField()


class NodeUsePointSerializer(serializers.Serializer):
    time = serializers.DateTimeField(help_text="the minute's start")
    cpu_cores = serializers.FloatField(help_text="CPU cores the node's learners used, on average over the minute")
    gpus_busy = serializers.FloatField(allow_null=True, help_text="GPUs they kept busy (utilisations summed); "
                                                                  "null where no sample read a GPU")


class NodeUseSerializer(serializers.Serializer):
    name = serializers.CharField()
    points = NodeUsePointSerializer(many=True)


class ClusterUseSerializer(serializers.Serializer):
    """What each node's learners used, minute by minute (jobs.node_use), every tenant's, in totals."""
    minutes = serializers.IntegerField()
    nodes = NodeUseSerializer(many=True)


class ShareSerializer(serializers.Serializer):
    username = serializers.CharField()
    access = serializers.ChoiceField(choices=["view", "control"])


class SharesSerializer(serializers.Serializer):
    private = serializers.BooleanField()
    results = ShareSerializer(many=True)


class ShareRequestSerializer(ShareSerializer):
    access = serializers.ChoiceField(choices=["view", "control"], required=False, default="view")


@extend_schema_field(OpenApiTypes.BINARY)
class UploadField(serializers.FileField):
    """A file of a multipart request (drf-spectacular would call a FileField a URL, as answers show one)."""


class SubmitRequestSerializer(serializers.Serializer):
    manifest = UploadField(help_text="the manifest (YAML), at most 64 KiB")
    code = UploadField(required=False, help_text="the code folder as a zip or tar.gz")
    private = serializers.BooleanField(required=False, help_text="only its owner and tenant admins see it")


class ManifestRequestSerializer(serializers.Serializer):
    manifest = serializers.CharField(help_text="the manifest's YAML text (or, multipart, the file)")


class ManifestSummarySerializer(serializers.Serializer):
    """jobs.api.manifest_summary(): per learner, and in total."""
    name = serializers.CharField(allow_blank=True)
    framework = serializers.CharField()
    framework_version = serializers.CharField(allow_blank=True, allow_null=True)
    command = serializers.CharField()
    learners = serializers.IntegerField()
    gpus = serializers.IntegerField()
    cpus = serializers.FloatField()
    memory_bytes = serializers.IntegerField()
    priority = serializers.CharField()
    total_gpus = serializers.IntegerField()
    total_cpus = serializers.FloatField()
    total_memory_bytes = serializers.IntegerField()
    max_retries = serializers.IntegerField()


class ManifestValidSerializer(serializers.Serializer):
    valid = serializers.BooleanField()
    manifest = ManifestSummarySerializer()


class CompareJobSerializer(serializers.Serializer):
    id = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    status = serializers.ChoiceField(choices=Status.choices)
    owner = serializers.CharField()
    attempt = serializers.IntegerField()
    page_url = serializers.CharField()


class CompareRowSerializer(serializers.Serializer):
    """A fact that differs: one value per job, in the order of `jobs` ("" = not set)."""
    key = serializers.CharField()
    label = serializers.CharField()
    values = serializers.ListField(child=serializers.CharField(allow_blank=True))


class CompareSameSerializer(serializers.Serializer):
    key = serializers.CharField()
    label = serializers.CharField()
    value = serializers.CharField()


class CompareSeriesSerializer(serializers.Serializer):
    job = serializers.CharField()
    points = serializers.ListField(child=serializers.ListField(child=serializers.FloatField(allow_null=True),
                                                               min_length=2, max_length=2),
                                   help_text="[step, value] pairs; step null for points without one")
    count = serializers.IntegerField(help_text="points the job has, before thinning or averaging")
    thinned = serializers.BooleanField()
    averaged = serializers.BooleanField()


class CompareMetricSerializer(serializers.Serializer):
    name = serializers.CharField()
    final = serializers.ListField(child=serializers.FloatField(allow_null=True), help_text="one per job")
    series = CompareSeriesSerializer(many=True)


class CompareLimitsSerializer(serializers.Serializer):
    max_jobs = serializers.IntegerField()
    max_metrics = serializers.IntegerField()
    max_points = serializers.IntegerField()


class ComparisonSerializer(serializers.Serializer):
    """jobs.compare.Comparison.as_json()."""
    jobs = CompareJobSerializer(many=True)
    rows = CompareRowSerializer(many=True)
    same = CompareSameSerializer(many=True)
    metrics = CompareMetricSerializer(many=True)
    omitted_metrics = serializers.ListField(child=serializers.CharField())
    limits = CompareLimitsSerializer()


class ResourceGpuSerializer(serializers.Serializer):
    """One of a learner's GPUs in a resource sample; a reading its device does not give is null."""
    index = serializers.IntegerField(help_text="the GPU as the learner numbers it (CUDA_VISIBLE_DEVICES order)")
    utilization = serializers.FloatField(allow_null=True, help_text="percent of the time a kernel ran")
    memory_used_bytes = serializers.IntegerField(allow_null=True, help_text="in use on the GPU, by anyone")
    memory_total_bytes = serializers.IntegerField(allow_null=True)
    power_watts = serializers.FloatField(allow_null=True)
    learner_memory_bytes = serializers.IntegerField(allow_null=True, help_text="held by the learner's own processes")


class ResourceSampleSerializer(serializers.ModelSerializer):
    """What one learner used at one moment (jobs.models.ResourceSample)."""
    gpus = ResourceGpuSerializer(many=True)

    class Meta:
        model = ResourceSample
        fields = ["id", "attempt", "learner", "time", "cpu_cores", "memory_bytes", "memory_peak_bytes",
                  "memory_limit_bytes", "gpus"]


class ResourcePageSerializer(serializers.Serializer):
    results = ResourceSampleSerializer(many=True)
    next_after = serializers.IntegerField(help_text="pass as ?after= to read on")
    more = serializers.BooleanField(help_text="more samples follow this page now")
