"""REST endpoints for jobs (SPEC §4). Views parse input, resolve the tenant, and call one action."""
import os
from pathlib import PurePosixPath
from urllib.parse import urlencode

from django.http import Http404, JsonResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import (admission, compare, deletion, elastic_timeline, ingest, lifecycle, listing, node_use, serving,
                  shared_reads, sharing, storage, submission, tenancy)
from jobs.backends import get_backend
from jobs.serializers import (AllocationListSerializer, AllocationSerializer, ArtifactPageSerializer,
                              ArtifactSerializer, ClusterSerializer, ClusterUseSerializer, ComparisonSerializer,
                              ErrorSerializer,
                              JobDetailSerializer, JobEventListSerializer, JobEventSerializer, JobSerializer,
                              LogPageSerializer, ManifestRequestSerializer, ManifestValidSerializer,
                              MetricListSerializer, ShareRequestSerializer, SharesSerializer,
                              SubmitRequestSerializer, log_line_json, metric_json)
from jobs.serializers import RESOURCE_FIELDS, ResourcePageSerializer, resource_sample_json
from jobs.bounds import BadParameter, BoundedFormParser, BoundedJSONParser, BoundedMultiPartParser, whole_number
from jobs.models import ACTIVE, FINAL, Artifact
from tenants import access, throttling
from tenants.throttling import throttle_ingest
from trainyard.manifest import MAX_MANIFEST_BYTES, ManifestError, parse_manifest

MAX_LOG_LIMIT = 10000
ARTIFACT_PAGE = 200  # files per page of a job's artifacts by default, and at most
MAX_ARTIFACT_PAGE = 1000
MAX_RESOURCE_LIMIT = 5000  # resource samples in one page: the resources chart reads pages this size
MAX_METRIC_LIMIT = 10000  # metric points in one page, and by default
CAPACITY_SHARED_S = 5  # how old the nodes the cluster's answer lists may be
MAX_SEQ = 2**53  # log sequence numbers: far beyond any log, within what every JSON client reads exactly


class TenantScoped:
    def membership(self):
        if not hasattr(self, "_membership"):
            self._membership = access.request_membership(self.request)
        return self._membership

    def job(self):
        return tenancy.job_or_404(self.membership(), self.kwargs["job_id"])

    def owned_job(self):
        job = self.job()
        if not tenancy.can_manage(self.membership(), job):
            raise PermissionDenied("only the job's owner (a researcher) and tenant admins share it")
        return job


class JobList(TenantScoped, generics.ListCreateAPIView):
    """The tenant's jobs, filtered (?status= ?user= ?framework= ?q=) and sorted (?sort=): jobs.listing."""

    serializer_class = JobSerializer
    parser_classes = [BoundedMultiPartParser]

    def get_queryset(self):
        try:
            query = listing.JobQuery.from_params(self.request.query_params)
        except listing.ListingError as exc:
            raise ValidationError({"detail": str(exc), "field": exc.field}) from None
        return query.ordered(query.filter(tenancy.jobs_of(self.membership()).select_related("owner", "tenant")))

    @extend_schema(request={"multipart/form-data": SubmitRequestSerializer}, responses={
        201: JobDetailSerializer,
        403: OpenApiResponse(ErrorSerializer, description="a viewer, or `priority: high` not allowed here"),
        413: OpenApiResponse(ErrorSerializer, description="the code archive is larger than the platform takes"),
        429: OpenApiResponse(ErrorSerializer, description="past the tenant's intake: jobs queued at once or "
                                                          "submissions per minute (Retry-After says when)")})
    def post(self, request, *args, **kwargs):
        return super().post(request, *args, **kwargs)

    def create(self, request, *args, **kwargs):
        membership = self.membership()
        admitted = submission.admit(membership)  # before the upload is parsed (request.FILES)
        manifest = request.FILES.get("manifest")
        if manifest is None:
            raise submission.SubmitError("a manifest file (YAML) is required", field="manifest")
        job = submission.submit(membership, manifest_bytes=_read_manifest(manifest),
                                code_file=request.FILES.get("code"), private=_flag(request.data.get("private")),
                                admitted=admitted)
        return Response(JobDetailSerializer(job, context={"just_submitted": True}).data, status=status.HTTP_201_CREATED)


