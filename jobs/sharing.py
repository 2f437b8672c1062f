"""Sharing one job with another member of its tenant, through django-guardian object permissions:
`view` lets them see a private job; `control` also lets a researcher halt, resume or terminate it.
Sharing never crosses tenants: the other user must be a member of the job's tenant."""
from guardian.shortcuts import assign_perm, get_users_with_perms, remove_perm

from tenants.models import Membership

ACCESS = {"view": ("view_job",), "control": ("view_job", "change_job")}


class ShareError(Exception):
    def __init__(self, detail, field=None):
        super().__init__(detail)
        self.detail, self.field = detail, field


def share(job, username, access):
    if access not in ACCESS:
        raise ShareError(f"access must be one of {', '.join(ACCESS)}", "access")
    member = Membership.objects.select_related("user").filter(tenant=job.tenant_id, user__username=username).first()
    if member is None:
        raise ShareError(f"{username!r} is not a member of tenant {job.tenant.slug!r}", "username")
    if access == "control" and member.role == Membership.Role.VIEWER:
        raise ShareError(f"{username} is a viewer; viewers cannot control jobs", "access")
    unshare(job, username)
    for codename in ACCESS[access]:
        assign_perm(codename, member.user, job)
    return shared_with(job)


def unshare(job, username):
    for user in get_users_with_perms(job, with_group_users=False):
        if user.username == username:
            for codename in ACCESS["control"]:
                remove_perm(codename, user, job)


def shared_with(job):
    """[{username, access}] for everyone the job is shared with."""
    people = get_users_with_perms(job, attach_perms=True, with_group_users=False)
    return sorted(({"username": user.username, "access": "control" if "change_job" in perms else "view"}
                   for user, perms in people.items()), key=lambda s: s["username"])


def on_membership_deleted(sender, instance, **kwargs):
    """post_delete of Membership (connected in JobsConfig.ready): a user leaving a tenant, however it
    happens, keeps no share of its jobs."""
    from django.contrib.contenttypes.models import ContentType
    from guardian.models import UserObjectPermission

    from jobs.models import Job
    jobs = Job.objects.filter(tenant_id=instance.tenant_id).values("pk")
    UserObjectPermission.objects.filter(user=instance.user, content_type=ContentType.objects.get_for_model(Job),
                                        object_pk__in=jobs).delete()
