"""Who belongs to a tenant, and a user's API tokens: the rules the REST API and the portal pages
share — only existing, active users join; roles are the three of Membership; a tenant always keeps
an admin; a token has a name. Every change here is audited (tenants.audit) by the models' signals."""
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from tenants.models import ApiToken, Membership

TOKEN_NAME_MAX = 100


class PeopleError(Exception):
    """A change that is refused, with what to show and the field to blame."""

    def __init__(self, detail, *, field=None, status=400):
        super().__init__(detail)
        self.detail, self.field, self.status = detail, field, status


def add_member(tenant, username, role=Membership.Role.RESEARCHER):
    _check_role(role)
    user = get_user_model().objects.filter(username=username, is_active=True).first()
    if user is None:
        raise PeopleError(f"there is no user {username!r}; a platform admin creates accounts", field="username")
    member, created = Membership.objects.get_or_create(tenant=tenant, user=user, defaults={"role": role})
    if not created:
        raise PeopleError(f"{user.username} is already a member ({member.role})", field="username", status=409)
    return member


def change_role(member, role):
    _check_role(role)
    with transaction.atomic():
        if role != Membership.Role.ADMIN:
            _keep_an_admin(member)
        member.role = role
        member.save()
    return member


def remove_member(member):
    with transaction.atomic():
        _keep_an_admin(member)
        member.delete()


def _check_role(role):
    if role not in Membership.Role.values:
        raise PeopleError(f"role must be one of {', '.join(Membership.Role.values)}", field="role")


def _keep_an_admin(leaving):
    """Refuse to take away the tenant's last admin (locking the admins, so two such changes racing
    cannot both pass)."""
    if leaving.role != Membership.Role.ADMIN:
        return
    admins = Membership.objects.select_for_update().filter(tenant=leaving.tenant_id, role=Membership.Role.ADMIN)
    if not admins.exclude(pk=leaving.pk).exists():
        raise PeopleError(f"{leaving.user.username} is the last admin of {leaving.tenant.slug}; "
                          "make someone else admin first")


def create_token(user, name):
    """(token, key); the key is shown once and cannot be recovered."""
    name = (name or "").strip()
    if not name or len(name) > TOKEN_NAME_MAX:
        raise PeopleError(f"give the token a name (1-{TOKEN_NAME_MAX} characters)", field="name")
    return ApiToken.issue(user, name)


def revoke_token(token):
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token
