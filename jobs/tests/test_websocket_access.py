"""Open websockets lose what their user loses: a revoked token, a logout or password change, a
deactivation, an unshared job, a removed membership or a lowered role closes the socket with the
code an outsider gets at connect (4401/4404), or, on the list stream, stops private jobs reaching it.

Each change is made the way the platform makes it (model saves, guardian, the logout view), in a
thread like any request, while the socket is open (channels' communicator, in-memory layer)."""
import asyncio
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session
from django.utils import timezone

from jobs import consumers, sharing
from tenants import sso
from tenants.models import ApiToken, Membership
from tests.support.builders import job, logged_in, member, token_for
from tests.support.websockets import session, status_change

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def change(fn):
    """`fn` run like a request (in a thread, committing on its own), as the socket's `then`."""
    async def then():
        await database_sync_to_async(fn)()
    return then


def revoke_all_tokens(user):
    for token in ApiToken.objects.filter(user=user):
        token.revoked_at = timezone.now()
        token.save()


# A script waiting for a job's end (trainyard.Client.wait) opens the status-only mode: it loses access the same way.
JOB_SOCKET_MODES = pytest.mark.parametrize("mode", ["", "only=status&"], ids=["full", "status-only"])


@JOB_SOCKET_MODES
def test_it_closes_a_job_socket_when_its_token_is_revoked(mode):
    alice = member()
    target = job(alice)
    code, messages = session(f"/ws/jobs/{target.id}/?{mode}token={token_for(alice)}",
                             then=change(lambda: revoke_all_tokens(alice.user)))
    assert code == 4401 and messages[0]["type"] == "job"


def test_a_script_may_send_its_token_as_the_rest_api_takes_it_and_loses_the_socket_alike():
    alice = member()
    target = job(alice)
    headers = [(b"authorization", f"Token {token_for(alice)}".encode())]
    code, messages = session(f"/ws/jobs/{target.id}/", headers=headers,
                             then=change(lambda: revoke_all_tokens(alice.user)))
    assert code == 4401 and messages[0]["type"] == "job"
    assert session(f"/ws/jobs/{target.id}/", headers=[(b"authorization", b"Token ty_forged")]) == (4401, [])


def test_a_nul_in_a_sockets_job_id_matches_no_route():
    # It reached the database, which refused it: the handshake failed with a server error.
    alice = member()
    with pytest.raises(ValueError, match="No route found"):
        session(f"/ws/jobs/x\x00y/?token={token_for(alice)}")


def test_it_keeps_the_socket_when_another_token_of_the_user_is_revoked():
    alice = member()
    target = job(alice)
    other, _ = ApiToken.issue(alice.user, "other")

    def revoke_other():
        other.revoked_at = timezone.now()
        other.save()
    code, _ = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}", then=change(revoke_other))
    assert code is None


def deactivate(user_id):
    user = get_user_model().objects.get(pk=user_id)
    user.is_active = False
    user.save()


def test_it_closes_when_the_user_is_deactivated():
    alice = member()
    target = job(alice)
    code, _ = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}", then=change(lambda: deactivate(alice.user_id)))
    assert code == 4401


@JOB_SOCKET_MODES
def test_it_closes_a_shared_private_job_when_it_is_unshared(mode):
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    secret = job(alice, private=True)
    sharing.share(secret, "bob", "view")
    code, messages = session(f"/ws/jobs/{secret.id}/?{mode}token={token_for(bob)}",
                             then=change(lambda: sharing.unshare(secret, "bob")))
    assert code == 4404 and messages[0]["job"]["id"] == secret.id


def test_it_closes_when_the_membership_is_removed():
    alice = member()
    target = job(alice)
    code, _ = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}",
                      then=change(lambda: Membership.objects.get(pk=alice.pk).delete()))
    assert code == 4401


def test_it_closes_when_single_sign_on_takes_the_tenant_away(settings):
    """The identity provider no longer has alice in the group that maps to team-a (tenants.sso)."""
    settings.OIDC_ISSUER, settings.OIDC_GROUP_MAP = "https://id.example.org", "ml-a=team-a:researcher"
    alice = member()
    target = job(alice)
    code, _ = session(f"/ws/jobs/{target.id}/?token={token_for(alice)}",
                      then=change(lambda: sso.sync_memberships(alice.user, groups=set())))
    assert code == 4401


