"""Who may submit `priority: high`: the platform's default (tenant admins only), a tenant's own
setting in its quota, and a refusal at submit that names the rule and stores nothing."""
import pytest
from django.contrib.auth import get_user_model

from jobs.models import Job
from tenants import quotas
from tests.support.builders import client_for, member, tar_gz, upload

pytestmark = pytest.mark.django_db
CODE = tar_gz({"run.sh": b"echo hi\n"})


def submit(who, priority, **headers):
    """POST a small job of this priority as `who` (a membership, or a user)."""
    manifest = (f"name: p\ncpus: 0.5\nmemory: 128MiB\npriority: {priority}\n"
                "framework: {name: custom, command: sh run.sh}\n").encode()
    files = {"manifest": upload(manifest, "manifest.yml"), "code": upload(CODE)}
    return client_for(who).post("/api/v1/jobs/", files, format="multipart", **headers)


@pytest.mark.parametrize("role, priority, status", [
    ("researcher", "high", 403),
    ("researcher", "normal", 201),
    ("researcher", "low", 201),
    ("admin", "high", 201),
])
def test_by_default_only_tenant_admins_may_ask_for_high(role, priority, status):
    response = submit(member("team-b", "mallory", role=role), priority)
    assert response.status_code == status, response.json()
    if status == 403:
        body = response.json()
        assert body["field"] == "priority"
        assert ("priority high is refused: in tenant 'team-b' it is for tenant admins only (the platform's "
                "default TRAINYARD_HIGH_PRIORITY=admins) and your role is researcher") in body["detail"]
        assert not Job.objects.exists()  # nothing stored


@pytest.mark.parametrize("platform, tenant_rule, role, status, says", [
    ("everyone", "", "researcher", 201, None),
    ("nobody", "", "admin", 403, "it is for nobody (the platform's default TRAINYARD_HIGH_PRIORITY=nobody)"),
    ("admins", "everyone", "researcher", 201, None),  # the tenant's own setting wins
    ("everyone", "admins", "researcher", 403, "tenant team-b's quota setting high_priority=admins"),
    ("everyone", "nobody", "admin", 403, "it is for nobody (tenant team-b's quota setting high_priority=nobody)"),
])
def test_the_platform_setting_and_a_tenants_own(settings, platform, tenant_rule, role, status, says):
    settings.HIGH_PRIORITY = platform
    mallory = member("team-b", "mallory", role=role)
    quotas.set_quota(mallory.tenant, high_priority=tenant_rule)
    response = submit(mallory, "high")
    assert response.status_code == status, response.json()
    if says:
        assert says in response.json()["detail"]


def test_a_platform_admin_acting_in_a_tenant_is_its_admin():
    member("team-b", "mallory")  # the tenant exists
    root = get_user_model().objects.create(username="root", is_superuser=True, is_staff=True)
    response = submit(root, "high", HTTP_X_TRAINYARD_TENANT="team-b")
    assert response.status_code == 201, response.json()


def test_the_quota_api_shows_and_takes_the_setting():
    mallory = member("team-b", "mallory", role="admin")
    assert client_for(mallory).get("/api/v1/tenants/current/").json()["quota"]["high_priority"] == ""
    with pytest.raises(Exception, match="not a valid choice"):
        quotas.set_quota(mallory.tenant, high_priority="anyone")
    quotas.set_quota(mallory.tenant, high_priority="everyone")
    assert client_for(mallory).get("/api/v1/tenants/current/").json()["quota"]["high_priority"] == "everyone"
