"""How tenants, members, invitations, quotas and tokens look in JSON, and what the OpenAPI schema says
of the tenant summary (tenants.quotas.summary builds it as a dict: the pages read it too)."""
from datetime import datetime

from rest_framework import serializers

from tenants import people
from tenants.models import ApiToken, Invitation, Membership, Quota, Tenant


class TenantRefSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tenant
        fields = ["slug", "name"]


class MemberSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username")
    email = serializers.CharField(source="user.email", allow_blank=True)

    class Meta:
        model = Membership
        fields = ["username", "role", "email"]


class MemberListSerializer(serializers.Serializer):
    results = MemberSerializer(many=True)


class JoinedSerializer(serializers.ModelSerializer):
    """The membership an accepted invitation made."""
    tenant = TenantRefSerializer()

    class Meta:
        model = Membership
        fields = ["tenant", "role"]


class NewMemberSerializer(serializers.Serializer):
    username = serializers.CharField()
    role = serializers.ChoiceField(choices=Membership.Role.choices, required=False, default=Membership.Role.RESEARCHER)


class RoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Membership.Role.choices)


class InvitedSerializer(serializers.Serializer):
    """What a tenant admin is told on inviting: the same for every username, existing or not (no id, no time)."""
    detail = serializers.CharField()
    username = serializers.CharField()
    role = serializers.ChoiceField(choices=Membership.Role.choices)
    tenant = serializers.CharField(help_text="the tenant's slug")


class InvitationSerializer(serializers.ModelSerializer):
    tenant = TenantRefSerializer()
    expires_at = serializers.SerializerMethodField(help_text="when it can no longer be accepted")
    state = serializers.SerializerMethodField(help_text="waiting (it can be accepted) or expired")

    class Meta:
        model = Invitation
        fields = ["id", "tenant", "username", "role", "invited_by", "created_at", "expires_at", "state"]

    def get_expires_at(self, invitation) -> datetime:
        return serializers.DateTimeField().to_representation(people.expires_at(invitation))

    def get_state(self, invitation) -> str:
        return "expired" if people.is_expired(invitation) else "waiting"


class InvitationListSerializer(serializers.Serializer):
    results = InvitationSerializer(many=True)


class DefaultTenantSerializer(serializers.Serializer):
    tenant = serializers.CharField(help_text="the slug of the tenant requests act in when they name none")
    chosen = serializers.BooleanField(help_text="the user chose it (else: the tenant they joined first)")
    tenants = serializers.ListField(child=serializers.CharField(), help_text="the slugs of all the user's tenants")


class DefaultTenantRequestSerializer(serializers.Serializer):
    tenant = serializers.CharField(help_text="a slug of one of the caller's tenants")


class QuotaSerializer(serializers.ModelSerializer):
    class Meta:
        model = Quota
        fields = list(Quota.SETTINGS)


class TokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at", "revoked_at", "expires_at"]


class NewTokenSerializer(TokenSerializer):
    key = serializers.CharField(help_text="the token itself, shown this once")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "key"]


class TokenListSerializer(serializers.Serializer):
    results = TokenSerializer(many=True)


class TokenRequestSerializer(serializers.Serializer):
    name = serializers.CharField()


# --- tenants.quotas.summary() ---------------------------------------------------------------------
class UsageSerializer(serializers.Serializer):
    gpus = serializers.IntegerField(help_text="held now")
    cpus = serializers.FloatField(help_text="held now")
    memory_bytes = serializers.IntegerField(help_text="held now")
    jobs = serializers.IntegerField(help_text="running now")
    gpu_hours = serializers.FloatField(help_text="this period")
    cpu_hours = serializers.FloatField(help_text="this period")
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    storage_bytes = serializers.IntegerField(help_text="stored results, checkpoints, logs and code archives")
    my_gpus = serializers.IntegerField(help_text="GPUs the caller's own jobs hold now")


class StateSerializer(serializers.Serializer):
    state = serializers.CharField(help_text="budget: ok, hard_exceeded or soft_exceeded; storage: ok or full")
    reason = serializers.CharField(allow_blank=True)


class QueuedSerializer(serializers.Serializer):
    jobs = serializers.IntegerField()
    gpus = serializers.IntegerField()


class IntakeSerializer(serializers.Serializer):
    queued_jobs = serializers.IntegerField(help_text="jobs the tenant may have queued at once")
    submissions_per_minute = serializers.IntegerField()
    overridden = serializers.ListField(child=serializers.CharField(),
                                       help_text="the limits its quota sets; the others are the platform's defaults")


class PeriodSerializer(serializers.Serializer):
    period_start = serializers.DateTimeField()
    gpu_hours = serializers.FloatField()
    cpu_hours = serializers.FloatField()


class CurrentTenantSerializer(serializers.Serializer):
    tenant = TenantRefSerializer()
    role = serializers.ChoiceField(choices=Membership.Role.choices)
    quota = QuotaSerializer()
    usage = UsageSerializer()
    budget = StateSerializer()
    storage = StateSerializer()
    queued = QueuedSerializer()
    intake = IntakeSerializer()
    history = PeriodSerializer(many=True, help_text="GPU- and CPU-hours per period, newest first")
