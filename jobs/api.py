"""REST endpoints for jobs (SPEC §4). Views parse input, resolve the tenant, and call one action."""
import json
import mimetypes

from django.http import FileResponse, Http404, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework import generics, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import actions, ingest, storage
from jobs.backends import get_backend
from jobs.models import Job, Status
from jobs.serializers import (ArtifactSerializer, JobDetailSerializer, JobEventSerializer, JobSerializer,
                              log_line_json, metric_json)
from jobs.states import FINAL
from tenants import access

MAX_LOG_LIMIT = 10000


class TenantScoped:
    def membership(self):
        if not hasattr(self, "_membership"):
            self._membership = access.request_membership(self.request)
        return self._membership

    def job(self):
        return access.job_or_404(self.membership(), self.kwargs["job_id"])


class JobList(TenantScoped, generics.ListCreateAPIView):
    serializer_class = JobSerializer
    parser_classes = [MultiPartParser]

    def get_queryset(self):
        jobs = access.jobs_of(self.membership()).select_related("owner", "tenant").order_by("-created_at")
        if status_filter := self.request.query_params.get("status"):
            jobs = jobs.filter(status__in=[s.strip().upper() for s in status_filter.split(",")])
        if user := self.request.query_params.get("user"):
            jobs = jobs.filter(owner__username=user)
        return jobs

    def create(self, request, *args, **kwargs):
        manifest = request.FILES.get("manifest")
        if manifest is None:
            raise actions.SubmitError("a manifest file (YAML) is required", field="manifest")
        if manifest.size > 64 * 1024:
            raise actions.SubmitError("manifest is larger than 64 KiB", field="manifest")
        job = actions.submit(self.membership(), manifest_bytes=manifest.read(), code_file=request.FILES.get("code"))
        return Response(JobDetailSerializer(job).data, status=status.HTTP_201_CREATED)


class JobDetail(TenantScoped, APIView):
    def get(self, request, job_id):
        return Response(JobDetailSerializer(self.job()).data)


class JobAction(TenantScoped, APIView):
    """POST halt/ · resume/ · terminate/: 202 with the job, or 409 saying why not now."""

    action = None  # set by as_view(action=...)
    ACTIONS = {"halt": actions.halt, "resume": actions.resume, "terminate": actions.terminate}

    def post(self, request, job_id):
        job = self.job()
        if not self.membership().can_submit:
            return Response({"detail": f"viewers cannot {self.action} jobs"}, status=403)
        job = self.ACTIONS[self.action](job, actor=request.user.username)
        return Response(JobDetailSerializer(job).data, status=status.HTTP_202_ACCEPTED)


class JobEvents(TenantScoped, APIView):
    def get(self, request, job_id):
        return Response({"results": JobEventSerializer(self.job().events.all(), many=True).data})


class JobLogs(TenantScoped, APIView):
    def get(self, request, job_id):
        job = self.job()
        since = _int_param(request, "since", 0)
        limit = min(_int_param(request, "limit", 1000), MAX_LOG_LIMIT)
        lines = [log_line_json(x) for x in job.log_lines.filter(seq__gt=since).order_by("seq")[:limit]]
        job.refresh_from_db(fields=["status"])
        return Response({"results": lines, "next_since": lines[-1]["seq"] if lines else since,
                         "status": job.status, "final": job.status in FINAL})


class JobMetrics(TenantScoped, APIView):
    def get(self, request, job_id):
        points = self.job().metric_points.order_by("id")
        if name := request.query_params.get("name"):
            points = points.filter(name=name)
        return Response({"results": [metric_json(p) for p in points]})


class JobArtifacts(TenantScoped, APIView):
    def get(self, request, job_id):
        return Response({"results": ArtifactSerializer(self.job().artifacts.order_by("name"), many=True).data})


class JobArtifactDownload(TenantScoped, APIView):
    def get(self, request, job_id, name):
        job = self.job()
        if not job.artifacts.filter(name=name).exists():
            raise Http404(f"No artifact {name!r} in job {job.id}.")
        path = storage.artifact_path(job.tenant.slug, job.id, name)
        if path is None:
            raise Http404(f"Artifact {name!r} is no longer stored.")
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FileResponse(open(path, "rb"), as_attachment=True, filename=path.name, content_type=content_type)


class Cluster(APIView):
    """Capacity in tenant-neutral figures: nothing here says whose jobs use it."""

    def get(self, request):
        capacity = get_backend().capacity()
        used = actions.used_resources()
        return Response({"backend": get_backend().name, "nodes": [
            {"name": n.name, "gpus": n.gpus, "cpus": n.cpus, "memory_bytes": n.memory_bytes,
             "gpus_used": used.get(n.name, {}).get("gpus", 0), "cpus_used": used.get(n.name, {}).get("cpus", 0),
             "gpus_free": n.gpus - used.get(n.name, {}).get("gpus", 0)} for n in capacity.nodes],
            "gpus_total": capacity.gpus, "gpus_used": sum(u["gpus"] for u in used.values())})


class CurrentTenant(TenantScoped, APIView):
    def get(self, request):
        membership = self.membership()
        jobs = access.jobs_of(membership)
        active = jobs.filter(status__in=[s for s in Status if s not in FINAL and s not in (Status.QUEUED,
                                                                                          Status.HALTED)])
        return Response({
            "tenant": {"slug": membership.tenant.slug, "name": membership.tenant.name},
            "role": membership.role,
            "quota": {},  # quotas arrive with tenant quotas (their own issue); none are enforced yet
            "usage": {"jobs_running": active.count(),
                      "gpus_in_use": sum(j.gpus * j.learners for j in active.only("gpus", "learners"))},
            "queued": jobs.filter(status=Status.QUEUED).count(),
        })


@csrf_exempt
@require_POST
def ingest_view(request, job_id):
    """Where learner agents post their records; authenticated by the attempt's ingest token."""
    header = request.headers.get("Authorization", "")
    token = header[len("Ingest "):] if header.startswith("Ingest ") else None
    try:
        payload = json.loads(request.body)
        acked = ingest.ingest(job_id, token, payload)
    except ValueError:
        return JsonResponse({"detail": "body is not JSON"}, status=400)
    except ingest.IngestError as exc:
        return JsonResponse({"detail": exc.detail, "acked": exc.acked}, status=exc.status)
    return JsonResponse({"acked": acked})


def _int_param(request, name, default):
    try:
        return max(0, int(request.query_params.get(name, default)))
    except ValueError:
        return default
