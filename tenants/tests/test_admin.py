"""The admin console's tenant pages render usage against quota and save quota changes."""
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from jobs.models import Status
from jobs.states import transition
from tenants import quotas
from tenants.models import Quota, SsoIdentity
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
            "quota-0-jobs": "2", "quota-0-period": "month", "quota-0-budget_mode": "hard",
            "memberships-TOTAL_FORMS": "1", "memberships-INITIAL_FORMS": "1", "memberships-MIN_NUM_FORMS": "0",
            "memberships-MAX_NUM_FORMS": "1000", "memberships-0-id": str(alice.pk),
            "memberships-0-tenant": str(alice.tenant.pk), "memberships-0-user": str(alice.user.pk),
            "memberships-0-role": "researcher"}
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
