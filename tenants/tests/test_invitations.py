"""Nobody joins a tenant without consent: tenant admins invite, the invited user accepts; inviting
never tells whether a username exists; a user's requests without a tenant header act in the tenant
they chose or joined first; leaving a tenant takes back what was shared in it."""
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs import sharing
from tenants import people
from tenants.models import AuditEntry, Invitation, Membership
from tests.support.builders import client_for, job, logged_in, member

pytestmark = pytest.mark.django_db


@pytest.fixture
def platform_admin():
    return get_user_model().objects.create_superuser("root", "root@example.org", "pw")


def invite(admin, username, role="researcher"):
    return client_for(admin).post("/api/v1/tenants/current/members/", {"username": username, "role": role},
                                  format="json")


def test_a_tenant_admin_cannot_add_anyone_without_their_consent(platform_admin):
    member("team-a", "alice")
    mallory = member("team-b", "mallory", role="admin")
    for victim in ("alice", "root"):
        response = invite(mallory, victim, role="admin")
        assert response.status_code == 202, response.content
    assert not Membership.objects.filter(tenant__slug="team-b", user__username__in=["alice", "root"]).exists()
    assert client_for(member("team-a", "alice")).get("/api/v1/tenants/current/").json()["tenant"]["slug"] == "team-a"


def test_inviting_answers_the_same_for_unknown_and_known_usernames():
    get_user_model().objects.create_user("bobby")
    admin = member("team-a", "ada", role="admin")
    known, unknown = invite(admin, "bobby"), invite(admin, "ghost")
    assert known.status_code == unknown.status_code == 202
    assert known.content.decode().replace("bobby", "NAME") == unknown.content.decode().replace("ghost", "NAME")
    again = invite(admin, "bobby")  # inviting twice reads the same as well
    assert again.status_code == 202 and again.content == known.content
    listed = client_for(admin).get("/api/v1/tenants/current/invitations/").json()["results"]
    assert [i["username"] for i in listed] == ["bobby", "ghost"]  # the admin's own view tells nothing either


def test_the_invited_user_sees_accepts_or_declines_and_nobody_else_can():
    admin = member("team-a", "ada", role="admin")
    bob = get_user_model().objects.create_user("bob")
    eve = member("team-c", "eve")
    invite(admin, "bob", role="viewer")
    client_for(member("team-b", "carol", role="admin")).post(
        "/api/v1/tenants/current/members/", {"username": "bob"}, format="json")
    mine = client_for(bob).get("/api/v1/invitations/").json()["results"]
    assert [(i["tenant"]["slug"], i["role"], i["invited_by"]) for i in mine] == [
        ("team-a", "viewer", "ada"), ("team-b", "researcher", "carol")]
    team_a, team_b = mine[0]["id"], mine[1]["id"]
    assert client_for(eve).get("/api/v1/invitations/").json()["results"] == []
    assert client_for(eve).post(f"/api/v1/invitations/{team_a}/accept/").status_code == 404
    assert client_for(admin).post(f"/api/v1/invitations/{team_a}/accept/").status_code == 404
    assert client_for(bob).post(f"/api/v1/invitations/{team_b}/decline/").status_code == 204
    assert client_for(bob).post(f"/api/v1/invitations/{team_a}/accept/").json()["role"] == "viewer"
    assert [m.tenant.slug for m in Membership.objects.filter(user=bob)] == ["team-a"]
    assert not Invitation.objects.exists()
    actions = list(AuditEntry.objects.filter(target_type="invitation").order_by("id")
                   .values_list("actor", "action", "target"))
    assert actions == [("ada", "created", "bob@team-a"), ("carol", "created", "bob@team-b"),
                       ("bob", "deleted", "bob@team-b"), ("bob", "deleted", "bob@team-a")]


def test_researchers_cannot_invite_and_admins_withdraw():
    admin = member("team-a", "ada", role="admin")
    assert invite(member("team-a", "alice"), "bob").status_code == 403
    assert client_for(member("team-a", "alice")).get("/api/v1/tenants/current/invitations/").status_code == 403
    invite(admin, "bob")
    invitation = Invitation.objects.get()
    outsider = member("team-b", "mallory", role="admin")
    assert client_for(outsider).delete(f"/api/v1/tenants/current/invitations/{invitation.pk}/").status_code == 404
    assert client_for(admin).delete(f"/api/v1/tenants/current/invitations/{invitation.pk}/").status_code == 204
    assert not Invitation.objects.exists()


def test_a_platform_admin_still_adds_directly(platform_admin):
    member("team-a", "ada", role="admin")
    get_user_model().objects.create_user("newbie")
    response = client_for(platform_admin).post("/api/v1/tenants/current/members/?tenant=team-a",
                                               {"username": "newbie"}, format="json")
    assert response.status_code == 201 and response.json()["username"] == "newbie"
    assert Membership.objects.filter(tenant__slug="team-a", user__username="newbie").exists()


