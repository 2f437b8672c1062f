"""REST endpoints for tenancy: the caller's tenant (quota, usage, members), quotas for platform
admins, and the caller's own API tokens."""
from django.core.exceptions import ValidationError
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants import access, people, quotas
from tenants.models import ApiToken, Invitation, Membership, Quota, Tenant


def _forbidden(detail):
    return Response({"detail": detail}, status=status.HTTP_403_FORBIDDEN)


class CurrentTenant(APIView):
    """GET: the tenant the caller acts in, their role, the quota, usage now and this period, what is queued."""

    def get(self, request):
        membership = access.request_membership(request)
        tenant = membership.tenant
        return Response({"tenant": {"slug": tenant.slug, "name": tenant.name}, "role": membership.role,
                         **quotas.summary(tenant, user=request.user)})


class QuotaSerializer(serializers.ModelSerializer):
    class Meta:
        model = Quota
        fields = [*Quota.LIMITS, "period", "budget_mode", "can_borrow", "high_priority", *Quota.INTAKE]


class TenantQuota(APIView):
    """GET the quota of a tenant the caller belongs to; PUT/PATCH it (platform admins only)."""

    def get(self, request, slug):
        try:
            membership = access.membership_for(request.user, slug)
        except access.NoTenant:
            raise Http404(f"No tenant {slug!r}.") from None
        return Response(quotas.summary(membership.tenant)["quota"])

    def patch(self, request, slug):
        if not access.is_platform_admin(request.user):
            if Membership.objects.filter(user=request.user, tenant__slug=slug).exists():
                return _forbidden("only platform admins change quotas")
            raise Http404(f"No tenant {slug!r}.")
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise Http404(f"No tenant {slug!r}.")
        current = quotas.quota_of(tenant)
        data = QuotaSerializer(current, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        try:
            quotas.set_quota(tenant, **data.validated_data)
        except ValidationError as exc:
            return Response({"detail": "; ".join(exc.messages)}, status=400)
        return Response(quotas.summary(tenant)["quota"])

    put = patch


class Members(APIView):
    """GET the members of the caller's tenant. POST: a tenant admin invites a user (202, the same
    answer whether or not the username exists; they join once they accept); a platform admin adds
    an existing user at once (201)."""

    def get(self, request):
        membership = access.request_membership(request)
        members = Membership.objects.filter(tenant=membership.tenant).select_related("user").order_by("user__username")
        return Response({"results": [_member_json(m) for m in members]})

    def post(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        username = str(request.data.get("username", ""))
        role = request.data.get("role", Membership.Role.RESEARCHER)
        try:
            if access.is_platform_admin(request.user):
                return Response(_member_json(people.add_member(membership.tenant, username, role)), status=201)
            invitation = people.invite(membership.tenant, username, role, invited_by=request.user.username)
        except people.PeopleError as exc:
            return _refused(exc)
        # No id, no time: the answer must read the same for every username, existing or not.
        return Response({"detail": people.invited_answer(invitation), "username": invitation.username,
                         "role": invitation.role, "tenant": invitation.tenant.slug}, status=202)


class TenantInvitations(APIView):
    """GET the invitations of the caller's tenant that wait for an answer (tenant admins)."""

    def get(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        waiting = Invitation.objects.filter(tenant=membership.tenant).select_related("tenant").order_by("username")
        return Response({"results": [_invitation_json(i) for i in waiting]})


class TenantInvitation(APIView):
    """DELETE withdraws an invitation of the caller's tenant (tenant admins)."""

    def delete(self, request, invitation_id):
        membership = access.request_membership(request)
        invitation = Invitation.objects.filter(pk=invitation_id, tenant=membership.tenant).first()
        if invitation is None:
            raise Http404(f"No invitation {invitation_id} in tenant {membership.tenant.slug!r}.")
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        people.decline(invitation)
        return Response(status=204)


class MyInvitations(APIView):
    """GET the invitations waiting for the caller (any logged-in user, member of a tenant or not)."""

    def get(self, request):
        return Response({"results": [_invitation_json(i) for i in people.invitations_for(request.user)]})


class MyInvitationAnswer(APIView):
    """POST accept/ (200, the new membership) or decline/ (204) one of the caller's invitations;
    anyone else's invitation is 404."""

    answer = None

    def post(self, request, invitation_id):
        invitation = people.invitations_for(request.user).filter(pk=invitation_id).first()
        if invitation is None:
            raise Http404(f"No invitation {invitation_id} for you.")
        if self.answer == "decline":
            people.decline(invitation)
            return Response(status=204)
        member = people.accept(invitation, request.user)
        return Response({"tenant": {"slug": member.tenant.slug, "name": member.tenant.name}, "role": member.role})


class DefaultTenant(APIView):
    """GET the tenant the caller's requests act in when they name none; PUT {"tenant": slug} chooses it."""

    def get(self, request):
        membership = access.membership_for(request.user)
        return Response(_default_json(request.user, membership))

    def put(self, request):
        try:
            chosen = people.set_default_tenant(request.user, str(request.data.get("tenant") or ""))
        except people.PeopleError as exc:
            return _refused(exc)
        return Response(_default_json(request.user, access.membership_for(request.user, chosen.tenant.slug)))


def _default_json(user, membership):
    mine = Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug")
    return {"tenant": membership.tenant.slug, "chosen": bool(membership.is_default),
            "tenants": [m.tenant.slug for m in mine]}


def _invitation_json(invitation, **extra):
    return {"id": invitation.pk, "tenant": {"slug": invitation.tenant.slug, "name": invitation.tenant.name},
            "username": invitation.username, "role": invitation.role, "invited_by": invitation.invited_by,
            "created_at": invitation.created_at, **extra}


class Member(APIView):
    """PATCH a member's role or DELETE them from the caller's tenant (tenant admins)."""

    def _member(self, request, username):
        membership = access.request_membership(request)
        member = Membership.objects.filter(tenant=membership.tenant, user__username=username).first()
        if member is None:
            raise Http404(f"No member {username!r} in tenant {membership.tenant.slug!r}.")
        return membership, member

    def patch(self, request, username):
        membership, member = self._member(request, username)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        try:
            return Response(_member_json(people.change_role(member, request.data.get("role"))))
        except people.PeopleError as exc:
            return _refused(exc)

    def delete(self, request, username):
        membership, member = self._member(request, username)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        try:
            people.remove_member(member)
        except people.PeopleError as exc:
            return _refused(exc)
        return Response(status=204)


def _refused(exc):
    body = {"detail": exc.detail}
    if exc.field:
        body["field"] = exc.field
    return Response(body, status=exc.status)


def _member_json(m):
    return {"username": m.user.username, "role": m.role, "email": m.user.email}


class TokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at", "revoked_at"]


class Tokens(APIView):
    """GET the caller's API tokens; POST creates one and returns its key, shown this once."""

    def get(self, request):
        tokens = ApiToken.objects.filter(user=request.user).order_by("-created_at")
        return Response({"results": TokenSerializer(tokens, many=True).data})

    def post(self, request):
        try:
            token, key = people.create_token(request.user, str(request.data.get("name") or ""))
        except people.PeopleError as exc:
            return _refused(exc)
        return Response({**TokenSerializer(token).data, "key": key}, status=201)


class Token(APIView):
    """DELETE revokes one of the caller's tokens (another user's token id is 404)."""

    @extend_schema(responses={200: TokenSerializer})
    def delete(self, request, token_id):
        token = ApiToken.objects.filter(pk=token_id, user=request.user).first()
        if token is None:
            raise Http404(f"No token {token_id}.")
        return Response(TokenSerializer(people.revoke_token(token)).data)
