"""The device authorization grant (RFC 8628) for `trainyard login --sso`, through the server: the CLI
asks for a code here, the person enters it at the identity provider, and the CLI's polling here ends
with a personal API token that expires (tenants.sso). The client secret stays on the server, and the
CLI needs to know nothing about the provider.

Outside the OpenAPI schema, like the learners' ingest endpoint: they are the CLI's own protocol, not part
of the API generated clients use, and without single sign-on configured they exist only as 404s."""
import requests
from drf_spectacular.utils import extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants import sso, throttling


def _unconfigured():
    return Response({"detail": "Single sign-on is not configured on this Trainyard."}, status=404)


class DeviceAuthorization(APIView):
    """POST: a device code for the CLI and the user code the person enters at the identity provider."""

    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(exclude=True)
    def post(self, request):
        if not sso.configured():
            return _unconfigured()
        if refused := throttling.device_flow_refusal(request, throttling.DEVICE_STARTS):
            return refused
        try:
            return Response(sso.start_device_flow())
        except (sso.SsoError, requests.RequestException) as exc:
            return Response({"detail": str(exc)}, status=502)


class DeviceToken(APIView):
    """POST {device_code}: 400 with RFC 8628's `error` (authorization_pending, slow_down, access_denied,
    expired_token) until the person has signed in, then a personal API token that expires."""

    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(exclude=True)
    def post(self, request):
        if not sso.configured():
            return _unconfigured()
        if refused := throttling.device_flow_refusal(request, throttling.DEVICE_POLLS):
            return refused
        device_code = request.data.get("device_code") if isinstance(request.data, dict) else None
        if not device_code:
            return Response({"detail": "device_code: This field is required."}, status=400)
        try:
            issued, error = sso.finish_device_flow(str(device_code))
        except (sso.SsoError, sso.SuspiciousOperation) as exc:
            return Response({"error": "access_denied", "detail": str(exc)}, status=403)
        except requests.RequestException as exc:
            return Response({"detail": f"The identity provider cannot be reached: {exc}"}, status=502)
        if error:
            return Response({"error": error, "detail": f"The identity provider says {error}."}, status=400)
        token, key, user = issued
        return Response({"token": key, "username": user.username, "expires_at": token.expires_at})