def test_requests_without_a_tenant_act_in_the_one_joined_first_or_the_one_chosen():
    alice = member("team-b", "alice")  # joined first; "team-a" sorts before it
    admin = member("team-a", "ada", role="admin")
    invite(admin, "alice")
    people.accept(Invitation.objects.get(), alice.user)
    api = client_for(alice)
    assert api.get("/api/v1/tenants/current/").json()["tenant"]["slug"] == "team-b"
    assert api.get("/api/v1/account/default-tenant/").json() == {"tenant": "team-b", "chosen": False,
                                                                 "tenants": ["team-a", "team-b"]}
    chosen = api.put("/api/v1/account/default-tenant/", {"tenant": "team-a"}, format="json")
    assert chosen.json() == {"tenant": "team-a", "chosen": True, "tenants": ["team-a", "team-b"]}
    assert api.get("/api/v1/tenants/current/").json()["tenant"]["slug"] == "team-a"
    refused = api.put("/api/v1/account/default-tenant/", {"tenant": "team-z"}, format="json")
    assert refused.status_code == 400 and refused.json()["field"] == "tenant"
    # Another tenant that exists is refused exactly like one that does not: no tenant is learnt this way.
    member("team-c", "carol")
    foreign = api.put("/api/v1/account/default-tenant/", {"tenant": "team-c"}, format="json")
    assert foreign.status_code == refused.status_code
    assert (str(foreign.json()).replace("team-c", "X") == str(refused.json()).replace("team-z", "X")), foreign.json()
    assert api.get("/api/v1/tenants/current/").json()["tenant"]["slug"] == "team-a"
    logged_in(alice).post("/account/tokens/", {"action": "default", "tenant": "team-b"})
    assert api.get("/api/v1/tenants/current/").json()["tenant"]["slug"] == "team-b"


def test_the_account_page_shows_invitations_and_declines():
    admin = member("team-a", "ada", role="admin")
    bob = get_user_model().objects.create_user("bob")
    invite(admin, "bob")
    page = logged_in(SimpleNamespace(user=bob))
    assert "your account page" in page.get("/").content.decode()  # no tenant yet: told where to look
    assert 'data-testid="invitation-team-a"' in page.get("/account/tokens/").content.decode()
    page.post("/account/tokens/", {"action": "decline", "invitation": Invitation.objects.get().pk})
    assert not Invitation.objects.exists() and not Membership.objects.filter(user=bob).exists()
    page.post("/account/tokens/", {"action": "accept", "invitation": "not-a-number"})  # nothing, no error


@pytest.mark.parametrize("how", ["api", "page", "console"])
def test_removing_a_member_takes_back_their_shares_and_invitations_there(how, platform_admin):
    admin = member("team-a", "ada", role="admin")
    bob = member("team-a", "bob")
    member("team-b", "bob")
    shared = job(admin, private=True)
    sharing.share(shared, "bob", "control")
    elsewhere = job(member("team-b", "carl"), private=True)
    sharing.share(elsewhere, "bob", "view")
    Invitation.objects.create(tenant=admin.tenant, username="bob", role="admin", invited_by="ada")
    if how == "api":
        assert client_for(admin).delete("/api/v1/tenants/current/members/bob/").status_code == 204
    elif how == "page":
        logged_in(admin).post("/tenant/members/", {"action": "remove", "username": "bob"})
    else:
        Membership.objects.get(pk=bob.pk).delete()  # what the admin console's inline does
    user = get_user_model().objects.get(username="bob")
    assert not user.has_perm("jobs.view_job", shared) and not user.has_perm("jobs.change_job", shared)
    assert get_user_model().objects.get(username="bob").has_perm("jobs.view_job", elsewhere)  # other tenant: kept
    assert not Invitation.objects.filter(tenant=admin.tenant, username="bob").exists()
    # joining again later does not bring the old shares back
    Membership.objects.create(tenant=admin.tenant, user=user)
    assert not get_user_model().objects.get(username="bob").has_perm("jobs.view_job", shared)


def test_an_invitation_needs_a_username_and_a_role():
    admin = member("team-a", "ada", role="admin")
    assert invite(admin, " ").json()["field"] == "username"
    assert invite(admin, "bob", role="owner").json()["field"] == "role"
    assert invite(admin, "ada").status_code == 409  # already a member: visible in the member list anyway


def test_an_invitation_expires_and_inviting_again_renews_it(settings):
    admin = member("team-a", "ada", role="admin")
    bob = get_user_model().objects.create_user("bob")
    invite(admin, "bob")
    [waiting] = client_for(bob).get("/api/v1/invitations/").json()["results"]
    Invitation.objects.update(created_at=timezone.now() - timedelta(days=settings.INVITATION_DAYS, seconds=1))
    assert client_for(bob).get("/api/v1/invitations/").json()["results"] == []
    assert client_for(bob).post(f"/api/v1/invitations/{waiting['id']}/accept/").status_code == 404
    assert not Membership.objects.filter(user=bob).exists()
    invite(admin, "bob")
    assert client_for(bob).post(f"/api/v1/invitations/{waiting['id']}/accept/").status_code == 200


