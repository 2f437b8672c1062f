"""Single sign-on against a real OpenID provider (npm's oidc-provider as its own process,
tests/support/oidc.py): people signed in through it, tenants and roles from its groups, membership
following it, and every way a hostile answer is refused. The portal side runs in Django's test client;
everything the provider does is the provider's."""
import contextlib
import socket
import threading
import time
from datetime import timedelta
from urllib.parse import urlencode, urlparse

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from tenants import audit, sso, throttling
from tenants.models import ApiToken, AuditEntry, GroupMapping, Invitation, Membership, SsoIdentity, Tenant
from tests.support import oidc
from tests.support.builders import job, member
from tests.support.websockets import session as socket_session

CALLBACK = "http://testserver/sso/callback/"
pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    instance = oidc.Provider(tmp_path_factory.mktemp("oidc"), redirect_uris=[CALLBACK], accounts={})
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture
def idp(provider, settings):
    """The provider, Trainyard pointed at it, carol in ml-vision (vision as researcher) and ml-leads."""
    for name, value in provider.settings(OIDC_GROUP_MAP="ml-vision=vision:researcher, ml-leads=vision:admin "
                                                        "ml-nlp=nlp:viewer").items():
        setattr(settings, name, value)
    settings.OIDC_RECHECK_S = 300
    Tenant.objects.create(slug="vision")
    Tenant.objects.create(slug="nlp")
    provider.set_accounts({"carol": {"groups": ["ml-vision"]}, "dave": {"groups": ["ml-leads", "ml-vision"]}})
    return provider


def start(client):
    """Ask the portal to sign in; the provider's authorization URL it redirects to."""
    response = client.get("/sso/login/")
    assert response.status_code == 302
    return response["Location"]


def through_provider(client, login):
    """The callback URL (path and query) the provider sends `login`'s browser back to."""
    back = oidc.sign_in(oidc.requests.Session(), start(client), login, stop_at=CALLBACK)
    parts = urlparse(back)
    return f"{parts.path}?{parts.query}"


def sign_in(client, login):
    return client.get(through_provider(client, login))


def signed_in_as(client):
    return client.get("/api/v1/tenants/current/").json()


# --- the way in ---------------------------------------------------------------------------------------------
def test_it_asks_for_the_code_with_pkce_state_and_nonce(idp, client):
    query = dict(part.split("=", 1) for part in urlparse(start(client)).query.split("&"))
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert query["state"] and query["nonce"] and query["client_id"] == oidc.CLIENT_ID


def test_it_creates_the_person_at_first_sign_in_in_the_tenant_their_group_maps_to(idp, client):
    response = sign_in(client, "carol")

    assert response.status_code == 302 and response["Location"] == "/"
    identity = SsoIdentity.objects.get(issuer=idp.issuer, subject="carol")
    assert identity.user.username == "carol" and not identity.user.has_usable_password()
    assert {(m.tenant.slug, m.role) for m in identity.user.memberships.all()} == {("vision", "researcher")}
    assert signed_in_as(client)["role"] == "researcher"
    entry = AuditEntry.objects.get(target="carol@vision", action="created")
    assert entry.actor == f"sso:{idp.issuer}" and "ml-vision" in entry.after["reason"]


def test_the_highest_role_any_group_gives_wins(idp, client):
    sign_in(client, "dave")
    assert Membership.objects.get(user__username="dave", tenant__slug="vision").role == "admin"


def test_a_mapping_from_the_admin_console_counts_too(idp, client):
    GroupMapping.objects.create(group="ml-vision", tenant=Tenant.objects.get(slug="nlp"), role="researcher")
    sign_in(client, "carol")
    assert set(Membership.objects.filter(user__username="carol").values_list("tenant__slug", "role")) == {
        ("vision", "researcher"), ("nlp", "researcher")}


def test_a_local_account_with_the_same_name_is_not_taken_over(idp, client):
    local = member("vision", "carol", "admin").user
    sign_in(client, "carol")
    identity = SsoIdentity.objects.get(subject="carol")
    assert identity.user != local and identity.user.username == "carol-2"
    assert Membership.objects.get(user=local).role == "admin"


def test_a_disabled_account_s_session_ends(idp, client):
    sign_in(client, "carol")
    get_user_model().objects.filter(username="carol").update(is_active=False)
    assert client.get("/api/v1/tenants/current/").status_code == 401


def test_a_password_login_carrying_code_and_state_is_not_a_provider_sign_in(idp, client):
    member("vision", "erin").user.set_password("erin-password-1")
    response = client.post("/login/?code=stolen&state=whatever", {"username": "nobody", "password": "x"})
    assert response.status_code == 200 and "_auth_user_id" not in client.session


