"""Which tenant a request acts in. The queries of tenant-scoped jobs build on it in jobs.tenancy
(this package never imports jobs: jobs builds on tenants, not the other way round).
"""
import re

from tenants.models import Membership, Tenant

TENANT_HEADER = "HTTP_X_TRAINYARD_TENANT"
SLUG = re.compile(r"[-a-zA-Z0-9_]+")  # what a tenant's slug (a SlugField) may be


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
        if not SLUG.fullmatch(requested_slug):  # no tenant is named so (nor can the database compare a NUL)
            raise NoTenant(f"there is no tenant {requested_slug!r}: a tenant's name is letters, digits, - and _")
        membership = memberships.filter(tenant__slug=requested_slug).first()
        if membership is None and is_platform_admin(user):
            tenant = Tenant.objects.filter(slug=requested_slug).first()
            if tenant is not None:
                return Membership(tenant=tenant, user=user, role=Membership.Role.ADMIN)
        if membership is None:
            raise NoTenant(f"you are not a member of tenant {requested_slug!r}")
        return _of(membership, user)
    membership = memberships.first()
    if membership is None:
        raise NoTenant("you are not a member of any tenant; accept an invitation on your account page, or ask a "
                       "tenant admin to invite you")
    return _of(membership, user)


def _of(membership, user):
    """The membership with its user set to the one in hand (it was found by that user): reading
    `membership.user` then costs no query of its own."""
    membership.user = user
    return membership


def requested_tenant(request):
    return request.META.get(TENANT_HEADER) or request.GET.get("tenant")


def request_membership(request):
    return membership_for(request.user, requested_tenant(request))
