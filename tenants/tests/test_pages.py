"""The members and tokens pages of the portal."""
from types import SimpleNamespace

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tenants.models import ApiToken, AuditEntry, Invitation, Membership
from tests.support.builders import logged_in, member

pytestmark = pytest.mark.django_db


def test_a_tenant_admin_invites_changes_and_removes_members():
    ada = member("team-a", "ada", role="admin")
    newbie = get_user_model().objects.create_user("newbie")
    page = logged_in(ada)
    page.post("/tenant/members/", {"action": "add", "username": "newbie", "role": "viewer"})
    assert not Membership.objects.filter(user__username="newbie").exists()  # invited, not added
    assert 'data-testid="invitation-newbie"' in page.get("/tenant/members/").content.decode()
    account = logged_in(SimpleNamespace(user=newbie))
    invitation = Invitation.objects.get(username="newbie")
    assert 'data-testid="invitation-team-a"' in account.get("/account/tokens/").content.decode()
    account.post("/account/tokens/", {"action": "accept", "invitation": invitation.pk})
    assert Membership.objects.get(user__username="newbie").role == "viewer"
    page.post("/tenant/members/", {"action": "role", "username": "newbie", "role": "researcher"})
    assert Membership.objects.get(user__username="newbie").role == "researcher"
    html = page.get("/tenant/members/").content.decode()
    assert "newbie" in html and "Invite a member" in html
    page.post("/tenant/members/", {"action": "remove", "username": "newbie"})
    assert not Membership.objects.filter(user__username="newbie").exists()
    assert AuditEntry.objects.filter(target="newbie@team-a", actor="ada").count() == 3  # invited, role, removed


def test_researchers_see_members_but_cannot_change_them():
    member("team-a", "ada", role="admin")
    alice = member("team-a", "alice")
    get_user_model().objects.create_user("newbie")
    page = logged_in(alice)
    assert "Invite a member" not in page.get("/tenant/members/").content.decode()
    page.post("/tenant/members/", {"action": "add", "username": "newbie"})
    page.post("/tenant/members/", {"action": "role", "username": "ada", "role": "viewer"})
    assert not Membership.objects.filter(user__username="newbie").exists()
    assert not Invitation.objects.exists()
    assert Membership.objects.get(user__username="ada").role == "admin"


def test_the_last_admin_stays_admin():
    ada = member("team-a", "ada", role="admin")
    logged_in(ada).post("/tenant/members/", {"action": "role", "username": "ada", "role": "viewer"})
    assert Membership.objects.get(user__username="ada").role == "admin"


def test_tokens_page_shows_a_new_key_once_and_revokes():
    alice = member("team-a", "alice")
    page = logged_in(alice)
    created = page.post("/account/tokens/", {"action": "create", "name": "laptop"}).content.decode()
    token = ApiToken.objects.get(user=alice.user, name="laptop")
    assert f"ty_{token.prefix}" in created and 'data-testid="new-token"' in created
    assert 'data-testid="new-token"' not in page.get("/account/tokens/").content.decode()
    other = ApiToken.issue(member("team-a", "bob").user, "theirs")[0]
    page.post("/account/tokens/", {"action": "revoke", "token": other.pk})
    page.post("/account/tokens/", {"action": "revoke", "token": token.pk})
    other.refresh_from_db()
    token.refresh_from_db()
    assert other.revoked_at is None and token.revoked_at is not None
    assert page.post("/account/tokens/", {"action": "revoke", "token": "abc"}).status_code == 302  # no row, no 500


def test_a_platform_admin_of_no_tenant_sees_every_tenant_to_open():
    member("team-a", "alice")
    member("team-b", "bob")
    admin = get_user_model().objects.create_superuser("root", "root@example.org", "pw")
    page = Client()
    page.force_login(admin)
    home = page.get("/")
    body = home.content.decode()
    assert home.status_code == 200 and 'data-testid="platform-tenants"' in body
    assert 'data-testid="tenant-team-a"' in body and 'href="/?tenant=team-b"' in body
    opened = page.get("/", {"tenant": "team-b"})
    assert opened.status_code == 200 and 'data-testid="tenant">team-b<' in opened.content.decode()


def test_a_user_of_no_tenant_is_told_so_once_and_a_tenant_not_theirs_is_refused():
    member("team-a", "alice")
    page = Client()
    page.force_login(get_user_model().objects.create_user("nobody", password="pw"))
    home = page.get("/")
    body = home.content.decode()
    assert home.status_code == 200 and body.count("account page") == 1, body
    assert page.get("/", {"tenant": "team-a"}).status_code == 403
