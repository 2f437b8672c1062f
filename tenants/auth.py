"""`Authorization: Token <key>` for scripts and the CLI."""
from datetime import timedelta

from django.utils import timezone
from rest_framework import authentication, exceptions

from tenants import sso, throttling
from tenants.models import ApiToken

# A token's last use is recorded to the minute: writing it at every request was a write and a commit
# (a WAL flush) on every call of every script, a round trip of its own in every submission, waiting
# for a turn on the busy cores under load.
LAST_USED_PRECISION = timedelta(minutes=1)


class ApiTokenAuthentication(authentication.TokenAuthentication):
    keyword = "Token"

    def authenticate(self, request):
        # Guessing keys is throttled per address (tenants.throttling): refused before any is looked up.
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        retry_s = throttling.token_retry_after(request)
        if retry_s:
            raise exceptions.Throttled(wait=retry_s, detail="Too many failed token authentications from your address.")
        try:
            return super().authenticate(request)
        except exceptions.AuthenticationFailed:
            throttling.token_failed(request)
            raise

    def authenticate_credentials(self, key):
        token = ApiToken.authenticate(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        refusal = sso.token_refusal(token)  # a token of someone who signs in through the provider
        if refusal:
            raise exceptions.AuthenticationFailed(refusal)
        now = timezone.now()
        if token.last_used_at is None or now - token.last_used_at >= LAST_USED_PRECISION:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token


def user_for_key(key):
    """The user an API key belongs to, or None (the websockets: they authenticate as the REST API does)."""
    token = ApiToken.authenticate(key) if key else None
    return token.user if token and not sso.token_refusal(token) else None
