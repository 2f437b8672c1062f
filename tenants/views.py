"""Portal pages for tenancy: a tenant's members and invitations (managed by its admins) and a user's
account (API tokens, the invitations waiting for them, their default tenant).

Plain forms posting back to the page; every change goes through the same rules as the API
(tenants.people), and so into the audit log the same way."""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from tenants import access, people
from tenants.models import ApiToken, Invitation, Membership


@login_required
def members_page(request):
    try:
        membership = access.request_membership(request)
    except access.NoTenant as exc:
        named = access.requested_tenant(request)
        return render(request, "no_tenant.html", {"reason": str(exc), "named": named}, status=403 if named else 200)
    if request.method == "POST":
        if not membership.is_admin:
            messages.error(request, "Only tenant admins manage members.")
        else:
            _change_members(request, membership.tenant)
        return redirect(request.get_full_path())
    members = Membership.objects.filter(tenant=membership.tenant).select_related("user").order_by("user__username")
    invitations = people.waiting_in(membership.tenant) if membership.is_admin else Invitation.objects.none()
    return render(request, "tenants/members.html", {
        "membership": membership, "members": members, "roles": Membership.Role.choices, "invitations": invitations,
        "adds_directly": access.is_platform_admin(request.user)})


def _change_members(request, tenant):
    action, username = request.POST.get("action"), request.POST.get("username", "").strip()
    role = request.POST.get("role", Membership.Role.RESEARCHER)
    try:
        if action == "add" and access.is_platform_admin(request.user):
            people.add_member(tenant, username, role)
            messages.success(request, f"Added {username} as {role}.")
            return
        if action == "add":
            invitation = people.invite(tenant, username, role, invited_by=request.user.username)
            messages.success(request, _sentence(people.invited_answer(invitation)))
            return
        if action == "withdraw":
            Invitation.objects.filter(tenant=tenant, pk=_number(request.POST.get("invitation"))).delete()
            messages.success(request, "Invitation withdrawn.")
            return
        member = Membership.objects.select_related("user", "tenant").filter(
            tenant=tenant, user__username=username).first()
        if member is None:
            messages.error(request, f"{username!r} is not a member of {tenant.slug}.")
        elif action == "remove":
            people.remove_member(member)
            messages.success(request, f"Removed {username}.")
        elif action == "role":
            people.change_role(member, role)
            messages.success(request, f"{username} is now {role}.")
    except people.PeopleError as exc:
        _refused(request, exc)


def _refused(request, exc):
    messages.error(request, _sentence(exc.detail))


def _sentence(text):
    return text[:1].upper() + text[1:] + "."


def _number(value):
    """A form's id field as a number; anything else matches no row (0). ASCII digits only: str.isdigit()
    also takes characters such as "²", which int() refuses; and no more than a database id holds."""
    value = str(value or "")
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else 0


@never_cache  # it shows a new token's key once: no browser or proxy may keep a copy
@login_required
def tokens_page(request):
    """The user's account page: their API tokens, the invitations waiting for them, their default tenant."""
    new_key = None
    if request.method == "POST":
        if request.POST.get("action") in ("accept", "decline", "default"):
            _answer(request)
        elif request.POST.get("action") == "create":
            try:
                _, new_key = people.create_token(request.user, request.POST.get("name", ""))
            except people.PeopleError as exc:
                _refused(request, exc)
        elif request.POST.get("action") == "revoke":
            token = ApiToken.objects.filter(pk=_number(request.POST.get("token")), user=request.user,
                                            revoked_at__isnull=True).first()
            if token is not None:
                people.revoke_token(token)
                messages.success(request, f"Revoked {token.name}.")
        if new_key is None:
            return redirect(request.path)
    try:
        membership = access.request_membership(request)
    except access.NoTenant:
        membership = None
    tokens = ApiToken.objects.filter(user=request.user).order_by("-created_at")
    mine = Membership.objects.filter(user=request.user).select_related("tenant").order_by("tenant__slug")
    return render(request, "tenants/tokens.html", {
        "membership": membership, "tokens": tokens, "new_key": new_key, "memberships": mine,
        "invitations": people.invitations_for(request.user),
        "default_tenant": access.membership_for(request.user).tenant.slug if mine else None})


def _answer(request):
    """Accept or decline one of the user's invitations, or choose their default tenant."""
    action = request.POST.get("action")
    try:
        if action == "default":
            chosen = people.set_default_tenant(request.user, request.POST.get("tenant", ""))
            messages.success(request, f"Requests that name no tenant now act in {chosen.tenant.slug}.")
            return
        invitation = people.invitations_for(request.user).filter(pk=_number(request.POST.get("invitation"))).first()
        if invitation is None:
            messages.error(request, "That invitation is no longer waiting for you.")
        elif action == "accept":
            member = people.accept(invitation, request.user)
            messages.success(request, f"You joined {member.tenant.slug} as {member.role}.")
        else:
            people.decline(invitation)
            messages.success(request, f"Declined the invitation to {invitation.tenant.slug}.")
    except people.PeopleError as exc:
        _refused(request, exc)
