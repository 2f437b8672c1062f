"""`Authorization: Token <key>` for scripts and the CLI."""
from django.utils import timezone
from rest_framework import authentication, exceptions

from tenants.models import ApiToken


class ApiTokenAuthentication(authentication.TokenAuthentication):
    keyword = "Token"

    def authenticate_credentials(self, key):
        token = ApiToken.authenticate(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
        return token.user, token


def user_for_key(key):
    """The user an API key belongs to, or None (used by the websocket handshake)."""
    token = ApiToken.authenticate(key) if key else None
    return token.user if token else None
