"""GET /api/v1/tenants/current/usage/ (JSON) and .../usage/csv/ (CSV): allocated and used GPU- and
CPU-hours of the caller's tenant for a period (jobs.usage). Every member sees the tenant's and each
user's totals; job rows only for the jobs they may see (jobs.tenancy.jobs_of)."""
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import usage
from jobs.bounds import BadParameter
from tenants import access

PERIOD = [OpenApiParameter("start", str, description="ISO date or time; default: the start of the tenant's "
                                                      "current budget period"),
          OpenApiParameter("end", str, description="ISO date (counted whole) or time; default: the end of that period")]


class UsagePeriodSerializer(serializers.Serializer):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()


class HoursSerializer(serializers.Serializer):
    allocated_gpu_hours = serializers.FloatField(help_text="GPUs held × hours, within the period")
    used_gpu_hours = serializers.FloatField(allow_null=True, help_text="GPU utilisation × hours from the samples; "
                                                                       "null: no GPU utilisation was sampled")
    allocated_cpu_hours = serializers.FloatField()
    used_cpu_hours = serializers.FloatField(help_text="CPU seconds the learners used, in hours")


class TotalsSerializer(HoursSerializer):
    unmeasured_gpu_hours = serializers.FloatField(help_text="allocated GPU-hours of jobs without GPU samples")


class TenantUsageRow(TotalsSerializer):
    tenant = serializers.CharField()


class UserUsageRow(TotalsSerializer):
    user = serializers.CharField()


class JobUsageRow(HoursSerializer):
    job = serializers.CharField()
    name = serializers.CharField()
    user = serializers.CharField()
    deleted = serializers.BooleanField(help_text="The job was deleted; what it held still counts")


class UsageReportSerializer(serializers.Serializer):
    period = UsagePeriodSerializer()
    tenant = TenantUsageRow()
    users = UserUsageRow(many=True)
    jobs = JobUsageRow(many=True)


def _report(request):
    membership = access.request_membership(request)
    start, end = usage.period_of(membership.tenant, request.query_params)
    return usage.report_for(membership, start=start, end=end)


class TenantUsage(APIView):
    @extend_schema(parameters=PERIOD, responses={200: UsageReportSerializer})
    def get(self, request):
        return Response(_report(request))


class TenantUsageCsv(APIView):
    @extend_schema(parameters=[*PERIOD, OpenApiParameter("by", str, enum=list(usage.BY), description="rows per "
                                                         "job (default), user or the tenant")],
                   responses={(200, "text/csv"): OpenApiTypes.STR})
    def get(self, request):
        by = request.query_params.get("by") or "job"
        if by not in usage.BY:
            raise BadParameter("by", f"one of {', '.join(usage.BY)}")
        body = _report(request)
        response = HttpResponse(usage.as_csv(body, by=by), content_type="text/csv; charset=utf-8")
        name = f"usage-{body['tenant']['tenant']}-{body['period']['start'][:10]}-{by}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
