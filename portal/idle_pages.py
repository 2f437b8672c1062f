"""The tenant's idle-GPU policy on its usage page (/tenant/): every member sees it there, and its admins
set or remove it with the form there (POST /tenant/idle-gpus/), as with PUT and DELETE
/api/v1/tenants/current/idle-gpus/ (jobs.idle_api), whose checks the form shares."""
from django.contrib import messages
from django.http import HttpResponseForbidden
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from jobs import idle
from jobs.idle_api import IdleGpuPolicySerializer, refusal_text
from portal import views

FIELDS = ("below_percent", "minutes", "action")


@require_POST
@views.tenant_page
def idle_gpu_policy(request, membership):
    if not membership.is_admin:
        return HttpResponseForbidden("Only the tenant's admins set its idle-GPU policy.")
    if request.POST.get("remove"):
        idle.remove_policy(membership.tenant)
        messages.success(request, "The idle-GPU policy is removed: no job is flagged or halted for idle GPUs.")
        return redirect("/tenant/")
    data = IdleGpuPolicySerializer(data={name: request.POST.get(name) for name in FIELDS})
    if not data.is_valid():
        messages.error(request, f"The idle-GPU policy is unchanged: {refusal_text(data.errors)}")
        return redirect("/tenant/")
    policy = idle.set_policy(membership.tenant, **data.validated_data, actor=request.user.username)
    messages.success(request, f"Idle-GPU policy saved: {idle.policy_text(policy)}, then {policy.action}.")
    return redirect("/tenant/")
