"""Single sign-on: the organisation's OpenID provider signs people in, and its groups decide their
tenants and roles.

Built on mozilla-django-oidc rather than django-allauth. It does one thing, the authorization code flow
as a Django authentication backend with PKCE, state and nonce, and leaves accounts to us; allauth would
bring its own account and e-mail models, sign-up pages and dozens of providers Trainyard has no use for,
beside the accounts, invitations and tokens it already has. What the library leaves out is added here:
the ID token's issuer, audience, expiry and issue time are checked (it checks the signature, the nonce
and the expiry only), so is the authorization response's `iss` (RFC 9207); people are known by
(issuer, sub), never by an e-mail address or a username the provider may let them change; groups come
only from the provider's answers (the userinfo endpoint, reached with the access token from our own
token request, or the verified ID token), never from anything the browser carries.

Membership follows the provider: at every sign-in, and for live sessions every
TRAINYARD_OIDC_RECHECK_INTERVAL seconds (SsoRecheckMiddleware asks the userinfo endpoint again,
refreshing the access token when it has expired). Only tenants that some mapping names follow the
provider; a membership in any other tenant (an invitation accepted) is left alone. Someone no longer in
a mapped group loses that tenant, and the audit log entry says so (tenants.audit.because).

Scripts and the CLI: `trainyard login --sso` runs the device authorization grant (RFC 8628) through
the two endpoints at the bottom (the client secret never leaves the server) and receives a personal API
token that expires after TRAINYARD_OIDC_TOKEN_LIFETIME seconds.
"""
import contextlib
import logging
import time
from datetime import timedelta

import jwt
import requests
from django.conf import settings
from django.contrib import auth
from django.contrib.auth import get_user_model
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured, SuspiciousOperation
from django.db import transaction
from django.http import Http404, HttpResponseForbidden
from django.shortcuts import render
from django.utils import timezone
from django.utils.text import slugify
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from tenants import audit, throttling
from tenants.models import ApiToken, GroupMapping, Membership, SsoIdentity, Tenant

log = logging.getLogger(__name__)

LEEWAY_S = 30  # clock skew allowed between the provider and us when checking exp, iat and nbf
RANK = {Membership.Role.VIEWER: 0, Membership.Role.RESEARCHER: 1, Membership.Role.ADMIN: 2}
ACCESS_TOKEN, REFRESH_TOKEN, CHECKED_AT = "sso_access_token", "sso_refresh_token", "sso_checked_at"
ACCESS_EXPIRES = "sso_access_expires"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
PERSONAL_TOKEN_NAME = "trainyard login --sso"


class SsoError(Exception):
    """The provider's answer cannot be trusted or used; the message says why (shown to the person)."""


def configured():
    return bool(settings.OIDC_ISSUER and settings.OIDC_CLIENT_ID)


# --- the provider ------------------------------------------------------------------------------------
_discovery = {}