# --- membership follows the provider -----------------------------------------------------------------------
def test_someone_removed_from_the_group_loses_the_tenant_at_the_next_sign_in(idp, client):
    sign_in(client, "carol")
    idp.set_accounts({"carol": {"groups": []}})
    sign_in(Client(), "carol")

    assert not Membership.objects.filter(user__username="carol").exists()
    entry = AuditEntry.objects.get(target="carol@vision", action="deleted")
    assert entry.actor == f"sso:{idp.issuer}"
    assert entry.after["reason"] == "the identity provider no longer has carol in ml-leads or ml-vision"


def test_a_live_session_follows_the_provider_within_the_interval(idp, client, settings):
    sign_in(client, "carol")
    idp.set_accounts({"carol": {"groups": ["ml-leads"]}})
    assert signed_in_as(client)["role"] == "researcher"  # not yet: checked at most every interval

    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert signed_in_as(client)["role"] == "admin"

    idp.set_accounts({"carol": {"groups": ["ml-nlp"]}})
    time.sleep(1.1)
    assert signed_in_as(client)["tenant"]["slug"] == "nlp"
    assert not Membership.objects.filter(user__username="carol", tenant__slug="vision").exists()
    assert AuditEntry.objects.filter(target="carol@vision", action="deleted").exists()


def test_a_session_the_provider_no_longer_vouches_for_ends(idp, client, settings):
    sign_in(client, "carol")
    idp.set_accounts({})  # carol is gone from the directory
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert client.get("/api/v1/tenants/current/").status_code == 401
    assert "_auth_user_id" not in client.session
    # Nor does any token of hers reach the tenants the provider decides: her memberships there end.
    assert not Membership.objects.filter(user__username="carol", tenant__slug="vision").exists()
    entry = AuditEntry.objects.get(target="carol@vision", action="deleted")
    assert "no longer vouches for carol" in entry.after["reason"]


def test_an_expired_access_token_is_refreshed_at_the_recheck(idp, client, settings):
    sign_in(client, "carol")
    session = client.session
    session[sso.ACCESS_TOKEN] = "revoked-or-expired"
    session.save()
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert signed_in_as(client)["role"] == "researcher"
    assert client.session[sso.ACCESS_TOKEN] != "revoked-or-expired"


def test_a_session_keeps_its_refresh_token_when_the_provider_does_not_rotate_it(idp, client, settings, monkeypatch):
    """The real provider's refresh answers without a refresh token, as providers that do not rotate
    them answer (RFC 6749 §6): the one the sign-in gave stays good for the next refresh."""
    real_post = sso.requests.post

    def without_rotation(url, **kwargs):
        response = real_post(url, **kwargs)
        if kwargs.get("data", {}).get("grant_type") == "refresh_token" and response.status_code == 200:
            answer = {key: value for key, value in response.json().items() if key != "refresh_token"}
            response.json = lambda **_: answer
        return response
    monkeypatch.setattr(sso.requests, "post", without_rotation)
    sign_in(client, "carol")
    settings.OIDC_RECHECK_S = 1
    for _ in range(2):  # the access token expires again after the first refresh
        session = client.session
        session[sso.ACCESS_TOKEN] = "expired"
        session.save()
        time.sleep(1.1)
        assert signed_in_as(client)["role"] == "researcher"
    assert Membership.objects.filter(user__username="carol", tenant__slug="vision").exists()


@pytest.fixture
def refreshes(monkeypatch):
    """The refresh grants sent to the provider (the refresh token each spent)."""
    sent, real_post = [], sso.requests.post

    def counting(url, **kwargs):
        if kwargs.get("data", {}).get("grant_type") == "refresh_token":
            sent.append(kwargs["data"]["refresh_token"])
        return real_post(url, **kwargs)
    monkeypatch.setattr(sso.requests, "post", counting)
    return sent


def expired_session(client, settings):
    """carol's session, due for its recheck with an access token the provider no longer takes."""
    sign_in(client, "carol")
    session = client.session
    session[sso.ACCESS_TOKEN] = "expired"
    session.save()
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    return session.session_key, get_user_model().objects.get(username="carol")


