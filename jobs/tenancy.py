"""Tenant-scoped job queries: which jobs a member sees, one job by id or 404, and who may control it.

They live with the jobs (tenants.access says which tenant a request acts in; it does not know jobs),
and every lookup of a job for a request goes through here, so an id from another tenant is simply
not found (404) rather than forbidden (403), which would confirm that it exists.
"""
from django.db.models import Q
from django.http import Http404
from guardian.models import UserObjectPermission

from jobs.models import Job
from tenants.models import Membership


def jobs_of(membership):
    """The jobs this member may see: the tenant's not deleted, minus other people's private jobs not
    shared with them."""
    return _seen_by(membership, Job.objects.filter(tenant=membership.tenant, deleted_at=None))


def deleted_jobs_of(membership):
    """The tenant's deleted jobs this member could see before they went (jobs_of's rule otherwise): only
    to tell their open pages that they went, never to show them."""
    return _seen_by(membership, Job.objects.filter(tenant=membership.tenant, deleted_at__isnull=False))


def _seen_by(membership, jobs):
    if membership.is_admin:
        return jobs
    shared = _view_grants().filter(user=membership.user).values("object_pk")
    return jobs.filter(Q(private=False) | Q(owner=membership.user) | Q(pk__in=shared))


def who_sees(job, user_ids):
    """Of `user_ids`, those who may see `job` (jobs_of's rule, for many people in one query): the
    tenant's members; of a private job, only its admins, its owner and those it is shared with."""
    members = Membership.objects.filter(tenant_id=job.tenant_id, user_id__in=user_ids)
    if job.private:
        shared = _view_grants().filter(object_pk=str(job.pk)).values("user_id")
        members = members.filter(Q(role=Membership.Role.ADMIN) | Q(user_id=job.owner_id) | Q(user_id__in=shared))
    return set(members.values_list("user_id", flat=True))


def _view_grants():
    return UserObjectPermission.objects.filter(permission__codename="view_job", content_type__app_label="jobs",
                                               content_type__model="job")


def job_or_404(membership, job_id):
    job = jobs_of(membership).filter(pk=job_id).first()
    if job is None:
        raise Http404(f"No job {job_id!r} in tenant {membership.tenant.slug!r}.")
    return job


def can_manage(membership, job):
    """Share it with others, or delete it (jobs.deletion): tenant admins any job, researchers their own;
    sharing never gives it, and an owner since made a viewer has lost it with the role."""
    return membership.is_admin or (membership.role == Membership.Role.RESEARCHER and job.owner_id == membership.user.pk)


def can_control(membership, job):
    """Halt, resume or terminate: tenant admins any job, researchers their own and those shared
    with them for control; viewers never."""
    if membership.is_admin:
        return True
    if membership.role != Membership.Role.RESEARCHER:
        return False
    return job.owner_id == membership.user.pk or membership.user.has_perm("jobs.change_job", job)