class JobDetail(TenantScoped, APIView):
    @extend_schema(responses={200: JobDetailSerializer})
    def get(self, request, job_id):
        return Response(JobDetailSerializer(self.job()).data)

    @extend_schema(request=None, responses={
        202: OpenApiResponse(JobDetailSerializer, description=(
            "deleted: the job is gone from every list and answers 404 from now on; its stored files are "
            "removed within moments, and then stop counting against the tenant's storage quota; its usage stays")),
        403: OpenApiResponse(ErrorSerializer, description="not the job's owner or a tenant admin"),
        409: OpenApiResponse(ErrorSerializer, description=(
            "the job has not ended (terminate it first) or is an experiment's trial; `detail` says which"))})
    def delete(self, request, job_id):
        job = self.job()
        if not tenancy.can_manage(self.membership(), job):
            return Response({"detail": "only the job's owner and tenant admins can delete it"}, status=403)
        job = deletion.delete(job, actor=request.user.username)
        return Response(JobDetailSerializer(job).data, status=status.HTTP_202_ACCEPTED)


class JobCompare(TenantScoped, APIView):
    """GET ?ids=a,b,c: the jobs' metrics, one line per job, and what differs between their manifests
    (jobs.compare). 400 naming `ids` for too few, too many or malformed ids; 404 for any id not seen."""

    @extend_schema(
        parameters=[OpenApiParameter("ids", str, required=True, description=(
            "2 to 8 job ids, comma-separated (the parameter may also repeat)"))],
        responses={
            200: OpenApiResponse(ComparisonSerializer, description=(
                "jobs, rows that differ, facts in common, metrics with one series per job and final values")),
            400: OpenApiResponse(ErrorSerializer, description=(
                "`ids` missing, malformed, repeated, fewer than 2 or more than 8")),
            404: OpenApiResponse(ErrorSerializer, description="an id the caller cannot see"),
            429: OpenApiResponse(ErrorSerializer, description=(
                "the tenant's comparisons at once are running; retry after the Retry-After header's seconds"))})
    def get(self, request):
        try:
            ids = compare.parse_ids(request.query_params.getlist("ids"))
            return Response(compare.compare(self.membership(), ids).as_json())
        except compare.CompareError as exc:
            return Response({"detail": str(exc), "field": exc.field}, status=400)


class JobAction(TenantScoped, APIView):
    """POST halt/ · resume/ · terminate/: 202 with the job, or 409 saying why not now."""

    action = None  # set by as_view(action=...)
    ACTIONS = {"halt": lifecycle.halt, "resume": lifecycle.resume, "terminate": lifecycle.terminate}

    @extend_schema(request=None, responses={202: JobDetailSerializer, 409: OpenApiResponse(
        ErrorSerializer, description="Not in this state (e.g. resuming a running job); `detail` says why")})
    def post(self, request, job_id):
        job = self.job()
        if not tenancy.can_control(self.membership(), job):
            detail = (f"viewers cannot {self.action} jobs" if self.membership().role == "viewer" else
                      f"only the job's owner, tenant admins and people it is shared with for control can "
                      f"{self.action} it")
            return Response({"detail": detail}, status=403)
        job = self.ACTIONS[self.action](job, actor=request.user.username)
        return Response(JobDetailSerializer(job).data, status=status.HTTP_202_ACCEPTED)


class JobEvents(TenantScoped, APIView):
    """The job's status history, oldest first."""

    @extend_schema(responses={200: JobEventListSerializer})
    def get(self, request, job_id):
        return Response({"results": JobEventSerializer(self.job().events.all(), many=True).data})


class JobLogs(TenantScoped, APIView):
    """Up to `limit` lines after `since`, and whether more can follow (the job's status)."""

    @extend_schema(parameters=[
        OpenApiParameter("since", int, description=f"lines after this seq (0..{MAX_SEQ}; 0 by default)"),
        OpenApiParameter("limit", int, description=f"lines at most, 0..{MAX_LOG_LIMIT} (1000 by default)")],
        responses={200: LogPageSerializer})
    def get(self, request, job_id):
        job = self.job()
        since = whole_number(request.query_params, "since", default=0, minimum=0, maximum=MAX_SEQ)
        limit = whole_number(request.query_params, "limit", default=1000, minimum=0, maximum=MAX_LOG_LIMIT)
        lines = [log_line_json(x) for x in job.log_lines.filter(seq__gt=since).order_by("seq")[:limit]]
        job.refresh_from_db(fields=["status"])
        return Response({"results": lines, "next_since": lines[-1]["seq"] if lines else since,
                         "status": job.status, "final": job.status in FINAL})