@pytest.mark.parametrize("how", ["removed", "demoted"])
def test_an_admin_who_leaves_takes_back_the_invitations_they_sent(how):
    # Mallory invites an account of her own as admin, then is taken out: it must not bring her back.
    member("team-a", "ada", role="admin")
    mallory = member("team-a", "mallory", role="admin")
    get_user_model().objects.create_user("mallory2")
    invite(mallory, "mallory2", role="admin")
    invite(mallory, "carol")
    if how == "removed":
        people.remove_member(mallory)
    else:
        people.change_role(mallory, "researcher")
    assert not Invitation.objects.filter(tenant=mallory.tenant).exists()


def test_deleting_an_account_withdraws_the_invitations_to_its_name():
    admin = member("team-a", "ada", role="admin")
    get_user_model().objects.create_user("bob")
    invite(admin, "bob", role="admin")
    get_user_model().objects.get(username="bob").delete()
    newcomer = get_user_model().objects.create_user("bob")  # someone else, later
    assert client_for(newcomer).get("/api/v1/invitations/").json()["results"] == []


def test_an_invitation_sent_before_the_account_existed_is_not_the_accounts():
    admin = member("team-a", "ada", role="admin")
    invite(admin, "bob", role="admin")
    bob = get_user_model().objects.create_user("bob")  # whoever took the name first
    assert client_for(bob).get("/api/v1/invitations/").json()["results"] == []
    early = Invitation.objects.get(username="bob")
    with pytest.raises(people.PeopleError):
        people.accept(early, bob)
    invite(admin, "bob", role="viewer")
    assert [i["role"] for i in client_for(bob).get("/api/v1/invitations/").json()["results"]] == ["viewer"]


def test_an_expired_invitation_reads_as_expired_to_the_admin_and_leaves_the_members_page(settings):
    admin = member("team-a", "ada", role="admin")
    invite(admin, "bob")
    invite(admin, "carol")
    Invitation.objects.filter(username="bob").update(
        created_at=timezone.now() - timedelta(days=settings.INVITATION_DAYS, seconds=1))
    listed = {i["username"]: i for i in client_for(admin).get("/api/v1/tenants/current/invitations/").json()["results"]}
    assert (listed["bob"]["state"], listed["carol"]["state"]) == ("expired", "waiting")
    assert listed["bob"]["expires_at"] < timezone.now().isoformat() < listed["carol"]["expires_at"]
    page = logged_in(admin).get("/tenant/members/").content.decode()
    assert 'data-testid="invitation-carol"' in page and 'data-testid="invitation-bob"' not in page


def test_an_invitation_withdrawn_or_changed_after_it_was_shown_is_accepted_as_it_is_now(settings):
    admin = member("team-a", "ada", role="admin")
    bob = get_user_model().objects.create_user("bob")
    invite(admin, "bob", role="admin")
    shown = people.invitations_for(bob).get()
    invite(admin, "bob", role="viewer")  # renewed with another role meanwhile
    assert people.accept(shown, bob).role == "viewer"
    people.remove_member(Membership.objects.get(user=bob))
    invite(admin, "bob")
    shown = people.invitations_for(bob).get()
    Invitation.objects.filter(pk=shown.pk).delete()  # withdrawn meanwhile
    with pytest.raises(people.PeopleError):
        people.accept(shown, bob)
    assert not Membership.objects.filter(user=bob).exists()


def test_accepting_an_invitation_withdrawn_while_the_request_ran_is_a_404(monkeypatch):
    admin = member("team-a", "ada", role="admin")
    bob = get_user_model().objects.create_user("bob")
    invite(admin, "bob")
    [waiting] = client_for(bob).get("/api/v1/invitations/").json()["results"]
    found = people.invitations_for

    def withdrawn_once_found(user):  # the admin withdraws it between the request's lookup and its accept
        shown = list(found(user))
        Invitation.objects.filter(pk=waiting["id"]).delete()
        return SimpleNamespace(filter=lambda **_: SimpleNamespace(first=lambda: shown[0]))
    monkeypatch.setattr(people, "invitations_for", withdrawn_once_found)
    answer = client_for(bob).post(f"/api/v1/invitations/{waiting['id']}/accept/")
    assert answer.status_code == 404 and "expired" in answer.json()["detail"]
    assert not Membership.objects.filter(user=bob).exists()


def test_the_periodic_pass_deletes_invitations_long_expired(settings):
    admin = member("team-a", "ada", role="admin")
    for name in ("old", "expired", "fresh"):
        invite(admin, name)
    expiry = timedelta(days=settings.INVITATION_DAYS)
    Invitation.objects.filter(username="old").update(created_at=timezone.now() - expiry - people.ENDED_KEPT
                                                     - timedelta(seconds=1))
    Invitation.objects.filter(username="expired").update(created_at=timezone.now() - expiry)
    assert people.prune() == (0, 1)
    assert sorted(Invitation.objects.values_list("username", flat=True)) == ["expired", "fresh"]
    assert AuditEntry.objects.filter(target_type="invitation", action="deleted", target="old@team-a",
                                     actor="system", after={"reason": "retention"}).exists()
