"""GET/PUT/DELETE /api/v1/tenants/current/idle-gpus/: the tenant's idle-GPU policy (jobs.idle).

Every member may read it; the tenant's admins set and remove it, each change an audit entry."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import idle
from jobs.models import IdleGpuPolicy
from tenants import access


class IdleGpuPolicySerializer(serializers.Serializer):
    below_percent = serializers.FloatField(min_value=0.0, max_value=100.0,
                                           help_text="GPU utilisation (%) under which a GPU counts as idle")
    minutes = serializers.FloatField(min_value=0.05, max_value=7 * 24 * 60,
                                     help_text="how long all of a running job's GPUs must stay idle")
    action = serializers.ChoiceField(choices=IdleGpuPolicy.Action.choices, default=IdleGpuPolicy.Action.FLAG,
                                     help_text="flag: flag the job and send GPUS_IDLE; halt: also halt it "
                                               "through its checkpoint")


class IdleGpuPolicyState(serializers.Serializer):
    policy = IdleGpuPolicySerializer(allow_null=True, help_text="null: the tenant has none")


def refusal_text(errors):
    """"name: what it must be; ..." for each refused field of the serializer."""
    return "; ".join(f"{name}: {' '.join(str(m) for m in messages)}" for name, messages in errors.items())


def _refused(errors):
    """The API's error body: every refused field with what it must be, the first one named as `field`."""
    return Response({"detail": refusal_text(errors), "field": next(iter(errors))}, status=status.HTTP_400_BAD_REQUEST)


def _state(tenant):
    policy = IdleGpuPolicy.objects.filter(tenant=tenant).first()
    return {"policy": policy.as_dict() if policy else None}


class TenantIdleGpus(APIView):
    @extend_schema(responses={200: IdleGpuPolicyState})
    def get(self, request):
        return Response(_state(access.request_membership(request).tenant))

    @extend_schema(request=IdleGpuPolicySerializer, responses={200: IdleGpuPolicyState})
    def put(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return Response({"detail": "only the tenant's admins set its idle-GPU policy"},
                            status=status.HTTP_403_FORBIDDEN)
        data = IdleGpuPolicySerializer(data=request.data)
        if not data.is_valid():
            return _refused(data.errors)
        tenant = membership.tenant
        idle.set_policy(tenant, **data.validated_data, actor=request.user.username)
        return Response(_state(tenant))

    @extend_schema(responses={204: None})
    def delete(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return Response({"detail": "only the tenant's admins remove its idle-GPU policy"},
                            status=status.HTTP_403_FORBIDDEN)
        idle.remove_policy(membership.tenant)
        return Response(status=status.HTTP_204_NO_CONTENT)
