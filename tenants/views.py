"""Portal pages for tenancy: a tenant's members (managed by its admins) and a user's API tokens.

Plain forms posting back to the page; every change goes through the same rules as the API
(tenants.people), and so into the audit log the same way."""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render

from tenants import access, people
from tenants.models import ApiToken, Membership


@login_required
def members_page(request):
    try:
        membership = access.request_membership(request)
    except access.NoTenant as exc:
        return render(request, "no_tenant.html", {"reason": str(exc)}, status=403)
    if request.method == "POST":
        if not membership.is_admin:
            messages.error(request, "Only tenant admins manage members.")
        else:
            _change_members(request, membership.tenant)
        return redirect(request.get_full_path())
    members = Membership.objects.filter(tenant=membership.tenant).select_related("user").order_by("user__username")
    return render(request, "tenants/members.html", {"membership": membership, "members": members,
                                                    "roles": Membership.Role.choices})


def _change_members(request, tenant):
    action, username = request.POST.get("action"), request.POST.get("username", "").strip()
    role = request.POST.get("role", Membership.Role.RESEARCHER)
    try:
        if action == "add":
            people.add_member(tenant, username, role)
            messages.success(request, f"Added {username} as {role}.")
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
    messages.error(request, exc.detail[:1].upper() + exc.detail[1:] + ".")


@login_required
def tokens_page(request):
    new_key = None
    if request.method == "POST":
        if request.POST.get("action") == "create":
            try:
                _, new_key = people.create_token(request.user, request.POST.get("name", ""))
            except people.PeopleError as exc:
                _refused(request, exc)
        elif request.POST.get("action") == "revoke":
            token = ApiToken.objects.filter(pk=request.POST.get("token"), user=request.user,
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
    return render(request, "tenants/tokens.html", {"membership": membership, "tokens": tokens, "new_key": new_key})
