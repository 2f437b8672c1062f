"""The admin console's tenant pages render usage against quota and save quota changes."""
import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from jobs.models import Status
from jobs.states import transition
from tenants import people, quotas
from tenants.models import ApiToken, AuditEntry, Membership, Quota, SsoIdentity
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client():
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.org", "pw"))
    return client


def test_the_tenant_list_shows_usage_bars(admin_client):
    alice = member("team-a", "alice")
    member("team-b", "bob")
    quotas.set_quota(alice.tenant, gpus=4, gpu_hours=10)
    transition(job(alice, gpus=3).id, Status.PENDING, actor="test")
    html = admin_client.get("/admin/tenants/tenant/").content.decode()
    assert "team-a" in html and "team-b" in html
    assert 'aria-valuenow="3"' in html and "3 / 4" in html  # GPUs in use against the quota
    assert "(no limit)" in html  # team-b has none


def test_the_tenant_page_shows_usage_and_history_and_saves_the_quota(admin_client):
    alice = member("team-a", "alice")
    quotas.set_quota(alice.tenant, jobs=0)
    page = admin_client.get(f"/admin/tenants/tenant/{alice.tenant.pk}/change/")
    html = page.content.decode()
    assert page.status_code == 200 and "History" in html and "GPU-hours this period" in html
    form = {"slug": "team-a", "name": "Team A",
            "quota-TOTAL_FORMS": "1", "quota-INITIAL_FORMS": "1", "quota-MIN_NUM_FORMS": "0",
            "quota-MAX_NUM_FORMS": "1", "quota-0-id": str(alice.tenant.quota.pk), "quota-0-tenant": str(alice.tenant.pk),
            "quota-0-jobs": "2", "quota-0-period": "month", "quota-0-budget_mode": "hard"}
    response = admin_client.post(f"/admin/tenants/tenant/{alice.tenant.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Quota.objects.get(tenant=alice.tenant).jobs == 2


@pytest.mark.parametrize("path", ["/admin/tenants/usagerecord/", "/admin/tenants/auditentry/",
                                  "/admin/tenants/apitoken/", "/admin/jobs/job/"])
def test_the_other_admin_lists_render(admin_client, path):
    alice = member("team-a", "alice")
    quotas.set_quota(alice.tenant, gpus=1)
    transition(job(alice).id, Status.PENDING, actor="test")
    assert admin_client.get(path).status_code == 200


def test_the_admin_console_never_shows_a_persons_refresh_token(admin_client):
    """The device flow's refresh token is a credential for the person's account at the identity provider."""
    identity = SsoIdentity.objects.create(user=member("team-a", "carol").user, issuer="https://id.example.org",
                                          subject="carol", refresh_token="rt-secret-0123456789")
    page = admin_client.get(f"/admin/tenants/ssoidentity/{identity.pk}/change/")
    assert page.status_code == 200 and "rt-secret-0123456789" not in page.content.decode()


def test_tokens_are_not_made_in_the_admin_console(admin_client):
    # One made there had an empty key hash: no key anyone saw, and a 500 at the second.
    assert admin_client.get("/admin/tenants/apitoken/add/").status_code == 403
    assert admin_client.post("/admin/tenants/apitoken/add/", {"name": "x"}).status_code == 403


@pytest.mark.django_db(transaction=True)
def test_a_platform_admin_deletes_a_tenant_with_members_and_its_log_keeps_the_entries():
    from tenants import people
    from tenants.models import AuditEntry, Tenant
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.org", "pw"))
    alice = member("team-a", "alice", role="admin")
    people.invite(alice.tenant, "bob", invited_by="alice")
    answer = client.post(f"/admin/tenants/tenant/{alice.tenant.pk}/delete/", {"post": "yes"})
    assert answer.status_code == 302
    assert not Tenant.objects.filter(slug="team-a").exists()
    assert AuditEntry.objects.filter(target_type="membership", action="deleted", target="alice@team-a").exists()


def _queries(client, path):
    with CaptureQueriesContext(connection) as queries:
        assert client.get(path).status_code == 200
    return len(queries)


def test_it_lists_the_audit_log_in_queries_that_do_not_grow_with_its_entries(admin_client):
    # Each entry names its tenant (a column that may be empty): read with the page, not one query a row.
    member("team-a", "alice")
    few = _queries(admin_client, "/admin/tenants/auditentry/")
    for i in range(10):
        member(f"team-{i}", f"user-{i}")
    assert AuditEntry.objects.count() > 10
    assert _queries(admin_client, "/admin/tenants/auditentry/") == few


def test_it_lists_tenants_at_two_queries_a_row_without_summing_their_stored_files_or_history(admin_client):
    # The list shows usage now and this period; a tenant's stored files and six periods of history,
    # read for every row, made every tenant's size the console's cost.
    quotas.set_quota(member("team-a", "alice").tenant, gpus=4)
    few = _queries(admin_client, "/admin/tenants/tenant/")
    for i in range(5):
        quotas.set_quota(member(f"team-{i}", f"user-{i}").tenant, gpus=2)
    with CaptureQueriesContext(connection) as many:
        assert admin_client.get("/admin/tenants/tenant/").status_code == 200
    assert len(many) - few <= 2 * 5
    assert not [q for q in many.captured_queries if "jobs_artifact" in q["sql"]]


def test_a_platform_admin_saves_the_quota_of_a_tenant_of_many_members(admin_client):
    # Every member's row posted with the quota's form passed Django's limit on a form's fields
    # (DATA_UPLOAD_MAX_NUMBER_FIELDS): a tenant of a few hundred members had a quota nobody could change.
    alice = member("team-a", "alice")
    users = get_user_model().objects.bulk_create(get_user_model()(username=f"user-{i}") for i in range(300))
    Membership.objects.bulk_create(Membership(tenant=alice.tenant, user=user) for user in users)
    quotas.set_quota(alice.tenant, jobs=0)
    page = admin_client.get(f"/admin/tenants/tenant/{alice.tenant.pk}/change/")
    form = {**_form_fields(page.content.decode()), "quota-0-jobs": "2"}
    response = admin_client.post(f"/admin/tenants/tenant/{alice.tenant.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Quota.objects.get(tenant=alice.tenant).jobs == 2


def _form_fields(html):
    """What a browser posts of the change form: every named input, select and textarea, as it stands."""
    from html.parser import HTMLParser

    class Form(HTMLParser):
        def __init__(self):
            super().__init__()
            self.fields, self.select, self.text = {}, None, None

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            name = attrs.get("name")
            if tag == "input" and name and attrs.get("type") not in ("submit", "button", "file"):
                if attrs.get("type") != "checkbox" or "checked" in attrs:
                    self.fields[name] = attrs.get("value") or ("on" if attrs.get("type") == "checkbox" else "")
            elif tag == "select" and name:
                self.select = name
                self.fields.setdefault(name, "")
            elif tag == "option" and self.select and "selected" in attrs:
                self.fields[self.select] = attrs.get("value", "")
            elif tag == "textarea" and name:
                self.text = name
                self.fields[name] = ""

        def handle_endtag(self, tag):
            if tag == "select":
                self.select = None
            elif tag == "textarea":
                self.text = None

        def handle_data(self, data):
            if self.text:
                self.fields[self.text] += data

    parser = Form()
    parser.feed(html)
    return parser.fields


def test_a_platform_admin_finds_a_tenants_members_from_its_page_and_adds_one(admin_client):
    alice = member("team-a", "alice")
    member("team-b", "bob")
    bob = get_user_model().objects.get(username="bob")
    html = admin_client.get(f"/admin/tenants/tenant/{alice.tenant.pk}/change/").content.decode()
    listed = f"/admin/tenants/membership/?tenant__id__exact={alice.tenant.pk}"
    assert f'href="{listed}"' in html and "1 member<" in html
    page = admin_client.get(listed).content.decode()
    assert "alice" in page and "bob" not in page
    added = admin_client.post("/admin/tenants/membership/add/",
                              {"tenant": alice.tenant.pk, "user": bob.pk, "role": "viewer"})
    assert added.status_code == 302
    assert Membership.objects.get(tenant=alice.tenant, user=bob).role == "viewer"
    assert AuditEntry.objects.filter(target_type="membership", action="created", target="bob@team-a").exists()


def test_the_admin_console_neither_hands_a_token_to_someone_else_nor_brings_a_revoked_one_back(admin_client):
    # Whoever holds a key would have acted as the person it was moved to; a revoked key is revoked for good.
    alice, bob = member("team-a", "alice"), member("team-a", "bob")
    token, key = ApiToken.issue(alice.user, "laptop")
    people.revoke_token(token)
    page = admin_client.get(f"/admin/tenants/apitoken/{token.pk}/change/")
    form = {**_form_fields(page.content.decode()), "user": str(bob.user.pk), "revoked_at_0": "", "revoked_at_1": "",
            "expires_at_0": "", "expires_at_1": ""}
    admin_client.post(f"/admin/tenants/apitoken/{token.pk}/change/", form)
    token.refresh_from_db()
    assert token.user == alice.user and token.revoked_at is not None
    assert ApiToken.authenticate(key) is None


def test_the_admin_console_revokes_a_token(admin_client):
    token, key = ApiToken.issue(member("team-a", "alice").user, "laptop")
    page = admin_client.get(f"/admin/tenants/apitoken/{token.pk}/change/")
    form = {**_form_fields(page.content.decode()), "revoked_at_0": "2026-01-02", "revoked_at_1": "03:04:05"}
    assert admin_client.post(f"/admin/tenants/apitoken/{token.pk}/change/", form).status_code == 302
    assert ApiToken.authenticate(key) is None


def test_the_admin_console_does_not_move_a_membership_to_another_person(admin_client):
    # Moved, it would keep what was shared with its first person; delete it and add the other instead.
    alice, bob = member("team-a", "alice"), get_user_model().objects.create_user("bob")
    page = admin_client.get(f"/admin/tenants/membership/{alice.pk}/change/")
    form = {**_form_fields(page.content.decode()), "user": str(bob.pk), "role": "viewer"}
    assert admin_client.post(f"/admin/tenants/membership/{alice.pk}/change/", form).status_code == 302
    alice.refresh_from_db()
    assert alice.user.username == "alice" and alice.role == "viewer"
