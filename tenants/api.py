"""REST endpoints for tenancy: the caller's tenant (quota, usage, members), quotas for platform
admins, and the caller's own API tokens."""
from django.core.exceptions import ValidationError
from django.http import Http404
from django.utils.cache import add_never_cache_headers
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants import access, people, quotas
from tenants.models import ApiToken, Invitation, Membership, Tenant
from tenants.serializers import (CurrentTenantSerializer, DefaultTenantRequestSerializer, DefaultTenantSerializer,
                                 InvitationListSerializer, InvitationSerializer, InvitedSerializer, JoinedSerializer,
                                 MemberListSerializer, MemberSerializer, NewMemberSerializer, NewTokenSerializer,
                                 QuotaSerializer, RoleSerializer, TokenListSerializer, TokenRequestSerializer,
                                 TokenSerializer)

# The Error component, which portal.schema gives every operation (tenants does not import jobs, its home).
ERROR = {"$ref": "#/components/schemas/Error"}
# A refusal of tenants.people that is not a 400: a member or invitation that already exists, the last admin.
CONFLICT = OpenApiResponse(ERROR, description="Conflicts with what exists (`detail` says what)")


def _fields(request):
    """The body's fields; a JSON body that is not an object has none, so each is refused by name as missing."""
    return request.data if isinstance(request.data, dict) else {}


def _never_cached(response):
    """An answer carrying a secret shown once: no browser or proxy may keep a copy."""
    add_never_cache_headers(response)
    return response


def _forbidden(detail):
    return Response({"detail": detail}, status=status.HTTP_403_FORBIDDEN)


class CurrentTenant(APIView):
    """GET: the tenant the caller acts in, their role, the quota, usage now and this period, what is queued."""

    @extend_schema(responses={200: CurrentTenantSerializer})
    def get(self, request):
        membership = access.request_membership(request)
        tenant = membership.tenant
        return Response({"tenant": {"slug": tenant.slug, "name": tenant.name}, "role": membership.role,
                         **quotas.summary(tenant, user=request.user)})


# The quota's fields are checked by its serializer, whose refusals name each field with its messages.
QUOTA_REFUSED = OpenApiResponse({"oneOf": [ERROR, {
    "type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}},
    "description": "{field: [what is wrong with it]} for each field refused"}]},
    description="A field is not a quota's, or the quota as a whole is not sane")


class TenantQuota(APIView):
    """GET the quota of a tenant the caller belongs to; PUT/PATCH it (platform admins only)."""

    @extend_schema(responses={200: QuotaSerializer})
    def get(self, request, slug):
        try:
            membership = access.membership_for(request.user, slug)
        except access.NoTenant:
            raise Http404(f"No tenant {slug!r}.") from None
        return Response(quotas.summary(membership.tenant)["quota"])

    @extend_schema(request=QuotaSerializer, responses={200: QuotaSerializer, 400: QUOTA_REFUSED})
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

    @extend_schema(request=QuotaSerializer, responses={200: QuotaSerializer, 400: QUOTA_REFUSED},
                   description="The same as PATCH: the fields given change, the others stay")
    def put(self, request, slug):
        return self.patch(request, slug)


