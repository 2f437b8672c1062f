"""The admin console in a real Chromium against the real platform: a platform admin sees tenants
with usage bars, raises a quota, and the tenant's queued job starts with no other action."""
import time

import pytest

from tests.support.pages import SCREENSHOTS

pytestmark = [pytest.mark.e2e, pytest.mark.browser]


def test_raising_a_quota_in_the_admin_console_starts_the_queued_job(live_platform, browser):
    session = live_platform
    token = session.add_member("team-quota", "quinn")
    session.manage("tenant", "create", "team-quota", "--jobs", "0", "--gpu-hours", "10")
    job = session.submit("custom-shell", token=token)
    for _ in range(100):  # the first scheduling pass writes the reason
        waiting = session.job(job["id"], token=token)
        if waiting["wait_reason"]:
            break
        time.sleep(0.1)
    assert waiting["status"] == "QUEUED" and "concurrent jobs 0/0" in waiting["wait_reason"]
    session.manage("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.org",
                   env={"DJANGO_SUPERUSER_PASSWORD": "root-password"})

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(60_000)
    page.goto(session.url + "/admin/tenants/tenant/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill("root-password")
    page.get_by_role("button", name="Log in").click()
    row = page.locator("#result_list tr", has_text="team-quota")
    row.wait_for()
    assert row.locator(".ty-bar").count() >= 2  # jobs and GPU-hours against their limits
    assert "0 / 0" in row.inner_text()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "admin-tenants.png"), full_page=True)

    row.get_by_role("link", name="team-quota").click()
    page.locator("#id_quota-0-jobs").fill("1")  # the quota inline (its empty template has the same label)
    page.get_by_role("button", name="Save", exact=True).click()
    page.locator(".messagelist .success").wait_for()

    session.wait_for(job["id"], {"PENDING", "DOWNLOADING", "PROCESSING", "STORING", "COMPLETED"}, timeout=60,
                     token=token)
    assert session.wait_for(job["id"], timeout=120, token=token)["status"] == "COMPLETED"
    audit = session.manage("shell", "-c", "from tenants.models import AuditEntry; "
                                          "e = AuditEntry.objects.filter(target='team-quota').first(); "
                                          "print(e.actor, e.before['jobs'], e.after['jobs'])")
    assert audit.splitlines()[-1] == "root 0 1"
