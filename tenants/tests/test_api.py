"""Tenancy over REST: the current tenant's quota and usage, members, quotas, tokens — who may do
what, what outsiders get (404 and no data), and the audit log of every change."""
import threading
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from tenants import quotas
from tenants.models import ApiToken, AuditEntry, Membership
from tests.support.builders import client_for, logged_in, member
from tests.support.optional import skip_or_fail

pytestmark = pytest.mark.django_db


@pytest.fixture
def platform_admin():
    return get_user_model().objects.create_superuser("root", "root@example.org", "pw")


def test_current_tenant_shows_quota_usage_and_queue():
    alice = member("team-a", "alice")
    quotas.set_quota(alice.tenant, gpus=8, gpu_hours=100, budget_mode="soft")
    body = client_for(alice).get("/api/v1/tenants/current/").json()
    assert body["tenant"]["slug"] == "team-a" and body["role"] == "researcher"
    assert body["quota"]["gpus"] == 8 and body["quota"]["budget_mode"] == "soft" and body["quota"]["jobs"] is None
    assert body["usage"]["gpus"] == 0 and body["usage"]["gpu_hours"] == 0 and body["queued"]["jobs"] == 0
    assert body["usage"]["period_start"].startswith(body["history"][0]["period_start"][:10])


def test_only_platform_admins_change_quotas(platform_admin, django_capture_on_commit_callbacks):
    admin = member("team-a", "ada", role="admin")
    researcher = member("team-a", "alice")
    for membership in (admin, researcher):
        response = client_for(membership).patch("/api/v1/tenants/team-a/quota/", {"gpus": 99}, format="json")
        assert response.status_code == 403, response.content
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client_for(platform_admin).patch("/api/v1/tenants/team-a/quota/", {"gpus": 4, "jobs": 2},
                                                    format="json")
    assert response.status_code == 200 and response.json()["gpus"] == 4
    assert len(callbacks) == 1  # the scheduler re-runs at once for the tenant's queued jobs
    entry = AuditEntry.objects.get(target_type="quota")
    assert (entry.actor, entry.action, entry.before, entry.after["gpus"]) == ("root", "created", None, 4)


def test_a_quota_must_be_sane(platform_admin):
    member("team-a", "alice")
    for field in ("gpus", "cpus", "memory_bytes", "gpu_hours", "storage_bytes"):
        response = client_for(platform_admin).patch("/api/v1/tenants/team-a/quota/", {field: -1}, format="json")
        assert response.status_code == 400 and field in response.json(), field


def test_another_tenants_quota_is_not_found():
    member("team-a", "alice")
    bob = member("team-b", "bob", role="admin")
    assert client_for(bob).get("/api/v1/tenants/team-a/quota/").status_code == 404
    assert client_for(bob).patch("/api/v1/tenants/team-a/quota/", {"gpus": 1}, format="json").status_code == 404


def test_tenant_admins_manage_their_members_and_researchers_cannot():
    admin = member("team-a", "ada", role="admin")
    researcher = member("team-a", "alice")
    get_user_model().objects.create_user("newbie")
    refused = client_for(researcher).post("/api/v1/tenants/current/members/", {"username": "newbie"}, format="json")
    assert refused.status_code == 403
    invited = client_for(admin).post("/api/v1/tenants/current/members/", {"username": "newbie", "role": "viewer"},
                                     format="json")
    assert invited.status_code == 202 and invited.json()["role"] == "viewer"
    assert not Membership.objects.filter(user__username="newbie").exists()  # not before they accept
    newbie = client_for(get_user_model().objects.get(username="newbie"))
    waiting = newbie.get("/api/v1/invitations/").json()["results"]
    accepted = newbie.post(f"/api/v1/invitations/{waiting[0]['id']}/accept/")
    assert accepted.status_code == 200 and accepted.json() == {"tenant": {"slug": "team-a", "name": ""}, "role": "viewer"}
    changed = client_for(admin).patch("/api/v1/tenants/current/members/newbie/", {"role": "researcher"},
                                      format="json")
    assert changed.json()["role"] == "researcher"
    assert client_for(admin).delete("/api/v1/tenants/current/members/newbie/").status_code == 204
    names = [m["username"] for m in client_for(researcher).get("/api/v1/tenants/current/members/").json()["results"]]
    assert names == ["ada", "alice"]
    log = list(AuditEntry.objects.filter(target_type="membership", target="newbie@team-a").order_by("time", "id")
               .values_list("actor", "action", "after"))
    assert log == [("newbie", "created", {"user": "newbie", "role": "viewer"}),
                   ("ada", "changed", {"user": "newbie", "role": "researcher"}), ("ada", "deleted", None)]
    invitation_log = list(AuditEntry.objects.filter(target_type="invitation", target="newbie@team-a")
                          .order_by("time", "id").values_list("actor", "action"))
    assert invitation_log == [("ada", "created"), ("newbie", "deleted")]


def test_the_last_admin_cannot_leave():
    admin = member("team-a", "ada", role="admin")
    response = client_for(admin).delete("/api/v1/tenants/current/members/ada/")
    assert response.status_code == 400 and "last admin" in str(response.json())
    assert Membership.objects.filter(user=admin.user).exists()


