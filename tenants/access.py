"""Tenancy in one place: which tenant a request acts in, and the queries scoped to it.

Every lookup of tenant-owned data goes through here, so an id from another tenant is simply not
found (404) rather than forbidden (403), which would confirm that it exists.
"""
from django.http import Http404

from tenants.models import Membership, Tenant

TENANT_HEADER = "HTTP_X_TRAINYARD_TENANT"


class NoTenant(Exception):
    """The user belongs to no tenant, or named one they are not a member of."""


def is_platform_admin(user):
    """Platform admins (Django superusers) stand above every tenant."""
    return bool(user and user.is_authenticated and user.is_active and user.is_superuser)


def membership_for(user, requested_slug=None):
    """The membership a user acts through: the named tenant, else the one they chose as their
    default, else the one they joined first. Never simply the first by name: a tenant someone
    added them to must not catch their requests.

    A platform admin may name any tenant and acts in it as its admin, without being a member.
    """
    if not user or not user.is_authenticated:
        raise NoTenant("not logged in")
    memberships = Membership.objects.select_related("tenant").filter(user=user).order_by("-is_default", "pk")
    if requested_slug:
        membership = memberships.filter(tenant__slug=requested_slug).first()
        if membership is None and is_platform_admin(user):
            tenant = Tenant.objects.filter(slug=requested_slug).first()
            if tenant is not None:
                return Membership(tenant=tenant, user=user, role=Membership.Role.ADMIN)
        if membership is None:
            raise NoTenant(f"you are not a member of tenant {requested_slug!r}")
        return membership
    membership = memberships.first()
    if membership is None:
        raise NoTenant("you are not a member of any tenant; accept an invitation on your account page, or ask a "
                       "tenant admin to invite you")
    return membership


def requested_tenant(request):
    return request.META.get(TENANT_HEADER) or request.GET.get("tenant")


def request_membership(request):
    return membership_for(request.user, requested_tenant(request))


def jobs_of(membership):
    """The jobs this member may see: the tenant's, minus other people's private jobs not shared with them."""
    from django.db.models import Q
    from guardian.models import UserObjectPermission

    from jobs.models import Job
    jobs = Job.objects.filter(tenant=membership.tenant)
    if membership.is_admin:
        return jobs
    shared = UserObjectPermission.objects.filter(
        user=membership.user, permission__codename="view_job",
        content_type__app_label="jobs", content_type__model="job").values("object_pk")
    return jobs.filter(Q(private=False) | Q(owner=membership.user) | Q(pk__in=shared))


def job_or_404(membership, job_id):
    job = jobs_of(membership).filter(pk=job_id).first()
    if job is None:
        raise Http404(f"No job {job_id!r} in tenant {membership.tenant.slug!r}.")
    return job


def can_control(membership, job):
    """Halt, resume or terminate: tenant admins any job, researchers their own and those shared
    with them for control; viewers never."""
    if membership.is_admin:
        return True
    if membership.role != Membership.Role.RESEARCHER:
        return False
    return job.owner_id == membership.user.pk or membership.user.has_perm("jobs.change_job", job)
