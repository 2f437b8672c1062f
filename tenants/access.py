"""Tenancy in one place: which tenant a request acts in, and the queries scoped to it.

Every lookup of tenant-owned data goes through here, so an id from another tenant is simply not
found (404) rather than forbidden (403), which would confirm that it exists.
"""
from django.http import Http404

from tenants.models import Membership

TENANT_HEADER = "HTTP_X_TRAINYARD_TENANT"


class NoTenant(Exception):
    """The user belongs to no tenant, or named one they are not a member of."""


def membership_for(user, requested_slug=None):
    """The membership a user acts through; the named tenant, or their only/first one."""
    if not user or not user.is_authenticated:
        raise NoTenant("not logged in")
    memberships = Membership.objects.select_related("tenant").filter(user=user).order_by("tenant__slug")
    if requested_slug:
        membership = memberships.filter(tenant__slug=requested_slug).first()
        if membership is None:
            raise NoTenant(f"you are not a member of tenant {requested_slug!r}")
        return membership
    membership = memberships.first()
    if membership is None:
        raise NoTenant("you are not a member of any tenant; ask a platform admin to add you")
    return membership


def requested_tenant(request):
    return request.META.get(TENANT_HEADER) or request.GET.get("tenant")


def request_membership(request):
    return membership_for(request.user, requested_tenant(request))


def jobs_of(membership):
    from jobs.models import Job
    return Job.objects.filter(tenant=membership.tenant)


def job_or_404(membership, job_id):
    job = jobs_of(membership).filter(pk=job_id).first()
    if job is None:
        raise Http404(f"No job {job_id!r} in tenant {membership.tenant.slug!r}.")
    return job
