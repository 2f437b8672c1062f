"""Who belongs to a tenant, and a user's API tokens: the rules the REST API and the portal pages
share — nobody joins a tenant without consent (a tenant admin invites, the invited user accepts;
only platform admins and `manage.py tenant adduser` add people directly); inviting never tells
whether a username exists; roles are the three of Membership; a tenant always keeps an admin;
leaving a tenant takes away what was shared in it; a token has a name. Every change here is
audited (tenants.audit) by the models' signals."""
import unicodedata
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tenants import audit
from tenants.models import ApiToken, Invitation, Membership, Tenant

TOKEN_NAME_MAX = 100
# Live tokens (not revoked, not expired) one user may hold: each is a row every request's lookup, the
# token list and the Account page carry, and anyone signed in may make them.
MAX_TOKENS = 100
# Revoked and expired tokens, and expired invitations, stay listed (which one ended, and when) this
# long, then the periodic pass (prune) deletes them; a user keeps at most MAX_ENDED_TOKENS ended
# tokens, however fast they make and revoke them.
ENDED_KEPT = timedelta(days=30)
MAX_ENDED_TOKENS = 100
PRUNED_PER_PASS = 500  # rows of each kind one pass deletes: each is audited, so a pass stays short
USERNAME_MAX = 150


class PeopleError(Exception):
    """A change that is refused, with what to show and the field to blame."""

    def __init__(self, detail, *, field=None, status=400):
        super().__init__(detail)
        self.detail, self.field, self.status = detail, field, status


# --- joining -------------------------------------------------------------------------------------
def invite(tenant, username, role=Membership.Role.RESEARCHER, *, invited_by):
    """Invite `username` to `tenant` (again: the role is updated). The invitation is stored whether
    or not such a user exists, and the caller answers the same either way: an admin of any tenant
    must not learn which accounts exist. It becomes a membership only when the user accepts it."""
    _check_role(role)
    username = _username(username)
    if Membership.objects.filter(tenant=tenant, user__username=username).exists():
        # Already visible in the tenant's member list, so saying so reveals nothing new.
        raise PeopleError(f"{username} is already a member of {tenant.slug}", field="username", status=409)
    invitation, _ = Invitation.objects.update_or_create(
        tenant=tenant, username=username,
        defaults={"role": role, "invited_by": str(invited_by), "created_at": timezone.now()})
    return invitation


def invited_answer(invitation):
    """What the inviting admin is told: the same words for every username."""
    return (f"invited {invitation.username} to {invitation.tenant.slug} as {invitation.role}; they become a member "
            "once they accept the invitation")


def invitations_for(user):
    """The invitations waiting for `user`, oldest first (those not expired)."""
    return (Invitation.objects.filter(_addressed_to(user)).select_related("tenant").order_by("created_at", "pk"))


def _addressed_to(user):
    # Only an invitation sent (or sent again) since the account was made: one sent to a name nobody held
    # would go to whoever took the name first, and a first sign-in through the provider takes the name
    # the provider says (preferred_username), which a person may choose there.
    return Q(username=user.get_username(), created_at__gt=_oldest_valid(), created_at__gte=user.date_joined)


def _oldest_valid(now=None):
    # An invitation names a username only: one left waiting could be taken by whoever holds that
    # name later (an account made again, a first sign-in through the provider).
    return (now or timezone.now()) - timedelta(days=settings.INVITATION_DAYS)


def expires_at(invitation):
    """When the invitation stops being acceptable."""
    return invitation.created_at + timedelta(days=settings.INVITATION_DAYS)


def is_expired(invitation):
    return invitation.created_at <= _oldest_valid()


def waiting_in(tenant):
    """The tenant's invitations that can still be accepted, by username."""
    return Invitation.objects.filter(tenant=tenant, created_at__gt=_oldest_valid()).order_by("username")