def test_a_request_that_read_the_session_before_another_refreshed_it_spends_no_refresh_token_again(
        idp, client, settings, refreshes):
    """Pages send requests in parallel: each read the session before the first to recheck stored what it
    learnt, and a second refresh with the token the first spent is, to a provider that rotates them,
    a stolen token (it revokes the person's grant)."""
    from django.contrib.sessions.backends.db import SessionStore
    key, carol = expired_session(client, settings)
    first, read_earlier = SessionStore(session_key=key), SessionStore(session_key=key)
    assert read_earlier[sso.ACCESS_TOKEN] == first[sso.ACCESS_TOKEN] == "expired"  # both loaded now
    assert sso.session_vouched_for(first, carol)
    assert sso.session_vouched_for(read_earlier, carol)
    assert len(refreshes) == 1
    assert read_earlier[sso.REFRESH_TOKEN] == first[sso.REFRESH_TOKEN]
    assert read_earlier[sso.ACCESS_TOKEN] == first[sso.ACCESS_TOKEN] != "expired"


def test_while_one_request_asks_the_provider_the_sessions_others_go_on_without_asking(
        idp, client, settings, refreshes):
    from django.contrib.sessions.backends.db import SessionStore
    from django.core.cache import cache
    key, carol = expired_session(client, settings)
    assert cache.add(f"sso-recheck:{key}", 1, timeout=30)  # as the request asking now holds it
    try:
        session = SessionStore(session_key=key)
        assert sso.session_vouched_for(session, carol)
        assert refreshes == [] and session[sso.ACCESS_TOKEN] == "expired"
    finally:
        cache.delete(f"sso-recheck:{key}")
    assert sso.session_vouched_for(session, carol) and len(refreshes) == 1  # its turn, once the mark is gone


@pytest.fixture
def short_lived_idp(tmp_path, settings, monkeypatch):
    """A provider of its own whose access tokens last 1 s (and 15 s more: its clock tolerance), carol
    in ml-vision (vision as researcher)."""
    monkeypatch.setenv("OIDC_ACCESS_TOKEN_TTL", "1")
    instance = oidc.Provider(tmp_path / "oidc", redirect_uris=[CALLBACK], accounts={"carol": {"groups": ["ml-vision"]}})
    instance.start()
    for name, value in instance.settings(OIDC_GROUP_MAP="ml-vision=vision:researcher").items():
        setattr(settings, name, value)
    Tenant.objects.create(slug="vision")
    yield instance
    instance.stop()


def without_refresh_token(client):
    """What a sign-in leaves in the session when the provider gives no refresh token (most give one
    only for offline_access)."""
    session = client.session
    session[sso.REFRESH_TOKEN] = None
    session.save()


def test_a_session_whose_access_token_ran_out_ends_with_the_persons_tenants_kept(short_lived_idp, client, settings):
    """The session cannot be checked any more, but the provider has not refused the person: their
    memberships, and with them their shares and the invitations they sent, stay."""
    sign_in(client, "carol")
    without_refresh_token(client)
    settings.OIDC_RECHECK_S = 1
    time.sleep(17)  # past the token's life and the provider's tolerance, so its userinfo answers 401
    assert client.get("/api/v1/tenants/current/").status_code == 401
    assert Membership.objects.filter(user__username="carol", tenant__slug="vision").exists()
    assert not AuditEntry.objects.filter(target="carol@vision", action="deleted").exists()


def test_without_a_refresh_token_the_providers_refusal_still_takes_the_tenants(idp, client, settings):
    sign_in(client, "carol")
    without_refresh_token(client)
    idp.set_accounts({})
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)  # within the access token's life: userinfo refuses her
    assert client.get("/api/v1/tenants/current/").status_code == 401
    assert not Membership.objects.filter(user__username="carol", tenant__slug="vision").exists()


def test_invitations_keep_working_and_a_tenant_no_mapping_names_is_left_alone(idp, client):
    Tenant.objects.create(slug="shared")
    sign_in(client, "carol")
    carol = get_user_model().objects.get(username="carol")
    Invitation.objects.create(tenant=Tenant.objects.get(slug="shared"), username="carol", role="viewer",
                              invited_by="someone")
    invitation = client.get("/api/v1/invitations/").json()["results"][0]
    assert client.post(f"/api/v1/invitations/{invitation['id']}/accept/").status_code == 200
    idp.set_accounts({"carol": {"groups": []}})
    sign_in(Client(), "carol")
    assert list(Membership.objects.filter(user=carol).values_list("tenant__slug", flat=True)) == ["shared"]