class JobMetrics(TenantScoped, APIView):
    """The job's metric points in the order they arrived, or one metric's (?name=): up to `limit` points
    after the one `after` names (keyset: each page is one range of an index). A job holds up to its
    learners' metric caps of them (jobs.logcap.MetricMeter), far more than one answer should."""

    @extend_schema(parameters=[
        OpenApiParameter("name", str, description="only this metric's points"),
        OpenApiParameter("after", int, description="points after this one (as `next_after` gives it; 0 by default)"),
        OpenApiParameter("limit", int, description=f"points at most, 1..{MAX_METRIC_LIMIT} "
                                                   f"({MAX_METRIC_LIMIT} by default)")],
        responses={200: MetricListSerializer})
    def get(self, request, job_id):
        after = whole_number(request.query_params, "after", default=0, minimum=0, maximum=MAX_SEQ)
        limit = whole_number(request.query_params, "limit", default=MAX_METRIC_LIMIT, minimum=1,
                             maximum=MAX_METRIC_LIMIT)
        points = self.job().metric_points.all()
        if name := request.query_params.get("name"):
            points = points.filter(name=name)
        rows, more = _keyset_page(points, after, limit)
        return Response({"results": [metric_json(p) for p in rows], "next_after": rows[-1].id if rows else after,
                         "more": more})


class JobResources(TenantScoped, APIView):
    """What the job's learners used (CPU, memory, GPUs) as their agents sampled it, oldest first: up
    to `limit` samples after the one `after` names (keyset: each page is one range of the index)."""

    @extend_schema(parameters=[
        OpenApiParameter("after", int, description="samples after this id (as `next_after` gives it; 0 by default)"),
        OpenApiParameter("limit", int, description=f"samples at most, 1..{MAX_RESOURCE_LIMIT} (1000 by default)")],
        responses={200: ResourcePageSerializer})
    def get(self, request, job_id):
        after = whole_number(request.query_params, "after", default=0, minimum=0, maximum=MAX_SEQ)
        limit = whole_number(request.query_params, "limit", default=1000, minimum=1, maximum=MAX_RESOURCE_LIMIT)
        rows, more = _keyset_page(self.job().resource_samples.values(*RESOURCE_FIELDS), after, limit)
        return Response({"results": [resource_sample_json(row) for row in rows],
                         "next_after": rows[-1]["id"] if rows else after, "more": more})


def _keyset_page(rows, after, limit):
    """(up to `limit` rows with an id after `after`, in id order; whether more follow)."""
    rows = list(rows.filter(id__gt=after).order_by("id")[:limit + 1])
    return rows[:limit], len(rows) > limit


class JobArtifacts(TenantScoped, APIView):
    """A page of the job's recorded files in name order (a job may have thousands): `next` is the link
    to the page after, null on the last; `count` is how many there are in all."""

    @extend_schema(parameters=[
        OpenApiParameter("limit", int, description=f"files per page, 1..{MAX_ARTIFACT_PAGE} "
                                                   f"({ARTIFACT_PAGE} by default)"),
        OpenApiParameter("after", str, description="the page starts after this name (as the `next` link gives it)"),
        OpenApiParameter("kind", str, description="only files of these kinds, comma-separated: "
                                                  f"{', '.join(Artifact.Kind.values)} (all by default)")],
        responses={200: ArtifactPageSerializer})
    def get(self, request, job_id):
        limit = whole_number(request.query_params, "limit", default=ARTIFACT_PAGE, minimum=1, maximum=MAX_ARTIFACT_PAGE)
        after = _artifact_name_param(request.query_params, "after")
        kinds = _artifact_kinds_param(request.query_params, "kind")
        artifacts = self.job().artifacts.all()
        if kinds:
            artifacts = artifacts.filter(kind__in=kinds)
        # Keyset, not OFFSET: each page is one range of the (job, name) unique index, however deep.
        rows = list(artifacts.filter(name__gt=after).order_by("name")[:limit + 1])
        next_page = None
        if len(rows) > limit:
            rows = rows[:limit]
            query = {"limit": limit, "after": rows[-1].name, **({"kind": ",".join(kinds)} if kinds else {})}
            next_page = f"{request.path_info}?{urlencode(query)}"
        return Response({"count": artifacts.count(), "next": next_page,
                         "results": ArtifactSerializer(rows, many=True).data})


def _artifact_name_param(params, name):
    """An artifact name given as a query parameter ("" when absent), or BadParameter: one the database
    could not compare (a NUL byte) or no artifact could have (longer than a name may be)."""
    value = params.get(name, "")
    if "\x00" in value or len(value) > Artifact._meta.get_field("name").max_length:
        raise BadParameter(name, "is not an artifact name; take it from the `next` link of the page before")
    return value


def _artifact_kinds_param(params, name):
    """The artifact kinds a comma-separated query parameter names ([] when absent), or BadParameter."""
    kinds = [kind.strip() for kind in params.get(name, "").split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in Artifact.Kind.values]
    if unknown:
        raise BadParameter(name, f"{unknown[0][:40]!r} is not a kind of file; kinds are {', '.join(Artifact.Kind.values)}")
    return kinds