def accept(invitation, user):
    """`user` accepts an invitation addressed to them: they join with its role."""
    with transaction.atomic():
        # Read again under its lock: one withdrawn, renewed with another role or expired since it was
        # shown is not what the user may accept now.
        current = Invitation.objects.select_for_update().filter(_addressed_to(user), pk=invitation.pk).first()
        if current is None or not user.is_active:
            raise PeopleError("this invitation is not yours, or it has expired", status=404)
        member, _ = Membership.objects.get_or_create(tenant_id=current.tenant_id, user=user,
                                                     defaults={"role": current.role})
        current.delete()
    return member


def decline(invitation):
    """The invited user says no (or the tenant admin withdraws it)."""
    invitation.delete()


def add_member(tenant, username, role=Membership.Role.RESEARCHER):
    """Add an existing user directly, without their consent: platform admins only (the API, the
    pages and the admin console check who asks; `manage.py tenant adduser` is the operator's)."""
    _check_role(role)
    user = get_user_model().objects.filter(username=username, is_active=True).first()
    if user is None:
        raise PeopleError(f"there is no user {username!r}; a platform admin creates accounts", field="username")
    member, created = Membership.objects.get_or_create(tenant=tenant, user=user, defaults={"role": role})
    if not created:
        raise PeopleError(f"{user.username} is already a member ({member.role})", field="username", status=409)
    return member


def set_default_tenant(user, slug):
    """The tenant `user`'s requests act in when they name none (their own choice, nobody else's)."""
    slug = str(slug or "")
    _refuse_control_characters(slug, "tenant", "a tenant's name")
    with transaction.atomic():
        mine = Membership.objects.select_for_update().filter(user=user)
        chosen = mine.filter(tenant__slug=slug).first()
        if chosen is None:
            raise PeopleError(f"you are not a member of tenant {slug!r}", field="tenant")
        # update(): a preference, not a change of membership (no audit entry, no access re-check).
        mine.filter(is_default=True).exclude(pk=chosen.pk).update(is_default=False)
        mine.filter(pk=chosen.pk).update(is_default=True)
    return chosen


def change_role(member, role):
    _check_role(role)
    with transaction.atomic():
        if role != Membership.Role.ADMIN:
            _keep_an_admin(member)
        member.role = role
        member.save()  # an admin no more takes back their invitations (on_membership_saving)
    return member


def remove_member(member):
    """Take a member out of the tenant; what they were given in it goes too (on_membership_deleted)."""
    with transaction.atomic():
        _keep_an_admin(member)
        member.delete()


def _withdraw_invitations_by(member):
    """An admin who leaves the tenant or the role takes back the invitations they sent that wait:
    one to an account of their own would otherwise bring them back in."""
    Invitation.objects.filter(tenant_id=member.tenant_id, invited_by=member.user.get_username()).delete()


def on_membership_saving(sender, instance, **kwargs):
    """pre_save of Membership: an admin losing the role, however it happens (the API, the pages, the
    admin console, single sign-on following the provider's groups), takes back their invitations."""
    if instance.pk is None or instance.role == Membership.Role.ADMIN:
        return
    if Membership.objects.filter(pk=instance.pk, role=Membership.Role.ADMIN).exists():
        _withdraw_invitations_by(instance)


def on_user_deleted(sender, instance, **kwargs):
    """post_delete of a user: the invitations addressed to their username go (a later account of that
    name is someone else)."""
    Invitation.objects.filter(username=instance.get_username()).delete()


def on_membership_deleted(sender, instance, **kwargs):
    """post_delete of Membership, however it is deleted (API, page, admin console, single sign-on,
    tenant deleted): invitations to the tenant that still wait for the user are gone (they would let
    them back in without a new decision), and so are those an admin sent (_withdraw_invitations_by).
    The shares of the tenant's jobs go too: jobs.sharing listens as well."""
    Invitation.objects.filter(tenant_id=instance.tenant_id, username=instance.user.get_username()).delete()
    if instance.role == Membership.Role.ADMIN:
        _withdraw_invitations_by(instance)


def _username(username):
    username = str(username or "").strip()
    if not username or len(username) > USERNAME_MAX:
        raise PeopleError(f"give a username (1-{USERNAME_MAX} characters)", field="username")
    _refuse_control_characters(username, "username", "a username")
    return username