def test_members_of_another_tenant_are_not_found():
    member("team-a", "alice")
    bob = member("team-b", "bob", role="admin")
    assert client_for(bob).delete("/api/v1/tenants/current/members/alice/").status_code == 404
    assert client_for(bob).patch("/api/v1/tenants/current/members/alice/", {"role": "viewer"},
                                 format="json").status_code == 404
    assert Membership.objects.filter(user__username="alice").exists()


def test_users_create_list_and_revoke_their_tokens():
    alice = member("team-a", "alice")
    client = client_for(alice)
    answer = client.post("/api/v1/tokens/", {"name": "laptop"}, format="json")
    created = answer.json()
    assert created["key"].startswith("ty_") and created["name"] == "laptop"
    assert "no-store" in answer["Cache-Control"]  # no browser or proxy keeps a copy of the key
    listed = client.get("/api/v1/tokens/").json()["results"]
    assert "key" not in listed[0] and {t["name"] for t in listed} == {"default", "laptop"}
    assert client.delete(f"/api/v1/tokens/{created['id']}/").json()["revoked_at"]
    revoked = APIClient()
    revoked.credentials(HTTP_AUTHORIZATION=f"Token {created['key']}")
    assert revoked.get("/api/v1/jobs/").status_code == 401
    assert AuditEntry.objects.filter(target_type="token", action="changed", actor="alice").exists()


def test_a_token_made_with_an_expiring_token_expires_with_it():
    alice = member("team-a", "alice")
    expiry = timezone.now() + timedelta(hours=1)
    _, key = ApiToken.issue(alice.user, "short", expires_at=expiry)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    created = client.post("/api/v1/tokens/", {"name": "lasting?"}, format="json").json()
    assert ApiToken.objects.get(pk=created["id"]).expires_at == expiry
    # Made in a session (the Account page) or with a lasting token, it lasts until revoked.
    assert client_for(alice).post("/api/v1/tokens/", {"name": "laptop"}, format="json").json()["expires_at"] is None


def test_a_user_holds_a_limited_number_of_live_tokens(monkeypatch):
    from tenants import people
    monkeypatch.setattr(people, "MAX_TOKENS", 3)
    alice = member()
    client = client_for(alice)  # one live token already
    made = [client.post("/api/v1/tokens/", {"name": f"t{i}"}, format="json") for i in range(3)]
    assert [answer.status_code for answer in made] == [201, 201, 409]
    assert made[2].json()["field"] == "name" and "at most 3" in made[2].json()["detail"]
    assert ApiToken.objects.filter(user=alice.user).count() == 3
    client.delete(f"/api/v1/tokens/{made[0].json()['id']}/")  # revoking one makes room
    assert client.post("/api/v1/tokens/", {"name": "again"}, format="json").status_code == 201
    page = logged_in(alice).post("/account/tokens/", {"action": "create", "name": "page"}, follow=True)
    assert "3 of your tokens may be live at once" in page.content.decode()
    assert ApiToken.objects.filter(user=alice.user, revoked_at=None).count() == 3


def test_a_token_needs_a_name():
    response = client_for(member()).post("/api/v1/tokens/", {"name": " "}, format="json")
    assert response.status_code == 400 and response.json()["field"] == "name"


@pytest.mark.parametrize("name", ["a\\u0000b", "tab\\there", "lone \\udbeb surrogate"])
def test_a_token_name_with_a_control_character_or_a_lone_surrogate_is_a_400(name):
    """PostgreSQL cannot store a NUL (the fuzzer's 500, and every request after it in the transaction).
    The names are JSON escapes, as a client sends them."""
    response = client_for(member()).post("/api/v1/tokens/", f'{{"name": "{name}"}}', content_type="application/json")
    assert response.status_code == 400 and response.json()["field"] == "name"


@pytest.mark.parametrize("field, method, path, body", [
    ("username", "post", "/api/v1/tenants/current/members/", '{"username": "bob\\u0000"}'),
    ("tenant", "put", "/api/v1/account/default-tenant/", '{"tenant": "team-a\\u0000"}'),
])
def test_a_name_with_a_nul_is_a_400_naming_its_field(field, method, path, body):
    """PostgreSQL cannot compare a string holding a NUL: refused by name before any query is made."""
    admin = member("team-a", "ada", role="admin")
    response = getattr(client_for(admin), method)(path, body, content_type="application/json")
    assert response.status_code == 400 and response.json()["field"] == field


def test_a_tenant_named_with_a_nul_is_refused_by_name_or_as_no_such_tenant():
    client = client_for(member("team-a", "alice"))
    response = client.get("/api/v1/tenants/current/?tenant=team-a%00")  # as every query parameter with one
    assert response.status_code == 400 and response.json() == {"detail": "tenant: holds a NUL character",
                                                                "field": "tenant"}
    response = client.get("/api/v1/tenants/current/", HTTP_X_TRAINYARD_TENANT="team-a\x00")
    assert response.status_code == 403 and "there is no tenant" in response.json()["detail"]