def test_a_first_sign_in_under_an_invited_name_does_not_take_the_invitation(idp, client):
    """The provider's preferred_username is the name a first sign-in takes, and a person may choose it
    there: an invitation sent to a name nobody held is not theirs. Invited again, it is."""
    from tenants import people
    shared = Tenant.objects.create(slug="shared")
    people.invite(shared, "erin", "admin", invited_by="ada")
    idp.set_accounts({"erin": {"groups": []}})
    sign_in(client, "erin")
    assert get_user_model().objects.filter(username="erin").exists()
    assert client.get("/api/v1/invitations/").json()["results"] == []
    waiting = Invitation.objects.get(username="erin")
    assert client.post(f"/api/v1/invitations/{waiting.pk}/accept/").status_code == 404
    assert not Membership.objects.filter(tenant=shared).exists()
    people.invite(shared, "erin", "viewer", invited_by="ada")  # sent to the account that holds the name now
    [invitation] = client.get("/api/v1/invitations/").json()["results"]
    assert client.post(f"/api/v1/invitations/{invitation['id']}/accept/").json()["role"] == "viewer"


@pytest.mark.parametrize("groups_left, role_left", [(["ml-vision"], "researcher"), ([], None)],
                         ids=["demoted", "removed"])
def test_an_admin_the_provider_demotes_or_removes_takes_back_the_invitations_they_sent(
        settings, groups_left, role_left):
    from tenants import people
    settings.OIDC_GROUP_MAP = "ml-vision=vision:researcher ml-leads=vision:admin"
    vision = Tenant.objects.create(slug="vision")
    dave = get_user_model().objects.create_user("dave")
    sso.sync_memberships(dave, {"ml-leads"})
    # An admin's way back in once the provider takes the role away: an invitation to an account of their own.
    people.invite(vision, "dave-spare", "admin", invited_by="dave")
    people.invite(vision, "erin", "viewer", invited_by="someone-else")
    sso.sync_memberships(dave, set(groups_left))
    assert list(Membership.objects.filter(user=dave).values_list("role", flat=True)) == ([role_left] if role_left else [])
    assert list(Invitation.objects.values_list("username", flat=True)) == ["erin"]


# --- hostile answers ------------------------------------------------------------------------------------------
def with_id_token(monkeypatch, id_token, **more):
    """The provider's token response, with its ID token replaced (a forged or tampered answer)."""
    real = sso.SsoBackend.get_token

    def get_token(self, payload):
        answer = real(self, payload)
        return {**answer, "id_token": id_token, **more}

    monkeypatch.setattr(sso.SsoBackend, "get_token", get_token)


def assert_refused(response, reason):
    assert response.status_code == 403, response.content[:300]
    assert reason in response.content.decode()
    assert "_auth_user_id" not in response.wsgi_request.session
    assert not Membership.objects.filter(user__username="carol").exists()


@pytest.mark.parametrize("claims, reason", [
    ({"aud": "another-app"}, "Audience doesn&#x27;t match"),
    ({"aud": ["another-app", oidc.CLIENT_ID]}, "azp"),
    ({"exp": int(time.time()) - 120, "iat": int(time.time()) - 900}, "Signature has expired"),
    ({"iss": "http://127.0.0.1:1/elsewhere"}, "Invalid issuer"),
    ({"iat": None}, "iat"),
], ids=["another-audience", "shared-audience-without-azp", "expired", "another-issuer", "no-issue-time"])
def test_an_id_token_signed_by_the_provider_but_not_for_this_sign_in_is_refused(idp, client, monkeypatch,
                                                                                claims, reason):
    callback = through_provider(client, "carol")
    nonce = next(iter(client.session["oidc_states"].values()))["nonce"]
    with_id_token(monkeypatch, idp.id_token(nonce=nonce, **claims))
    assert_refused(client.get(callback), reason)


def test_an_id_token_signed_by_someone_else_is_refused(idp, client, monkeypatch):
    callback = through_provider(client, "carol")
    nonce = next(iter(client.session["oidc_states"].values()))["nonce"]
    _, stranger = oidc.rsa_jwk("test-key-1")  # the provider's key id, another key
    with_id_token(monkeypatch, idp.id_token(nonce=nonce, key_pem=stranger, groups=["ml-leads"]))
    assert_refused(client.get(callback), "Signature verification failed")


def test_an_unsigned_id_token_carrying_groups_is_refused(idp, client, monkeypatch):
    callback = through_provider(client, "carol")
    nonce = next(iter(client.session["oidc_states"].values()))["nonce"]
    unsigned = oidc.jwt.encode({"iss": idp.issuer, "aud": oidc.CLIENT_ID, "sub": "carol", "nonce": nonce,
                                "iat": int(time.time()), "exp": int(time.time()) + 300, "groups": ["ml-leads"]},
                               None, algorithm="none")
    with_id_token(monkeypatch, unsigned)
    assert_refused(client.get(callback), "signed with &#x27;none&#x27;")