def test_it_closes_a_private_job_when_an_admin_becomes_a_researcher():
    alice, ada = member("team-a", "alice"), member("team-a", "ada", role="admin")
    secret = job(alice, private=True)

    def demote():
        ada.role = Membership.Role.RESEARCHER
        ada.save()
    code, _ = session(f"/ws/jobs/{secret.id}/?token={token_for(ada)}", then=change(demote))
    assert code == 4404


def test_the_list_stream_stops_forwarding_private_jobs_after_a_demotion():
    alice, ada = member("team-a", "alice"), member("team-a", "ada", role="admin")
    secret = job(alice, private=True)

    def demote():
        ada.role = Membership.Role.RESEARCHER
        ada.save()

    async def demote_then_publish():
        await change(demote)()
        await status_change(secret)()
    assert session(f"/ws/jobs/?token={token_for(ada)}", then=demote_then_publish) == (None, [])


def test_the_list_stream_closes_when_the_membership_is_removed():
    alice = member()
    code, _ = session(f"/ws/jobs/?token={token_for(alice)}",
                      then=change(lambda: Membership.objects.get(pk=alice.pk).delete()))
    assert code == 4401


def browser_cookie(membership):
    client = logged_in(membership)
    return client, [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]


def test_a_browser_socket_closes_when_its_session_logs_out():
    alice = member()
    target = job(alice)
    client, headers = browser_cookie(alice)
    code, messages = session(f"/ws/jobs/{target.id}/", headers=headers,
                             then=change(lambda: client.post("/logout/")))
    assert code == 4401 and messages[0]["type"] == "job"


def test_a_browser_socket_closes_when_the_password_changes():
    alice = member()
    target = job(alice)
    _, headers = browser_cookie(alice)

    def new_password():
        user = get_user_model().objects.get(pk=alice.user_id)
        user.set_password("a-new-password-123")
        user.save()
    code, messages = session(f"/ws/jobs/{target.id}/", headers=headers, then=change(new_password))
    assert code == 4401 and messages[0]["type"] == "job"


def test_guessing_tokens_on_the_websocket_is_throttled_like_the_api(settings):
    from tenants import throttling
    alice = member()
    target = job(alice)
    for _ in range(throttling.TOKEN_FAILURES.limit):
        assert session(f"/ws/jobs/{target.id}/?token=ty_guess") == (4401, [])
    assert session(f"/ws/jobs/{target.id}/?token={token_for(alice)}") == (4401, [])


def test_a_socket_stays_with_the_tenant_it_was_opened_in():
    in_b = member("team-b", "alice")
    target = job(in_b)
    path = f"/ws/jobs/{target.id}/?token={token_for(in_b)}"  # no tenant named: alice's only one, team-b

    def join_a_then_change_role_in_b():
        member("team-a", "alice")  # now the first by slug
        in_b.role = Membership.Role.ADMIN
        in_b.save()
    assert session(path, then=change(join_a_then_change_role_in_b))[0] is None
    assert session(path, then=change(lambda: Membership.objects.get(pk=in_b.pk).delete()))[0] == 4401


def then_wait(seconds, first=None):
    """`first` (a socket's `then`), then `seconds` of waiting, as the socket's `then`."""
    async def then():
        if first is not None:
            await first()
        await asyncio.sleep(seconds)
    return then


@JOB_SOCKET_MODES
def test_a_job_socket_closes_when_its_token_expires(mode, monkeypatch):
    # Nothing announces an expiry: the socket's own periodic check finds it. The token runs out once
    # the socket has its backlog (its row says so, as time passing would), however slow the machine.
    monkeypatch.setattr(consumers, "ACCESS_RECHECK_S", 0.3)
    alice = member()
    target = job(alice)
    token, key = ApiToken.issue(alice.user, "short", expires_at=timezone.now() + timedelta(hours=1))
    expire = change(lambda: ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now()))
    code, messages = session(f"/ws/jobs/{target.id}/?{mode}token={key}", then=then_wait(1.5, expire))
    assert code == 4401 and messages[0]["type"] == "job"


def test_the_list_socket_closes_when_its_session_expires(monkeypatch, settings):
    monkeypatch.setattr(consumers, "ACCESS_RECHECK_S", 0.3)
    alice = member()
    client, headers = browser_cookie(alice)
    # The session's row ends as an expired one would, with nothing sent anywhere (a queryset update).
    expire = change(lambda: Session.objects.filter(session_key=client.cookies["sessionid"].value)
                    .update(expire_date=timezone.now() - timedelta(seconds=1)))
    code, _ = session("/ws/jobs/", headers=headers, then=then_wait(1.5, expire))
    assert code == 4401