def test_another_users_token_is_not_found():
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    theirs, _ = ApiToken.issue(alice.user, "ci")
    assert client_for(bob).delete(f"/api/v1/tokens/{theirs.pk}/").status_code == 404
    theirs.refresh_from_db()
    assert theirs.revoked_at is None
    # By name: a random token prefix in the listing may contain "ci" itself (it did, in a run of the suite).
    listed = client_for(bob).get("/api/v1/tokens/").json()["results"]
    assert listed and theirs.pk not in [token["id"] for token in listed]
    assert "ci" not in [token["name"] for token in listed]


def test_platform_admins_act_in_any_tenant(platform_admin):
    member("team-a", "alice")
    client = client_for(platform_admin)
    body = client.get("/api/v1/tenants/current/", HTTP_X_TRAINYARD_TENANT="team-a").json()
    assert body["tenant"]["slug"] == "team-a" and body["role"] == "admin"


def test_the_audit_log_names_the_command_that_changed_a_quota():
    from django.core.management import call_command
    member("team-a", "alice")
    call_command("tenant", "create", "team-a", "--gpus", "2")
    entry = AuditEntry.objects.get(target_type="quota")
    assert entry.actor.startswith("command:tenant create") and entry.after["gpus"] == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_admins_demoting_each_other_at_once_leave_one_admin_and_no_error(monkeypatch):
    from django.db import connection

    from tenants import people
    if connection.vendor != "postgresql":
        skip_or_fail("row locks need PostgreSQL (set DATABASE_URL)")
    alice, bob = member("team-a", "alice", "admin"), member("team-a", "bob", "admin")
    both_checked = threading.Barrier(2, timeout=2)
    checked = people._keep_an_admin

    def check_then_wait_for_the_other(leaving):
        checked(leaving)
        try:
            both_checked.wait()  # each then writes what the other's check read
        except threading.BrokenBarrierError:
            pass  # the other waits for this change to end
    monkeypatch.setattr(people, "_keep_an_admin", check_then_wait_for_the_other)
    outcomes = []

    def demote(target):
        try:
            people.change_role(Membership.objects.select_related("tenant", "user").get(pk=target.pk), "researcher")
            outcomes.append("demoted")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
        finally:
            connection.close()
    threads = [threading.Thread(target=demote, args=(target,)) for target in (alice, bob)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["PeopleError", "demoted"]
    assert Membership.objects.filter(tenant=alice.tenant, role="admin").count() == 1


def test_the_periodic_pass_deletes_tokens_long_revoked_or_expired():
    from tenants import people
    alice = member()
    now = timezone.now()
    long_ago = now - people.ENDED_KEPT - timedelta(seconds=1)
    tokens = {name: ApiToken.issue(alice.user, name)[0] for name in
              ("live", "revoked-long-ago", "expired-long-ago", "revoked-lately", "expired-lately", "expiring")}
    ApiToken.objects.filter(name="revoked-long-ago").update(revoked_at=long_ago)
    ApiToken.objects.filter(name="expired-long-ago").update(expires_at=long_ago)
    ApiToken.objects.filter(name="revoked-lately").update(revoked_at=now - timedelta(days=1))
    ApiToken.objects.filter(name="expired-lately").update(expires_at=now - timedelta(days=1))
    ApiToken.objects.filter(name="expiring").update(expires_at=now + timedelta(days=365))
    assert people.prune() == (2, 0)
    assert set(ApiToken.objects.values_list("name", flat=True)) == {
        "live", "revoked-lately", "expired-lately", "expiring"}
    assert AuditEntry.objects.filter(target_type="token", action="deleted", actor="system").count() == 2
    assert tokens["live"].pk in {t["id"] for t in client_for(alice).get("/api/v1/tokens/").json()["results"]}


def test_celery_beat_runs_the_periodic_pass(settings):
    from jobs import tasks
    from tenants import people
    alice = member()
    ApiToken.issue(alice.user, "revoked-long-ago")
    ApiToken.objects.update(revoked_at=timezone.now() - people.ENDED_KEPT - timedelta(seconds=1))
    assert "jobs.tasks.prune_people" in {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    tasks.prune_people()
    assert not ApiToken.objects.exists()


def test_making_and_revoking_tokens_in_a_loop_keeps_a_bounded_number_of_ended_ones(monkeypatch):
    from tenants import people
    monkeypatch.setattr(people, "MAX_ENDED_TOKENS", 3)
    alice = member()
    client = client_for(alice)
    for index in range(6):
        made = client.post("/api/v1/tokens/", {"name": f"t{index}"}, format="json").json()
        client.delete(f"/api/v1/tokens/{made['id']}/")
    assert client.post("/api/v1/tokens/", {"name": "last"}, format="json").status_code == 201
    ended = ApiToken.objects.filter(user=alice.user, revoked_at__isnull=False)
    assert sorted(ended.values_list("name", flat=True)) == ["t3", "t4", "t5"]  # the newest kept
    assert ApiToken.objects.filter(user=alice.user, revoked_at=None).count() == 2  # the client's own and "last"