class JobAllocations(TenantScoped, APIView):
    """The allocation timeline: one row per attempt with the shape it ran at, why, what the resize cost and
    the throughput it measured. Empty for a job that never had an allocation row (a fixed job before any)."""

    @extend_schema(responses={200: AllocationListSerializer})
    def get(self, request, job_id):
        return Response({"results": AllocationSerializer(elastic_timeline.timeline(self.job()), many=True).data})


class JobArtifactDownload(TenantScoped, APIView):
    """One recorded file, as an attachment of bytes (application/octet-stream, whatever its name)."""

    @extend_schema(operation_id="v1_jobs_artifact_download", responses={
        (200, "*/*"): OpenApiResponse(OpenApiTypes.BINARY, description="the file"),
        404: OpenApiResponse(ErrorSerializer, description="no such artifact, or no longer stored")})
    def get(self, request, job_id, name):
        job = self.job()
        if not job.artifacts.filter(name=name).exists():
            raise Http404(f"No artifact {name!r} in job {job.id}.")
        stored = storage.open_artifact(job.tenant.slug, job.id, name)
        if stored is None:
            raise Http404(f"Artifact {name!r} is no longer stored.")
        # Bytes a learner wrote, never a type the browser acts on: served as a script (`model.js` as
        # text/javascript) from the platform's own origin, the pages' script-src 'self' would allow it.
        size = os.fstat(stored.fileno()).st_size
        response = StreamingHttpResponse(serving.file_blocks(stored),
                                         content_type="application/octet-stream")
        response["Content-Length"] = str(size)
        response["Content-Disposition"] = content_disposition_header(True, PurePosixPath(name).name)
        return response


class Cluster(APIView):
    """Capacity per node in tenant-neutral figures; `my_jobs` lists only the caller's own tenant's jobs.
    The nodes are read from the backend (on Kubernetes a list of every Node) once per CAPACITY_SHARED_S
    for every caller: anyone signed in may ask as often as they like. What is used is read each time."""

    @extend_schema(responses={200: ClusterSerializer})
    def get(self, request):
        capacity = shared_reads.shared("capacity", CAPACITY_SHARED_S, get_backend().capacity)
        used = admission.used_resources()
        mine = _tenant_jobs_by_node(request)
        nodes = []
        for n in capacity.nodes:
            held = used.get(n.name, {})
            nodes.append({"name": n.name, "gpus": n.gpus, "cpus": n.cpus, "memory_bytes": n.memory_bytes,
                          "gpus_used": held.get("gpus", 0), "gpus_free": n.gpus - held.get("gpus", 0),
                          "cpus_used": held.get("cpus", 0), "cpus_free": n.cpus - held.get("cpus", 0),
                          "memory_used": held.get("memory_bytes", 0), "my_jobs": mine.get(n.name, [])})
        return Response({"backend": get_backend().name, "nodes": nodes, "gpus_total": capacity.gpus,
                         "gpus_used": sum(u["gpus"] for u in used.values())})


class ClusterUse(APIView):
    """What each node's learners used over the last `minutes`, minute by minute (jobs.node_use): the
    cluster page's history. Totals over every tenant's learners, naming no job, as Cluster's are."""

    @extend_schema(parameters=[OpenApiParameter(
        "minutes", int, description=f"how far back, 1..{node_use.MAX_MINUTES} (60 by default)")],
        responses={200: ClusterUseSerializer})
    def get(self, request):
        minutes = whole_number(request.query_params, "minutes", default=60, minimum=1, maximum=node_use.MAX_MINUTES)
        try:
            caller = access.request_membership(request).tenant_id  # one computation at a time per tenant
        except access.NoTenant:  # platform staff
            caller = f"user {request.user.pk}"
        with throttling.held(throttling.CLUSTER_HISTORY, caller):
            nodes = node_use.shared_history(minutes)
        return Response(ClusterUseSerializer({"minutes": minutes, "nodes": nodes}).data)