def test_an_id_token_signed_with_the_public_key_as_an_hmac_secret_is_refused(idp, client, monkeypatch):
    callback = through_provider(client, "carol")
    nonce = next(iter(client.session["oidc_states"].values()))["nonce"]
    forged = oidc.jwt.encode({"iss": idp.issuer, "aud": oidc.CLIENT_ID, "sub": "carol", "nonce": nonce,
                              "iat": int(time.time()), "exp": int(time.time()) + 300}, oidc.CLIENT_SECRET,
                             algorithm="HS256", headers={"kid": "test-key-1"})
    with_id_token(monkeypatch, forged)
    assert_refused(client.get(callback), "signed with &#x27;HS256&#x27;")


def test_a_replayed_nonce_is_refused(idp, client, monkeypatch):
    first = Client()
    callback = through_provider(first, "carol")
    captured = {}
    real = sso.SsoBackend.get_token

    def keep(self, payload):
        captured.update(real(self, payload))
        return captured

    monkeypatch.setattr(sso.SsoBackend, "get_token", keep)
    assert first.get(callback).status_code == 302
    Membership.objects.filter(user__username="carol").delete()

    with_id_token(monkeypatch, captured["id_token"])  # the earlier sign-in's ID token, its nonce with it
    assert_refused(client.get(through_provider(client, "carol")), "Nonce verification failed")


def test_a_replayed_state_is_refused(idp, client):
    callback = through_provider(client, "carol")
    assert client.get(callback).status_code == 302
    client.logout()
    Membership.objects.filter(user__username="carol").delete()

    assert_refused(client.get(callback), "has been used already (state)")
    assert_refused(Client().get(callback), "has been used already (state)")  # another browser replaying it


def test_an_answer_from_an_issuer_that_is_not_configured_is_refused(idp, client):
    callback = through_provider(client, "carol")
    elsewhere = callback.replace(urlencode({"iss": idp.issuer}), urlencode({"iss": "https://evil.example"}))
    assert elsewhere != callback
    assert_refused(client.get(elsewhere), "https://evil.example, which is not the configured provider")


