"""REST endpoints for tenancy: the caller's tenant (quota, usage, members), quotas for platform
admins, and the caller's own API tokens."""
from django.core.exceptions import ValidationError
from django.http import Http404
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants import access, people, quotas
from tenants.models import ApiToken, Membership, Quota, Tenant


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
        fields = [*Quota.LIMITS, "period", "budget_mode", "can_borrow"]


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
    """GET the members of the caller's tenant; POST adds an existing user (tenant admins)."""

    def get(self, request):
        membership = access.request_membership(request)
        members = Membership.objects.filter(tenant=membership.tenant).select_related("user").order_by("user__username")
        return Response({"results": [_member_json(m) for m in members]})

    def post(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        try:
            member = people.add_member(membership.tenant, str(request.data.get("username", "")),
                                       request.data.get("role", Membership.Role.RESEARCHER))
        except people.PeopleError as exc:
            return _refused(exc)
        return Response(_member_json(member), status=201)


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

    def delete(self, request, token_id):
        token = ApiToken.objects.filter(pk=token_id, user=request.user).first()
        if token is None:
            raise Http404(f"No token {token_id}.")
        return Response(TokenSerializer(people.revoke_token(token)).data)