class Members(APIView):
    """GET the members of the caller's tenant. POST: a tenant admin invites a user (202, the same
    answer whether or not the username exists; they join once they accept); a platform admin adds
    an existing user at once (201)."""

    @extend_schema(responses={200: MemberListSerializer})
    def get(self, request):
        membership = access.request_membership(request)
        members = Membership.objects.filter(tenant=membership.tenant).select_related("user").order_by("user__username")
        return Response({"results": MemberSerializer(members, many=True).data})

    @extend_schema(request=NewMemberSerializer, responses={
        201: OpenApiResponse(MemberSerializer, description="a platform admin added the user"),
        202: OpenApiResponse(InvitedSerializer, description="invited; they join once they accept"),
        409: CONFLICT})
    def post(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        fields = _fields(request)
        username, role = str(fields.get("username", "")), fields.get("role", Membership.Role.RESEARCHER)
        try:
            if access.is_platform_admin(request.user):
                return Response(MemberSerializer(people.add_member(membership.tenant, username, role)).data,
                                status=201)
            invitation = people.invite(membership.tenant, username, role, invited_by=request.user.username)
        except people.PeopleError as exc:
            return _refused(exc)
        # No id, no time: the answer must read the same for every username, existing or not.
        return Response({"detail": people.invited_answer(invitation), "username": invitation.username,
                         "role": invitation.role, "tenant": invitation.tenant.slug}, status=202)


class TenantInvitations(APIView):
    """GET the invitations of the caller's tenant (tenant admins): those waiting for an answer and those
    expired unanswered, each with its `state` and `expires_at`."""

    @extend_schema(responses={200: InvitationListSerializer})
    def get(self, request):
        membership = access.request_membership(request)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        sent = Invitation.objects.filter(tenant=membership.tenant).select_related("tenant").order_by("username")
        return Response({"results": InvitationSerializer(sent, many=True).data})


class TenantInvitation(APIView):
    """DELETE withdraws an invitation of the caller's tenant (tenant admins)."""

    @extend_schema(responses={204: None})
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

    @extend_schema(responses={200: InvitationListSerializer})
    def get(self, request):
        return Response({"results": InvitationSerializer(people.invitations_for(request.user), many=True).data})


def _my_invitation(request, invitation_id):
    """One of the caller's invitations; anyone else's is 404."""
    invitation = people.invitations_for(request.user).filter(pk=invitation_id).first()
    if invitation is None:
        raise Http404(f"No invitation {invitation_id} for you.")
    return invitation


class AcceptInvitation(APIView):
    """POST accept/: the caller joins the tenant; 200 with the new membership."""

    @extend_schema(request=None, responses={200: JoinedSerializer})
    def post(self, request, invitation_id):
        try:
            member = people.accept(_my_invitation(request, invitation_id), request.user)
        except people.PeopleError as exc:  # withdrawn or expired since it was found
            return _refused(exc)
        return Response(JoinedSerializer(member).data)


class DeclineInvitation(APIView):
    """POST decline/: the invitation is gone; 204."""

    @extend_schema(request=None, responses={204: None})
    def post(self, request, invitation_id):
        people.decline(_my_invitation(request, invitation_id))
        return Response(status=204)


class DefaultTenant(APIView):
    """GET the tenant the caller's requests act in when they name none; PUT {"tenant": slug} chooses it."""

    @extend_schema(responses={200: DefaultTenantSerializer})
    def get(self, request):
        membership = access.membership_for(request.user)
        return Response(_default_json(request.user, membership))

    @extend_schema(request=DefaultTenantRequestSerializer, responses={200: DefaultTenantSerializer})
    def put(self, request):
        try:
            chosen = people.set_default_tenant(request.user, str(_fields(request).get("tenant") or ""))
        except people.PeopleError as exc:
            return _refused(exc)
        return Response(_default_json(request.user, access.membership_for(request.user, chosen.tenant.slug)))


def _default_json(user, membership):
    mine = Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug")
    return DefaultTenantSerializer({"tenant": membership.tenant.slug, "chosen": bool(membership.is_default),
                                    "tenants": [m.tenant.slug for m in mine]}).data


class Member(APIView):
    """PATCH a member's role or DELETE them from the caller's tenant (tenant admins)."""

    def _member(self, request, username):
        membership = access.request_membership(request)
        member = Membership.objects.filter(tenant=membership.tenant, user__username=username).first()
        if member is None:
            raise Http404(f"No member {username!r} in tenant {membership.tenant.slug!r}.")
        return membership, member

    @extend_schema(request=RoleSerializer, responses={200: MemberSerializer, 409: CONFLICT})
    def patch(self, request, username):
        membership, member = self._member(request, username)
        if not membership.is_admin:
            return _forbidden("only tenant admins manage members")
        try:
            return Response(MemberSerializer(people.change_role(member, _fields(request).get("role"))).data)
        except people.PeopleError as exc:
            return _refused(exc)

    @extend_schema(responses={204: None, 409: CONFLICT})
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


class Tokens(APIView):
    """GET the caller's API tokens; POST creates one and returns its key, shown this once. A token made
    with a token expires when that one does: an expiring token cannot make itself a lasting one."""

    @extend_schema(responses={200: TokenListSerializer})
    def get(self, request):
        tokens = ApiToken.objects.filter(user=request.user).order_by("-created_at")
        return Response({"results": TokenSerializer(tokens, many=True).data})

    @extend_schema(request=TokenRequestSerializer, responses={201: NewTokenSerializer})
    def post(self, request):
        try:
            token, key = people.create_token(request.user, str(_fields(request).get("name") or ""),
                                             expires_at=getattr(request.auth, "expires_at", None))
        except people.PeopleError as exc:
            return _refused(exc)
        token.key = key  # the one answer that carries it
        return _never_cached(Response(NewTokenSerializer(token).data, status=201))


class Token(APIView):
    """DELETE revokes one of the caller's tokens (another user's token id is 404)."""

    @extend_schema(responses={200: TokenSerializer})
    def delete(self, request, token_id):
        token = ApiToken.objects.filter(pk=token_id, user=request.user).first()
        if token is None:
            raise Http404(f"No token {token_id}.")
        return Response(TokenSerializer(people.revoke_token(token)).data)
