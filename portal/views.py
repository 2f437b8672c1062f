"""Browser pages: the job list and the live job page (the full dashboard is its own issue)."""
from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from tenants import access


@login_required
def job_list(request):
    try:
        membership = access.request_membership(request)
    except access.NoTenant as exc:
        return render(request, "no_tenant.html", {"reason": str(exc)}, status=403)
    jobs = access.jobs_of(membership).select_related("owner").order_by("-created_at")[:200]
    return render(request, "jobs/list.html", {"jobs": jobs, "membership": membership})


@login_required
def job_page(request, job_id):
    try:
        membership = access.request_membership(request)
    except access.NoTenant as exc:
        return render(request, "no_tenant.html", {"reason": str(exc)}, status=403)
    job = access.job_or_404(membership, job_id)
    return render(request, "jobs/detail.html", {"job": job, "membership": membership})