def provider():
    """The configured issuer's discovery document, fetched once per process."""
    issuer = settings.OIDC_ISSUER
    document = _discovery.get(issuer)
    if document is None:
        response = requests.get(issuer.rstrip("/") + "/.well-known/openid-configuration",
                                timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
        if document.get("issuer") != issuer:  # OpenID Connect Discovery §4.3
            raise ImproperlyConfigured(f"{issuer} calls itself {document.get('issuer')!r}: "
                                       "TRAINYARD_OIDC_ISSUER must be the issuer exactly")
        _discovery[issuer] = document
    return document


def client_auth():
    return requests.auth.HTTPBasicAuth(settings.OIDC_CLIENT_ID, settings.OIDC_CLIENT_SECRET)


# --- groups to tenants and roles -----------------------------------------------------------------------
def parse_group_map(text):
    """TRAINYARD_OIDC_GROUP_MAP: `group=tenant:role` entries separated by commas or whitespace (role
    researcher when left out); a list of (group, tenant slug, role)."""
    entries = []
    for item in text.replace(",", " ").split():
        group, equals, target = item.rpartition("=")
        slug, _, role = target.partition(":")
        role = role or Membership.Role.RESEARCHER
        if not equals or not group or not slug or role not in RANK:
            raise ImproperlyConfigured(f"TRAINYARD_OIDC_GROUP_MAP: {item!r} is not group=tenant[:role] "
                                       f"with a role of {', '.join(RANK)}")
        entries.append((group, slug, role))
    return entries


def mappings():
    """Every (group, tenant slug, role): the environment's, then the admin console's."""
    return [*parse_group_map(settings.OIDC_GROUP_MAP),
            *GroupMapping.objects.values_list("group", "tenant__slug", "role")]


def groups_of(claims):
    groups = claims.get(settings.OIDC_GROUPS_CLAIM) or []
    if isinstance(groups, str):
        groups = [groups]
    return {str(group) for group in groups}


def roles_for(groups, entries):
    """{tenant slug: (role, group)}: the highest role any of `groups` maps each tenant to."""
    wanted = {}
    for group, slug, role in entries:
        if group in groups and (slug not in wanted or RANK[role] > RANK[wanted[slug][0]]):
            wanted[slug] = (role, group)
    return wanted


def sync_memberships(user, groups, *, why_removed=None):
    """Make `user`'s memberships in the mapped tenants what `groups` say; the rest are left alone.
    `why_removed`: what the audit log says of a membership that ends (default: the groups it lost)."""
    entries = mappings()
    mapped = {slug for _, slug, _ in entries}
    wanted = roles_for(groups, entries)
    tenants = {tenant.slug: tenant for tenant in Tenant.objects.filter(slug__in=mapped)}
    for slug in set(wanted) - set(tenants):
        log.warning("single sign-on maps a group to tenant %r, which does not exist", slug)
    with transaction.atomic(), audit.acting_as(f"sso:{settings.OIDC_ISSUER}"):
        held = {m.tenant.slug: m
                for m in user.memberships.select_related("tenant", "user").filter(tenant__slug__in=mapped)}
        for slug, membership in held.items():
            if slug not in wanted:
                groups_named = sorted(group for group, mapped_slug, _ in entries if mapped_slug == slug)
                with audit.because(why_removed or f"the identity provider no longer has {user.username} in "
                                                  f"{' or '.join(groups_named)}"):
                    membership.delete()
            elif membership.role != wanted[slug][0]:
                membership.role = wanted[slug][0]
                with audit.because(f"{user.username}'s role from group {wanted[slug][1]} at the identity provider"):
                    membership.save()
        for slug, (role, group) in wanted.items():
            if slug not in held and slug in tenants:
                with audit.because(f"{user.username} is in group {group} at the identity provider"):
                    Membership.objects.create(tenant=tenants[slug], user=user, role=role)


# --- people ----------------------------------------------------------------------------------------------
def _free_username(claims):
    User = get_user_model()
    base = (claims.get("preferred_username") or (claims.get("email") or "").partition("@")[0]
            or claims["sub"])[:140]
    base = slugify(base) or "user"
    name, n = base, 1
    while name in audit.PLATFORM_ACTORS or User.objects.filter(username=name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def person(claims):
    """The user the provider's subject signs in as, created on first sign-in. A local account with the
    same username is never taken over: the new one gets a free name beside it."""
    issuer, subject = settings.OIDC_ISSUER, str(claims["sub"])
    identity = SsoIdentity.objects.select_related("user").filter(issuer=issuer, subject=subject).first()
    if identity is None:
        user = get_user_model().objects.create_user(_free_username(claims), email=claims.get("email") or "")
        user.set_unusable_password()
        user.first_name = (claims.get("given_name") or claims.get("name") or "")[:150]
        user.save()
        identity = SsoIdentity.objects.create(user=user, issuer=issuer, subject=subject)
    elif claims.get("email") and identity.user.email != claims["email"]:
        identity.user.email = claims["email"]
        identity.user.save(update_fields=["email"])
    SsoIdentity.objects.filter(pk=identity.pk).update(checked_at=timezone.now())
    return identity.user


def sign_in(claims):
    """The active user for verified `claims`, their memberships brought in line with its groups."""
    user = person(claims)
    if not user.is_active:
        return None
    sync_memberships(user, groups_of(claims))
    return user


# --- verifying what the provider says -------------------------------------------------------------------
class SsoBackend(OIDCAuthenticationBackend):
    """mozilla-django-oidc's backend with endpoints from discovery and a stricter ID token check."""

    OIDC_RP_IDP_SIGN_KEY = None

    def __init__(self, *args, **kwargs):  # the library reads every endpoint from settings here; we discover them
        self.UserModel = get_user_model()
        self.token_info = {}

    OIDC_RP_SIGN_ALGO = property(lambda self: settings.OIDC_SIGN_ALGO)
    OIDC_RP_CLIENT_ID = property(lambda self: settings.OIDC_CLIENT_ID)
    OIDC_RP_CLIENT_SECRET = property(lambda self: settings.OIDC_CLIENT_SECRET)
    OIDC_OP_TOKEN_ENDPOINT = property(lambda self: provider()["token_endpoint"])
    OIDC_OP_USER_ENDPOINT = property(lambda self: provider()["userinfo_endpoint"])
    OIDC_OP_JWKS_ENDPOINT = property(lambda self: provider()["jwks_uri"])

    def authenticate(self, request, **kwargs):
        # Only for the callback (SsoCallbackView), which passes exactly these: a password login whose URL
        # happens to carry code= and state= is not a sign-in through the provider.
        if not configured() or set(kwargs) != {"nonce", "code_verifier"}:
            return None
        return super().authenticate(request, **kwargs)

    def get_user(self, user_id):
        """The session's user, unless disabled since (the library's would keep them signed in)."""
        user = super().get_user(user_id)
        return user if user is not None and self.user_can_authenticate(user) else None

    def verify_token(self, token, **kwargs):
        if not token:
            raise SuspiciousOperation("the provider sent no ID token")
        try:
            algorithm = jwt.get_unverified_header(token).get("alg")
            if algorithm != self.OIDC_RP_SIGN_ALGO:  # before any key is looked up for it
                raise SuspiciousOperation(f"ID token refused: signed with {algorithm!r}, not {self.OIDC_RP_SIGN_ALGO}")
            return super().verify_token(token, **kwargs)
        except (jwt.PyJWTError, KeyError, ValueError) as exc:  # no kid, a malformed token, a key of the wrong kind
            raise SuspiciousOperation(f"ID token refused: {exc}") from None

    def get_payload_data(self, token, key):
        """The ID token's claims, its signature checked with the configured algorithm only (so never
        `none`, whatever OIDC_ALLOW_UNSECURED_JWT says, nor a public key used as an HMAC secret), then who
        issued it, for whom, and when. Called by verify_token, which refused any other algorithm already
        (naming it) and turns a PyJWTError into "ID token refused"."""
        claims = jwt.decode(token, key, algorithms=[self.OIDC_RP_SIGN_ALGO], audience=settings.OIDC_CLIENT_ID,
                            issuer=settings.OIDC_ISSUER, leeway=LEEWAY_S,
                            options={"require": ["iss", "aud", "exp", "iat", "sub"]})
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if len(audiences) > 1 and claims.get("azp") != settings.OIDC_CLIENT_ID:  # OpenID Connect Core §3.1.3.7
            raise SuspiciousOperation("ID token refused: issued to another party as well (azp)")
        return claims

    def get_token(self, payload):
        self.token_info = super().get_token(payload)
        return self.token_info

    def store_tokens(self, access_token, id_token):
        session = self.request.session
        session[ACCESS_TOKEN] = access_token
        session[REFRESH_TOKEN] = self.token_info.get("refresh_token")
        session[ACCESS_EXPIRES] = expiry(self.token_info)
        session[CHECKED_AT] = time.time()

    def get_or_create_user(self, access_token, id_token, payload):
        return sign_in(verified_claims(self, access_token, payload))


def verified_claims(backend, access_token, id_claims):
    """The ID token's verified claims with the userinfo endpoint's answer over them. Userinfo is about
    the person the ID token names, or nobody (OpenID Connect Core §5.3.2)."""
    try:
        userinfo = backend.get_userinfo(access_token, None, id_claims)
    except requests.RequestException as exc:
        raise SsoError(f"the provider's userinfo endpoint failed: {exc}") from None
    if str(userinfo.get("sub")) != str(id_claims["sub"]):
        raise SsoError("userinfo is about someone other than the ID token's subject")
    return {**id_claims, **userinfo}


# --- the portal's sign-in ----------------------------------------------------------------------------------
class SsoLoginView(OIDCAuthenticationRequestView):
    """Sends the browser to the provider with state, nonce and a PKCE challenge (kept in the session)."""

    def __init__(self, *args, **kwargs):
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)

    OIDC_RP_CLIENT_ID = property(lambda self: settings.OIDC_CLIENT_ID)
    OIDC_OP_AUTH_ENDPOINT = property(lambda self: provider()["authorization_endpoint"])

    def get(self, request):
        if not configured():
            raise Http404("single sign-on is not configured")
        return super().get(request)


class SsoCallbackView(OIDCAuthenticationCallbackView):
    """Where the provider sends the browser back. The library checks the state (used once: a replayed
    callback finds it gone) and hands the nonce and the PKCE verifier to the backend; a refusal is a
    page saying why, not a server error."""

    def get(self, request):
        if not configured():
            raise Http404("single sign-on is not configured")
        issuer = request.GET.get("iss")
        try:
            if issuer is not None and issuer != settings.OIDC_ISSUER:  # RFC 9207: a mix-up attack
                raise SuspiciousOperation(f"the answer comes from {issuer}, which is not the configured provider")
            if "code" in request.GET and request.GET.get("state") not in request.session.get("oidc_states", {}):
                raise SuspiciousOperation("this sign-in was not started here, or has been used already (state)")
            response = super().get(request)
        except (SsoError, SuspiciousOperation, requests.RequestException) as exc:
            log.warning("single sign-on refused: %s", exc)
            return sso_refused(request, str(exc))
        if not request.user.is_authenticated:
            return sso_refused(request, request.GET.get("error_description") or "the provider did not sign you in")
        return response


def sso_refused(request, reason):
    return render(request, "login.html", {"sso_error": reason, "form": None, **login_choices()}, status=403)


def lockout_response(request, original_response=None, credentials=None):
    """A locked-out password sign-in (django-axes, tenants.throttling): the login page again, saying
    why, with 429 and Retry-After (the lockout's length)."""
    retry_s = int(settings.AXES_COOLOFF_TIME.total_seconds())
    form = AuthenticationForm(request, initial={"username": throttling.login_username(request, credentials) or ""})
    response = render(request, "login.html", {"form": form, "lockout": throttling.lockout_message(retry_s),
                                              **login_choices()}, status=429)
    response["Retry-After"] = str(retry_s)
    return response


def login_choices():
    return {"sso_enabled": configured(), "local_login": settings.LOCAL_LOGIN}


class PortalLoginView(auth_views.LoginView):
    """The login page: the organisation's sign-in when configured, the password form unless switched off."""

    def get_context_data(self, **kwargs):
        return {**super().get_context_data(**kwargs), **login_choices()}

    def post(self, request, *args, **kwargs):
        if not settings.LOCAL_LOGIN:
            return HttpResponseForbidden("Local sign-in is switched off: sign in with your organisation.")
        return super().post(request, *args, **kwargs)


class SsoRecheckMiddleware:
    """Asks the provider again about a signed-in person every TRAINYARD_OIDC_RECHECK_INTERVAL seconds
    and brings their memberships in line (session_vouched_for); a session the provider no longer
    vouches for ends, and so does one the provider cannot be reached for: a session that cannot be
    checked is not kept."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        session = getattr(request, "session", None)
        if session is not None and not session_vouched_for(session, request.user):
            auth.logout(request)
        return self.get_response(request)


def session_vouched_for(session, user):
    """Whether the signed-in session of `user` may go on (pages, the API, websockets). A session of
    single sign-on is asked about again once TRAINYARD_OIDC_RECHECK_INTERVAL has passed since its last
    check (recheck); when the provider refuses, the person's memberships in mapped tenants end too
    (disowned), so none of their API tokens reaches those tenants either. The caller ends a session
    this says no to; other sessions are never asked about."""
    if (ACCESS_TOKEN not in session or not user.is_authenticated
            or time.time() - session.get(CHECKED_AT, 0) < settings.OIDC_RECHECK_S):
        return True
    with _rechecking(session) as mine:
        if not mine:
            return True  # another request with the same sign-in is asking the provider
        _take_newer_check(session)
        if time.time() - session.get(CHECKED_AT, 0) < settings.OIDC_RECHECK_S:
            return True  # a request that read the session before this one asked meanwhile
        return _rechecked(session, user)


SESSION_CHECKS = (ACCESS_TOKEN, REFRESH_TOKEN, ACCESS_EXPIRES, CHECKED_AT)


@contextlib.contextmanager
def _rechecking(session):
    """Whether this request asks the provider about the session: one at a time per session (the pages'
    requests come in parallel), since each would refresh with the same refresh token, which a provider
    that rotates them takes for a stolen one and answers by revoking the person's grant."""
    key = f"sso-recheck:{session.session_key}"
    mine = cache.add(key, 1, timeout=3 * settings.OIDC_TIMEOUT + 5)  # a killed process's mark runs out
    try:
        yield mine
    finally:
        if mine:
            cache.delete(key)


def _take_newer_check(session):
    """What another request of the session stored since this one read it (fresher tokens, a later check)."""
    stored = session.__class__(session_key=session.session_key)
    if stored.get(CHECKED_AT, 0) > session.get(CHECKED_AT, 0):
        for name in SESSION_CHECKS:
            session[name] = stored.get(name)


def _rechecked(session, user):
    try:
        recheck(session, user)
        session.save()  # before the next request may ask: it reads what this one learnt
        return True
    except requests.RequestException as exc:
        log.info("single sign-on session of %s ended: the provider cannot be asked (%s)", user.username, exc)
    except (SsoError, SuspiciousOperation) as exc:
        log.info("single sign-on session of %s ended: %s", user.username, exc)
        disowned(user, f"the identity provider no longer vouches for {user.username} ({exc})")
    return False


def recheck(session, user):
    response = _userinfo(session[ACCESS_TOKEN])
    if response.status_code == 401 and session.get(REFRESH_TOKEN):
        tokens = refreshed(session[REFRESH_TOKEN])
        # A provider that does not rotate refresh tokens leaves the one it gave standing (RFC 6749 §6).
        session[ACCESS_TOKEN] = tokens["access_token"]
        session[REFRESH_TOKEN] = tokens.get("refresh_token") or session[REFRESH_TOKEN]
        session[ACCESS_EXPIRES] = expiry(tokens)
        response = _userinfo(session[ACCESS_TOKEN])
    elif response.status_code == 401 and time.time() >= (session.get(ACCESS_EXPIRES) or float("inf")):
        # Our own access token ran out and nothing renews it: the provider was not asked, and has not
        # refused the person, so the session ends with their memberships left as they are.
        raise requests.RequestException("the session's access token expired and the provider gave no refresh token")
    claims = _vouching_claims(response)
    identity = SsoIdentity.objects.filter(user=user, issuer=settings.OIDC_ISSUER).first()
    if identity is None or str(claims.get("sub")) != identity.subject:
        raise SsoError("userinfo is about someone else")
    if sign_in(claims) is None:
        raise SsoError("the account is disabled")
    session[CHECKED_AT] = time.time()


def expiry(tokens):
    """When the access token of a token response expires (time.time()), or None when it does not say."""
    try:
        return time.time() + float(tokens["expires_in"])
    except (KeyError, TypeError, ValueError):
        return None


def _vouching_claims(response):
    """The userinfo endpoint's claims; a server error is the provider out of reach (asked again
    later), any other refusal is the provider's answer."""
    if response.status_code >= 500:
        raise requests.RequestException(f"the provider's userinfo endpoint answered {response.status_code}")
    if response.status_code != 200:
        raise SsoError(f"the provider's userinfo endpoint answered {response.status_code}")
    return response.json()


def _userinfo(access_token):
    return requests.get(provider()["userinfo_endpoint"], headers={"Authorization": f"Bearer {access_token}"},
                        timeout=settings.OIDC_TIMEOUT)


def refreshed(refresh_token):
    response = requests.post(provider()["token_endpoint"], auth=client_auth(), timeout=settings.OIDC_TIMEOUT,
                             data={"grant_type": "refresh_token", "refresh_token": refresh_token})
    if response.status_code >= 500:
        raise requests.RequestException(f"the provider could not refresh the session ({response.status_code})")
    if response.status_code != 200:
        raise SsoError(f"the provider refused to refresh the session ({response.status_code})")
    return response.json()


# --- the device flow for the CLI (RFC 8628) ----------------------------------------------------------------
def start_device_flow():
    """The provider's device authorization response: the code to show and where to enter it."""
    endpoint = provider().get("device_authorization_endpoint")
    if not endpoint:
        raise SsoError("the identity provider does not offer the device authorization grant")
    response = requests.post(endpoint, auth=client_auth(), timeout=settings.OIDC_TIMEOUT,
                             data={"client_id": settings.OIDC_CLIENT_ID, "scope": settings.OIDC_SCOPES})
    if response.status_code != 200:
        raise SsoError(f"the identity provider refused the device authorization ({response.status_code}): "
                       f"{response.text[:200]}")
    answer = response.json()
    keep = ("device_code", "user_code", "verification_uri", "verification_uri_complete", "expires_in", "interval")
    return {key: answer[key] for key in keep if key in answer}


def finish_device_flow(device_code):
    """(None, RFC 8628 error) while the person has not finished, else (token, key, user): a personal
    API token that expires."""
    response = requests.post(provider()["token_endpoint"], auth=client_auth(), timeout=settings.OIDC_TIMEOUT,
                             data={"grant_type": DEVICE_GRANT, "device_code": device_code,
                                   "client_id": settings.OIDC_CLIENT_ID})
    answer = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    if response.status_code != 200:
        return None, answer.get("error") or f"status {response.status_code}"
    backend = SsoBackend()
    id_claims = backend.verify_token(answer.get("id_token"), nonce=None)
    user = sign_in(verified_claims(backend, answer.get("access_token"), id_claims))
    if user is None:
        raise SsoError("the account is disabled")
    if not answer.get("refresh_token"):
        # Without one the token could not follow the person's account between sign-ins.
        raise SsoError("the identity provider gave no refresh token, so a token could not follow your account; "
                       "your administrator can ask for one in TRAINYARD_OIDC_SCOPES (offline_access, for most "
                       "providers)")
    SsoIdentity.objects.filter(user=user, issuer=settings.OIDC_ISSUER).update(refresh_token=answer["refresh_token"])
    expires_at = timezone.now() + timedelta(seconds=settings.OIDC_TOKEN_LIFETIME_S)
    token, key = ApiToken.issue(user, PERSONAL_TOKEN_NAME, expires_at=expires_at)
    return (token, key, user), None


# --- tokens follow the provider too ------------------------------------------------------------------------
def token_refusal(token):
    """Why an API token may not be used now, or "" when it may. A token of someone who signs in
    through the provider (a personal token from `trainyard login --sso`, or one they made on the
    Tokens page) follows the provider:
    - with the device flow's refresh token kept for them, every TRAINYARD_OIDC_RECHECK_INTERVAL the
      provider is asked and their memberships brought in line; when it refuses, the person is
      disowned and their personal tokens revoked. One request at a time asks (a compare-and-swap on
      checked_at); the others go on with what the last answer left;
    - without one, nothing can ask on the token's behalf: it works while the provider vouched for
      them (a sign-in, a session's recheck) within TRAINYARD_OIDC_TOKEN_LIFETIME.
    Accounts that never signed in through the provider (service accounts) are never asked about."""
    if not configured():
        return ""
    identity = SsoIdentity.objects.filter(user_id=token.user_id, issuer=settings.OIDC_ISSUER).first()
    if identity is None:
        return ""
    now = timezone.now()
    if not identity.refresh_token:
        if identity.checked_at and now - identity.checked_at < timedelta(seconds=settings.OIDC_TOKEN_LIFETIME_S):
            return ""
        return ("The identity provider has not vouched for this token's owner lately: sign in through your "
                "organisation again (the portal, or trainyard login --sso).")
    if identity.checked_at and now - identity.checked_at < timedelta(seconds=settings.OIDC_RECHECK_S):
        return ""
    if not SsoIdentity.objects.filter(pk=identity.pk, checked_at=identity.checked_at).update(checked_at=now):
        return ""
    refused = "The identity provider no longer vouches for this token's owner."
    try:
        tokens = refreshed(identity.refresh_token)
        claims = _vouching_claims(_userinfo(tokens["access_token"]))
        if str(claims.get("sub")) != identity.subject:
            raise SsoError("userinfo is about someone else")
    except requests.RequestException as exc:  # not asked: this request is refused, the tokens are kept
        SsoIdentity.objects.filter(pk=identity.pk).update(checked_at=identity.checked_at)
        log.warning("cannot ask the identity provider about %s: %s", token.user.username, exc)
        return "The identity provider cannot be reached to vouch for this token's owner; try again shortly."
    except SsoError as exc:
        reason = f"the identity provider no longer vouches for {token.user.username} ({exc})"
        disowned(token.user, reason)
        revoke_personal_tokens(token.user, reason)
        return refused
    rotated = tokens.get("refresh_token") or identity.refresh_token
    SsoIdentity.objects.filter(pk=identity.pk).update(refresh_token=rotated)
    return "" if sign_in(claims) is not None else refused


def disowned(user, reason):
    """The provider refused to vouch for `user`: their memberships in the tenants a mapping names end
    (the audit entry gives `reason`), and none of their API tokens works until a sign-in through the
    provider vouches for them again (token_refusal), so no token reaches the tenants they joined by
    invitation either. Those memberships themselves are left alone."""
    sync_memberships(user, set(), why_removed=reason)
    # What the provider said before no longer stands, and the refresh token it just refused is spent.
    SsoIdentity.objects.filter(user=user, issuer=settings.OIDC_ISSUER).update(checked_at=None, refresh_token="")


def revoke_personal_tokens(user, reason):
    with transaction.atomic(), audit.acting_as(f"sso:{settings.OIDC_ISSUER}"), audit.because(reason):
        for personal in ApiToken.objects.filter(user=user, name=PERSONAL_TOKEN_NAME, revoked_at__isnull=True,
                                                expires_at__isnull=False):
            personal.revoked_at = timezone.now()
            personal.save()
