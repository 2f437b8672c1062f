"""The members and tokens pages of the portal."""
import json
import re
from types import SimpleNamespace

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from tenants.models import ApiToken, AuditEntry, Invitation, Membership
from tests.support.builders import job, logged_in, member

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
    answer = page.post("/account/tokens/", {"action": "create", "name": "laptop"})
    created = answer.content.decode()
    token = ApiToken.objects.get(user=alice.user, name="laptop")
    assert f"ty_{token.prefix}" in created and 'data-testid="new-token"' in created
    assert "no-store" in answer["Cache-Control"]  # no browser or proxy keeps a copy of the key
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


def _rows_read(sql):
    """The most rows any step of the query's plan produced, run for real (EXPLAIN ANALYZE)."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node):
        yield node["Actual Rows"] * node["Actual Loops"]
        for child in node.get("Plans", []):
            yield from walk(child)
    return max(walk(plan[0]["Plan"]))


def test_it_counts_every_tenants_members_and_jobs_without_pairing_them():
    # Counted through one join, each tenant's members were paired with each of its jobs: a large tenant
    # made the overview read members x jobs rows.
    if connection.vendor != "postgresql":
        pytest.skip("reads PostgreSQL's plan")
    alice = member("team-a", "alice")
    users = get_user_model().objects.bulk_create(get_user_model()(username=f"user-{i}") for i in range(30))
    Membership.objects.bulk_create(Membership(tenant=alice.tenant, user=user) for user in users)
    for _ in range(30):
        job(alice)
    member("team-b", "bob")
    page = Client()
    page.force_login(get_user_model().objects.create_superuser("root", "root@example.org", "pw"))
    with CaptureQueriesContext(connection) as queries:
        body = page.get("/").content.decode()
    assert re.search(r'data-testid="tenant-team-a">.*?<td class="num">31</td><td class="num">30</td>', body, re.S)
    overview = [q["sql"] for q in queries.captured_queries if '"member_count"' in q["sql"]]
    assert len(overview) == 1
    assert _rows_read(overview[0]) <= 31 + 30


@pytest.mark.parametrize("action, field, path", [("withdraw", "invitation", "/tenant/members/"),
                                                 ("revoke", "token", "/account/tokens/"),
                                                 ("accept", "invitation", "/account/tokens/")])
def test_it_takes_an_id_field_that_only_looks_like_digits_as_no_row(action, field, path):
    # "²" is a digit to str.isdigit() and no number to int(); twenty nines no database id: the form's
    # answer was a server error.
    alice = member("team-a", "alice", role="admin")
    page = logged_in(alice)
    assert page.post(path, {"action": action, field: "²"}).status_code == 302
    assert page.post(path, {"action": action, field: "9" * 20}).status_code == 302