def _tenant_jobs_by_node(request):
    """{node: [{id, name, owner, status, gpus, learners, elastic}]}: the caller's own tenant's active jobs only;
    `learners` counts the job's learners on that node, `elastic` is the whole job's size and bounds (or null)."""
    try:
        membership = access.request_membership(request)
    except access.NoTenant:
        return {}
    by_node = {}
    jobs = tenancy.jobs_of(membership).filter(status__in=ACTIVE).select_related("owner").only(
        "id", "name", "status", "placement", "learners", "runtime", "owner__username")
    for job in jobs:
        for learner in job.placement or []:
            rows = by_node.setdefault(learner["node"], [])
            row = next((r for r in rows if r["id"] == job.id), None)
            if row is None:
                row = {"id": job.id, "name": job.name, "owner": job.owner.username, "status": job.status,
                       "gpus": 0, "learners": 0, "elastic": elastic_timeline.size(job)}
                rows.append(row)
            row["gpus"] += len(learner.get("gpu_ids") or [])
            row["learners"] += 1
    return by_node


class ManifestValidate(APIView):
    """POST a manifest (JSON {"manifest": "<yaml>"} or a multipart `manifest` file): 200 with what it asks
    for, or the same 400 {detail, field} that submitting it would give. Nothing is stored."""

    parser_classes = [BoundedJSONParser, BoundedMultiPartParser, BoundedFormParser]

    @extend_schema(request=ManifestRequestSerializer, responses={200: ManifestValidSerializer})
    def post(self, request):
        text = _fields(request).get("manifest")
        if hasattr(text, "read"):
            text = _read_manifest(text)
        if not isinstance(text, (str, bytes)):
            raise submission.SubmitError("a manifest (YAML text) is required", field="manifest")
        try:
            manifest = parse_manifest(text.encode() if isinstance(text, str) else text)
        except ManifestError as exc:
            raise submission.SubmitError(str(exc), field=exc.field) from None
        return Response({"valid": True, "manifest": manifest_summary(manifest)})


def _read_manifest(upload):
    if upload.size > MAX_MANIFEST_BYTES:
        raise submission.SubmitError("manifest is larger than 64 KiB", field="manifest")
    return upload.read()


def manifest_summary(manifest):
    """What a valid manifest asks for, per learner and in total."""
    return {"name": manifest.name, "framework": manifest.framework, "framework_version": manifest.framework_version,
            "command": manifest.command, "learners": manifest.learners, "gpus": manifest.gpus, "cpus": manifest.cpus,
            "memory_bytes": manifest.memory_bytes, "priority": manifest.priority,
            "total_gpus": manifest.gpus * manifest.learners, "total_cpus": manifest.cpus * manifest.learners,
            "total_memory_bytes": manifest.memory_bytes * manifest.learners, "max_retries": manifest.max_retries}


@csrf_exempt
@require_POST
@throttle_ingest
def ingest_view(request, job_id):
    """Where learner agents post their records; authenticated by the learner's own credential."""
    header = request.headers.get("Authorization", "")
    token = header[len("Ingest "):] if header.startswith("Ingest ") else None
    try:
        grant = ingest.authenticate(job_id, token)  # before the body is touched: junk costs no parsing
        payload, text_checked = ingest.decode(request.body)
        stored = ingest.ingest(grant, payload, text_checked=text_checked)
    except ValueError:
        return JsonResponse({"detail": "body is not JSON"}, status=400)
    except ingest.IngestError as exc:
        return JsonResponse({"detail": exc.detail, "acked": exc.acked}, status=exc.status)
    return JsonResponse(stored.answer())


class JobSharing(TenantScoped, APIView):
    """GET who a job is shared with; POST {username, access: view|control} shares it. Its owner and the
    tenant's admins decide."""

    @extend_schema(responses={200: SharesSerializer})
    def get(self, request, job_id):
        return Response({"private": self.job().private, "results": sharing.shared_with(self.job())})

    @extend_schema(request=ShareRequestSerializer, responses={200: SharesSerializer})
    def post(self, request, job_id):
        job, fields = self.owned_job(), _fields(request)
        try:
            people = sharing.share(job, str(fields.get("username", "")), str(fields.get("access", "view")))
        except sharing.ShareError as exc:
            return Response({"detail": exc.detail, "field": exc.field}, status=400)
        return Response({"private": job.private, "results": people})


class JobUnshare(TenantScoped, APIView):
    """DELETE .../share/<username>/ stops sharing with them (its own view: the collection takes no DELETE
    and one person's share takes no GET or POST, so those are 405s, not a view called without its argument)."""

    @extend_schema(responses={200: OpenApiResponse(SharesSerializer, description="Who the job is still shared with")})
    def delete(self, request, job_id, username):
        job = self.owned_job()
        sharing.unshare(job, username)
        return Response({"private": job.private, "results": sharing.shared_with(job)})


def _fields(request):
    """The body's fields; a JSON body that is not an object has none, so each is refused by name as missing."""
    return request.data if isinstance(request.data, dict) else {}


def _flag(value):
    return str(value).strip().lower() in ("1", "true", "yes", "on")
