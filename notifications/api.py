"""/api/v1/webhooks/: the caller's hooks (and the tenant's, for its admins); another tenant's hook,
or a hook the caller does not manage, answers 404."""
from django.utils.cache import add_never_cache_headers
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from notifications import services
from notifications.models import Delivery, Webhook
from tenants import access

DELIVERY_LOG = 100


class WebhookSerializer(serializers.ModelSerializer):
    scope = serializers.SerializerMethodField()

    class Meta:
        model = Webhook
        fields = ["id", "url", "events", "format", "scope", "created", "created_by"]

    def get_scope(self, hook) -> str:
        return "tenant" if hook.user_id is None else "user"


class CreatedWebhookSerializer(WebhookSerializer):
    secret = serializers.CharField(help_text="The signing secret, shown this once")

    class Meta(WebhookSerializer.Meta):
        fields = [*WebhookSerializer.Meta.fields, "secret"]


class NewWebhookSerializer(serializers.Serializer):
    url = serializers.CharField(help_text="http:// or https:// URL at a public address")
    events = serializers.ListField(child=serializers.ChoiceField(choices=services.EVENTS), required=False,
                                   help_text="The events to send; empty or absent: all")
    format = serializers.ChoiceField(choices=Webhook.Format.choices, required=False, default="slack")
    scope = serializers.ChoiceField(choices=["user", "tenant"], required=False, default="user",
                                    help_text="tenant: the tenant's hook (its admins only)")


class DeliverySerializer(serializers.ModelSerializer):
    delivery_id = serializers.SerializerMethodField(help_text="As in its X-Trainyard-Delivery header")
    state = serializers.SerializerMethodField()

    class Meta:
        model = Delivery
        # Not the row id: it is platform-wide, and its gaps would count other tenants' events.
        fields = ["delivery_id", "sequence", "job", "event", "created", "done_at", "tries", "response_status",
                  "last_error", "state"]

    def get_delivery_id(self, row) -> str:
        return services.delivery_id(row.pk)

    def get_state(self, row) -> str:
        if row.gave_up:
            return "gave up"
        return "delivered" if row.done_at else ("retrying" if row.tries else "pending")


class WebhookListSerializer(serializers.Serializer):
    results = WebhookSerializer(many=True)


class DeliveryListSerializer(serializers.Serializer):
    results = DeliverySerializer(many=True)


def _refused(exc):
    body = {"detail": exc.detail}
    if exc.field:
        body["field"] = exc.field
    return Response(body, status=exc.status)


class Webhooks(APIView):
    """GET the hooks the caller manages; POST {url, events?, format?, scope?} adds one and returns its
    signing secret, shown this once."""

    @extend_schema(operation_id="v1_webhooks_list", responses={200: WebhookListSerializer})
    def get(self, request):
        hooks = services.hooks_of(access.request_membership(request)).order_by("pk")
        return Response({"results": WebhookSerializer(hooks, many=True).data})

    @extend_schema(request=NewWebhookSerializer, responses={201: CreatedWebhookSerializer})
    def post(self, request):
        membership = access.request_membership(request)
        data = request.data if isinstance(request.data, dict) else {}
        try:
            hook, secret = services.create(membership, url=data.get("url"), events=data.get("events"),
                                           format=str(data.get("format") or "slack"),
                                           scope=str(data.get("scope") or "user"))
        except services.HookError as exc:
            return _refused(exc)
        answer = Response({**WebhookSerializer(hook).data, "secret": secret}, status=201)
        add_never_cache_headers(answer)  # it carries the secret, shown this once: nobody keeps a copy
        return answer


class WebhookDetail(APIView):
    """GET one hook; DELETE removes it (its delivery log goes with it)."""

    @extend_schema(responses={200: WebhookSerializer})
    def get(self, request, hook_id):
        return Response(WebhookSerializer(services.hook_or_404(access.request_membership(request), hook_id)).data)

    @extend_schema(responses={204: None})
    def delete(self, request, hook_id):
        services.remove(services.hook_or_404(access.request_membership(request), hook_id))
        return Response(status=204)


class WebhookDeliveries(APIView):
    """GET the hook's latest deliveries, newest first: event, tries, the receiver's answer, the last error."""

    @extend_schema(responses={200: DeliveryListSerializer})
    def get(self, request, hook_id):
        hook = services.hook_or_404(access.request_membership(request), hook_id)
        rows = Delivery.objects.filter(webhook=hook).order_by("-pk")[:DELIVERY_LOG]
        return Response({"results": DeliverySerializer(rows, many=True).data})