def _refuse_control_characters(text, field, what):
    # Control characters and lone surrogates: PostgreSQL cannot store a NUL, nor UTF-8 a surrogate.
    if any(unicodedata.category(character) in ("Cc", "Cs") for character in text):
        raise PeopleError(f"{what} may not hold control characters or unpaired surrogates", field=field)


def _check_role(role):
    if role not in Membership.Role.values:
        raise PeopleError(f"role must be one of {', '.join(Membership.Role.values)}", field="role")


def _keep_an_admin(leaving):
    """Refuse to take away the tenant's last admin. Such changes of one tenant take its row's lock
    first, one after the other: two admins demoting each other at once each locked the other's row,
    then waited for their own (a deadlock), or could both have passed."""
    if leaving.role != Membership.Role.ADMIN:
        return
    Tenant.objects.select_for_update(no_key=True).filter(pk=leaving.tenant_id).first()
    admins = Membership.objects.filter(tenant=leaving.tenant_id, role=Membership.Role.ADMIN)
    if not admins.exclude(pk=leaving.pk).exists():
        raise PeopleError(f"{leaving.user.username} is the last admin of {leaving.tenant.slug}; "
                          "make someone else admin first")


def create_token(user, name, *, expires_at=None):
    """(token, key); the key is shown once and cannot be recovered. `expires_at`: when it stops working
    (None: when it is revoked)."""
    name = (name or "").strip()
    if not name or len(name) > TOKEN_NAME_MAX:
        raise PeopleError(f"give the token a name (1-{TOKEN_NAME_MAX} characters)", field="name")
    _refuse_control_characters(name, "name", "the token's name")
    with transaction.atomic():
        # Counted under the user's row lock: requests at the same time cannot each find room for one more.
        get_user_model().objects.select_for_update().filter(pk=user.pk).exists()
        live = ApiToken.objects.filter(user=user, revoked_at=None).exclude(expires_at__lte=timezone.now())
        if live.count() >= MAX_TOKENS:
            raise PeopleError(f"at most {MAX_TOKENS} of your tokens may be live at once; revoke one you no "
                              "longer use", field="name", status=409)
        _trim_ended_tokens(user)
        return ApiToken.issue(user, name, expires_at=expires_at)


def _trim_ended_tokens(user):
    """The user's oldest ended tokens past MAX_ENDED_TOKENS go: making and revoking in a loop piles up nothing."""
    ended = _ended_tokens(timezone.now()).filter(user=user).order_by("-pk").values_list("pk", flat=True)
    with audit.because("retention"):
        _delete_some(ApiToken.objects.filter(pk__in=list(ended[MAX_ENDED_TOKENS:MAX_ENDED_TOKENS + PRUNED_PER_PASS])))


def revoke_token(token):
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


def _ended_tokens(now):
    return ApiToken.objects.filter(Q(revoked_at__isnull=False) | Q(expires_at__lte=now))


def prune(now=None):
    """The periodic pass: delete tokens revoked or expired more than ENDED_KEPT ago and invitations
    expired as long ago, at most PRUNED_PER_PASS of each; returns (tokens, invitations) deleted."""
    now = now or timezone.now()
    before = now - ENDED_KEPT
    tokens = _ended_tokens(now).filter(Q(revoked_at__lt=before) | Q(expires_at__lt=before))
    invitations = Invitation.objects.filter(created_at__lt=_oldest_valid(now) - ENDED_KEPT)
    with audit.acting_as("system"), audit.because("retention"):
        return _delete_some(tokens), _delete_some(invitations)


def _delete_some(rows, limit=PRUNED_PER_PASS):
    """Delete the first `limit` of `rows` (oldest first) through the model's signals (the audit log)."""
    ids = list(rows.order_by("pk").values_list("pk", flat=True)[:limit])
    if ids:
        rows.model.objects.filter(pk__in=ids).delete()
    return len(ids)
