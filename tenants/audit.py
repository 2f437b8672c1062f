"""The audit log: every change to quotas, memberships, invitations and tokens, with who made it.

Changes are caught at the model layer (signals), so the admin console, the REST API, the portal
pages and manage.py commands are all recorded the same way; the one thing signals cannot know is
*who* acts, which the request middleware and the commands set in a context variable.
"""
import contextvars
from contextlib import contextmanager

from django.db.models.signals import post_delete, post_save, pre_delete, pre_save

from tenants.models import ApiToken, AuditEntry, GroupMapping, Invitation, Membership, Quota, Tenant

_actor = contextvars.ContextVar("trainyard_audit_actor", default="system")
# The names the platform itself acts under, in the audit log and in jobs' events (jobs.admission,
# jobs.lifecycle, jobs.autoscaler, jobs.idle): no account made on a first sign-in takes one of them.
PLATFORM_ACTORS = frozenset({"system", "anonymous", "scheduler", "lifecycle-manager", "autoscaler", "idle-gpu-policy"})
_reason = contextvars.ContextVar("trainyard_audit_reason", default=None)


@contextmanager
def acting_as(actor):
    token = _actor.set(str(actor))
    try:
        yield
    finally:
        _actor.reset(token)


@contextmanager
def because(reason):
    """Changes made inside say why in their entry (`after["reason"]`): single sign-on removing
    someone from a tenant because the provider took them out of its group (tenants.sso)."""
    token = _reason.set(reason)
    try:
        yield
    finally:
        _reason.reset(token)


def current_actor():
    actor = _actor.get()
    if callable(actor):
        actor = actor()
    return actor


class AuditActorMiddleware:
    """Names the request's user as the actor of changes made while it is handled.

    Resolved when a change is recorded, not here: an API token is checked inside the DRF view,
    after middleware, and DRF hands the user it authenticated back to the underlying request.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        def actor():
            user = getattr(request, "user", None)
            return user.username if user is not None and user.is_authenticated else "anonymous"

        token = _actor.set(actor)
        try:
            return self.get_response(request)
        finally:
            _actor.reset(token)


# Tenants whose deletion is under way in this context. Their members, invitations and hooks are deleted
# first, while the tenant's row still exists, and their entries are written then; an entry naming the
# tenant would then hold a reference to a row gone at commit, and the whole deletion would fail.
_tenants_deleting = contextvars.ContextVar("trainyard_audit_tenants_deleting", default=frozenset())


def _tenant_deleting(sender, instance, **kwargs):
    _tenants_deleting.set(_tenants_deleting.get() | {instance.pk})


def _tenant_deleted(sender, instance, **kwargs):
    _tenants_deleting.set(_tenants_deleting.get() - {instance.pk})


def record(action, target_type, target, *, tenant=None, before=None, after=None):
    if tenant is not None and tenant.pk in _tenants_deleting.get():
        tenant = None  # the entry outlives the tenant: its label still names it
    if (reason := _reason.get()) is not None:
        after = {**(after or {}), "reason": reason}
    AuditEntry.objects.create(actor=current_actor(), action=action, tenant=tenant, target_type=target_type,
                              target=target, before=before, after=after)


# What each audited model looks like in the log: its type name, a label, its tenant, its fields.
def _quota(q):
    return "quota", q.tenant.slug, q.tenant, q.as_dict()


def _membership(m):
    return "membership", f"{m.user.username}@{m.tenant.slug}", m.tenant, {"user": m.user.username, "role": m.role}


def _invitation(i):
    return "invitation", f"{i.username}@{i.tenant.slug}", i.tenant, {"user": i.username, "role": i.role,
                                                                     "invited_by": i.invited_by}


def _token(t):
    state = {"user": t.user.username, "name": t.name, "prefix": t.prefix,
             "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None}
    return "token", f"{t.user.username}/{t.name} ({t.prefix}…)", None, state


def _group_mapping(g):
    return "group mapping", f"{g.group}@{g.tenant.slug}", g.tenant, {"group": g.group, "role": g.role}


DESCRIBE = {Quota: _quota, Membership: _membership, Invitation: _invitation, ApiToken: _token,
            GroupMapping: _group_mapping}


def _before(sender, instance, **kwargs):
    old = sender.objects.filter(pk=instance.pk).first() if instance.pk else None
    instance._audit_before = DESCRIBE[sender](old)[3] if old else None


def _after_save(sender, instance, created, **kwargs):
    kind, label, tenant, state = DESCRIBE[sender](instance)
    before = getattr(instance, "_audit_before", None)
    if not created and before == state:
        return  # saved without changing anything worth recording (e.g. last_used_at)
    record("created" if created else "changed", kind, label, tenant=tenant, before=before, after=state)


def _after_delete(sender, instance, **kwargs):
    kind, label, tenant, state = DESCRIBE[sender](instance)
    record("deleted", kind, label, tenant=tenant, before=state)


pre_delete.connect(_tenant_deleting, sender=Tenant, dispatch_uid="audit-tenant-deleting")
post_delete.connect(_tenant_deleted, sender=Tenant, dispatch_uid="audit-tenant-deleted")
for _model in DESCRIBE:
    pre_save.connect(_before, sender=_model, dispatch_uid=f"audit-before-{_model.__name__}")
    post_save.connect(_after_save, sender=_model, dispatch_uid=f"audit-save-{_model.__name__}")
    post_delete.connect(_after_delete, sender=_model, dispatch_uid=f"audit-delete-{_model.__name__}")