@contextlib.contextmanager
def silent_server(*, hang_up_after):
    """The URL of a server that takes connections and never answers (a provider that hangs), hanging
    up after `hang_up_after` seconds so that a request waiting for ever still ends the test."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def take():
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])

    def hang_up():  # twice is harmless
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        listener.close()
        for connection in held:
            connection.close()

    threading.Thread(target=take, daemon=True).start()
    timer = threading.Timer(hang_up_after, hang_up)
    timer.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/token"
    finally:
        timer.cancel()
        hang_up()


def test_a_provider_that_never_answers_holds_a_sign_in_no_longer_than_the_timeout(idp, client, monkeypatch,
                                                                                   settings):
    callback = through_provider(client, "carol")
    assert 0 < settings.OIDC_TIMEOUT <= 30  # the library waits for ever without one
    settings.OIDC_TIMEOUT = 1
    with silent_server(hang_up_after=10) as token_endpoint:
        monkeypatch.setattr(sso.SsoBackend, "OIDC_OP_TOKEN_ENDPOINT", token_endpoint)
        started = time.monotonic()
        response = client.get(callback)
        waited = time.monotonic() - started
    assert waited < 5
    assert_refused(response, "timed out")


def test_a_provider_discovered_under_another_name_is_refused(idp, client, settings):
    settings.OIDC_ISSUER = idp.issuer + "/"  # the document says the issuer is without the slash
    with pytest.raises(sso.ImproperlyConfigured, match="must be the issuer exactly"):
        client.get("/sso/login/")


def test_a_group_claim_in_the_browsers_hands_counts_for_nothing(idp, client, monkeypatch):
    callback = through_provider(client, "carol") + "&" + urlencode({"groups": "ml-leads"})
    real = sso.SsoBackend.get_token
    monkeypatch.setattr(sso.SsoBackend, "get_token",
                        lambda self, payload: {**real(self, payload), "groups": ["ml-leads"]})
    assert client.get(callback).status_code == 302
    assert Membership.objects.get(user__username="carol").role == "researcher"


def test_userinfo_about_someone_else_is_refused(idp, client, monkeypatch):
    callback = through_provider(client, "carol")
    monkeypatch.setattr(sso.SsoBackend, "get_userinfo",
                        lambda self, *args: {"sub": "dave", "groups": ["ml-leads"]})
    assert_refused(client.get(callback), "someone other than the ID token")


# --- local sign-in, switched off ----------------------------------------------------------------------------
def test_with_local_sign_in_off_the_password_form_is_gone_and_refused(idp, client, settings):
    member("vision", "erin")
    settings.LOCAL_LOGIN = False
    page = client.get("/login/").content.decode()
    assert 'data-testid="sso-login"' in page and 'type="password"' not in page
    assert client.post("/login/", {"username": "erin", "password": "x"}).status_code == 403


def test_with_local_sign_in_off_the_admin_console_refuses_passwords_too(idp, client, settings):
    staff = get_user_model().objects.create_superuser("root", password="root-password-1")
    settings.LOCAL_LOGIN = False
    response = client.post("/admin/login/", {"username": "root", "password": "root-password-1", "next": "/admin/"})
    assert response.status_code == 200 and "_auth_user_id" not in client.session
    settings.LOCAL_LOGIN = True
    client.post("/admin/login/", {"username": "root", "password": "root-password-1", "next": "/admin/"})
    assert client.session["_auth_user_id"] == str(staff.pk)


def test_a_group_mapping_made_in_the_admin_console_is_audited_and_used(idp, admin_client):
    vision = Tenant.objects.get(slug="vision")
    response = admin_client.post("/admin/tenants/groupmapping/add/",
                                 {"group": "ml-interns", "tenant": vision.pk, "role": "viewer"})
    assert response.status_code == 302
    assert AuditEntry.objects.get(target_type="group mapping", action="created").after == {
        "group": "ml-interns", "role": "viewer"}
    idp.set_accounts({"erin": {"groups": ["ml-interns"]}})
    sign_in(Client(), "erin")
    assert Membership.objects.get(user__username="erin").role == "viewer"


def test_without_single_sign_on_the_login_page_is_as_before(client, settings):
    settings.OIDC_ISSUER = ""
    page = client.get("/login/").content.decode()
    assert 'type="password"' in page and "sso-login" not in page
    assert client.get("/sso/login/").status_code == 404
    assert client.post("/api/v1/sso/device/").status_code == 404


# --- the device flow ------------------------------------------------------------------------------------------
def test_an_address_may_start_and_poll_the_device_flow_only_so_often(client, settings, monkeypatch):
    """Each start and poll is a call to the identity provider: past its rule an address is refused with
    429 before any call is made (the provider itself is not needed to see it)."""
    settings.OIDC_ISSUER, settings.OIDC_CLIENT_ID = "https://id.example", "trainyard"
    calls = []
    monkeypatch.setattr(sso, "start_device_flow", lambda: calls.append("start") or {"device_code": "dc"})
    monkeypatch.setattr(sso, "finish_device_flow", lambda code: calls.append("poll") or (None, "authorization_pending"))
    starts = [client.post("/api/v1/sso/device/").status_code for _ in range(throttling.DEVICE_STARTS.limit + 5)]
    assert starts == [200] * (throttling.DEVICE_STARTS.limit - 1) + [429] * 6
    polls = [client.post("/api/v1/sso/device/token/", {"device_code": "dc"}, content_type="application/json")
             for _ in range(throttling.DEVICE_POLLS.limit + 2)]
    assert [p.status_code for p in polls] == [400] * (throttling.DEVICE_POLLS.limit - 1) + [429] * 3
    assert int(polls[-1]["Retry-After"]) > 0
    assert calls.count("start") == throttling.DEVICE_STARTS.limit - 1
    assert calls.count("poll") == throttling.DEVICE_POLLS.limit - 1
    other = Client(REMOTE_ADDR="10.0.0.9")  # another address is not held back
    assert other.post("/api/v1/sso/device/").status_code == 200


def test_the_device_flow_gives_a_personal_token_that_expires(idp, client, settings):
    settings.OIDC_TOKEN_LIFETIME_S = 3600
    started = client.post("/api/v1/sso/device/").json()
    assert set(started) >= {"device_code", "user_code", "verification_uri_complete"}
    pending = client.post("/api/v1/sso/device/token/", {"device_code": started["device_code"]},
                          content_type="application/json")
    assert pending.status_code == 400 and pending.json()["error"] == "authorization_pending"

    assert "Sign-in Success" in oidc.complete_device_flow(started["verification_uri_complete"], "dave")
    issued = client.post("/api/v1/sso/device/token/", {"device_code": started["device_code"]},
                         content_type="application/json").json()

    assert issued["username"] == "dave"
    token = ApiToken.objects.get(user__username="dave")
    assert timedelta(minutes=59) < token.expires_at - timezone.now() <= timedelta(hours=1)
    answer = Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {issued['token']}").json()
    assert answer["role"] == "admin" and answer["tenant"]["slug"] == "vision"

    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert Client().get("/api/v1/tenants/current/",
                        HTTP_AUTHORIZATION=f"Token {issued['token']}").status_code == 401


def test_a_device_code_is_good_for_one_token(idp, client):
    started = client.post("/api/v1/sso/device/").json()
    oidc.complete_device_flow(started["verification_uri_complete"], "carol")
    body = {"device_code": started["device_code"]}
    assert client.post("/api/v1/sso/device/token/", body, content_type="application/json").status_code == 200
    again = client.post("/api/v1/sso/device/token/", body, content_type="application/json")
    assert again.status_code == 400 and again.json()["error"] == "invalid_grant"


# --- the group map ---------------------------------------------------------------------------------------------
def test_the_group_map_reads_group_tenant_and_role():
    assert sso.parse_group_map("a=t1:admin, b=t2\nteam=lead=t3:viewer") == [
        ("a", "t1", "admin"), ("b", "t2", "researcher"), ("team=lead", "t3", "viewer")]
    with pytest.raises(sso.ImproperlyConfigured, match="'a=t1:boss' is not group=tenant"):
        sso.parse_group_map("a=t1:boss")


def device_token(client, login):
    started = client.post("/api/v1/sso/device/").json()
    oidc.complete_device_flow(started["verification_uri_complete"], login)
    return client.post("/api/v1/sso/device/token/", {"device_code": started["device_code"]},
                       content_type="application/json").json()["token"]


def test_a_personal_token_follows_the_provider_and_is_revoked_with_the_person(idp, client, settings):
    key = device_token(client, "dave")
    use = lambda: Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {key}")  # noqa: E731
    assert use().json()["role"] == "admin"

    idp.set_accounts({"dave": {"groups": ["ml-vision"]}})
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert use().json()["role"] == "researcher"

    idp.set_accounts({})  # dave leaves the organisation
    time.sleep(1.1)
    refused = use()
    assert refused.status_code == 401 and "no longer vouches" in refused.json()["detail"]
    token = ApiToken.objects.get(user__username="dave")
    assert token.revoked_at is not None
    entry = AuditEntry.objects.filter(target_type="token", action="changed").latest("id")
    assert entry.actor == f"sso:{idp.issuer}" and "no longer vouches for dave" in entry.after["reason"]
    assert use().status_code == 401


def test_a_token_for_a_service_account_is_never_asked_about(idp, client, settings):
    service = member("vision", "ci-bot").user
    _, key = ApiToken.issue(service, "ci")
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {key}").status_code == 200


def make_token(name, **credentials):
    """A token made through the API (the Tokens page's endpoint) by whoever `credentials` sign in as."""
    return Client().post("/api/v1/tokens/", {"name": name}, content_type="application/json", **credentials).json()["key"]


def test_a_token_made_on_the_tokens_page_follows_the_provider_too(idp, client, settings):
    made = make_token("ci", HTTP_AUTHORIZATION=f"Token {device_token(client, 'dave')}")
    use = lambda: Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {made}")  # noqa: E731
    assert use().json()["role"] == "admin"

    idp.set_accounts({})  # dave leaves the organisation
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    refused = use()
    assert refused.status_code == 401 and "no longer vouches" in refused.json()["detail"]
    assert not Membership.objects.filter(user__username="dave", tenant__slug="vision").exists()
    assert use().status_code != 200  # between two asks: no tenant of the provider's is left to act in


def test_a_person_the_provider_disowns_has_no_token_left_even_in_a_tenant_they_were_invited_to(idp, client, settings):
    Tenant.objects.create(slug="shared")
    made = make_token("ci", HTTP_AUTHORIZATION=f"Token {device_token(client, 'dave')}")
    dave = get_user_model().objects.get(username="dave")
    Membership.objects.create(tenant=Tenant.objects.get(slug="shared"), user=dave, role="researcher")
    use = lambda: Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {made}")  # noqa: E731

    idp.set_accounts({})  # dave leaves the organisation
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert use().status_code == 401  # the request that asked the provider
    refused = use()  # and every one after it, not only one per interval
    assert refused.status_code == 401 and "sign in through your organisation again" in refused.json()["detail"]
    assert Membership.objects.filter(user=dave, tenant__slug="shared").exists()  # the invitation's stays

    idp.set_accounts({"dave": {"groups": ["ml-vision"]}})
    sign_in(Client(), "dave")  # the provider vouches for him again
    assert use().status_code == 200


def test_a_session_the_provider_refuses_takes_the_persons_tokens_with_it(idp, client, settings):
    """Signed in with a browser only, so no refresh token is kept for her tokens: the session's recheck
    is what hears the provider refuse."""
    Tenant.objects.create(slug="shared")
    sign_in(client, "carol")
    made = make_token("ci", HTTP_COOKIE=f"sessionid={client.cookies['sessionid'].value}")
    carol = get_user_model().objects.get(username="carol")
    Membership.objects.create(tenant=Tenant.objects.get(slug="shared"), user=carol, role="researcher")

    idp.set_accounts({})
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert client.get("/api/v1/tenants/current/").status_code == 401
    refused = Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {made}")
    assert refused.status_code == 401 and "sign in through your organisation again" in refused.json()["detail"]


def test_without_a_refresh_token_a_persons_token_works_while_the_provider_vouched_lately(idp, client, settings):
    """A browser sign-in keeps no refresh token for tokens: nothing can ask the provider on their behalf."""
    sign_in(client, "carol")
    made = make_token("ci", HTTP_COOKIE=f"sessionid={client.cookies['sessionid'].value}")
    use = lambda: Client().get("/api/v1/tenants/current/", HTTP_AUTHORIZATION=f"Token {made}")  # noqa: E731
    assert use().status_code == 200

    settings.OIDC_TOKEN_LIFETIME_S = 60
    SsoIdentity.objects.filter(user__username="carol").update(checked_at=timezone.now() - timedelta(seconds=61))
    refused = use()
    assert refused.status_code == 401 and "sign in through your organisation again" in refused.json()["detail"]

    sign_in(Client(), "carol")  # the provider vouches for her again
    assert use().status_code == 200


def test_the_device_flow_refuses_to_issue_a_token_it_could_not_recheck(idp, client, monkeypatch):
    """The real provider's answer without its refresh token, as a provider answers where offline access
    was not asked for (TRAINYARD_OIDC_SCOPES)."""
    started = client.post("/api/v1/sso/device/").json()
    oidc.complete_device_flow(started["verification_uri_complete"], "carol")
    real_post = sso.requests.post

    def without_refresh_token(url, **kwargs):
        response = real_post(url, **kwargs)
        if kwargs.get("data", {}).get("grant_type") == sso.DEVICE_GRANT and response.status_code == 200:
            answer = {key: value for key, value in response.json().items() if key != "refresh_token"}
            response.json = lambda **_: answer
        return response
    monkeypatch.setattr(sso.requests, "post", without_refresh_token)

    refused = client.post("/api/v1/sso/device/token/", {"device_code": started["device_code"]},
                          content_type="application/json")
    assert refused.status_code == 403 and "TRAINYARD_OIDC_SCOPES" in refused.json()["detail"]
    assert not ApiToken.objects.filter(user__username="carol").exists()


@pytest.mark.django_db(transaction=True)  # the sockets read the database from threads of their own
def test_websockets_follow_the_provider_like_the_pages(idp, client, settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    target = job(member("vision", "alice"))
    key = device_token(Client(), "dave")
    sign_in(client, "carol")
    cookie = [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]
    assert socket_session(f"/ws/jobs/{target.id}/", headers=cookie)[0] is None
    assert socket_session(f"/ws/jobs/{target.id}/?token={key}")[0] is None

    idp.set_accounts({})  # both leave the organisation
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.1)
    assert socket_session(f"/ws/jobs/{target.id}/", headers=cookie)[0] == 4401
    assert client.get("/api/v1/tenants/current/").status_code == 401  # the session ended for the pages too
    assert socket_session(f"/ws/jobs/{target.id}/?token={key}")[0] == 4401
    assert not Membership.objects.filter(tenant__slug="vision", user__username__in=["carol", "dave"]).exists()


@pytest.mark.parametrize("name", ["system", "anonymous", "Scheduler", "lifecycle-manager"])
def test_a_first_sign_in_never_takes_a_name_the_platform_acts_under(name):
    # The audit log and jobs' events name who acted: an account called "system" would pass for the platform.
    assert sso._free_username({"preferred_username": name, "sub": "x"}) == f"{name.lower()}-2"


def test_every_name_the_platform_acts_under_is_kept_from_first_sign_ins():
    from jobs import admission, autoscaler, idle, lifecycle
    assert {admission.ACTOR, autoscaler.ACTOR, idle.ACTOR, lifecycle.SYSTEM, lifecycle.PREEMPTOR} <= audit.PLATFORM_ACTORS
