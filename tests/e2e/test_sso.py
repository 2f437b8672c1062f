"""Single sign-on end to end, against a real OpenID provider (npm's oidc-provider, its own node process)
and the test's own server (pytest-django's live_server): a person signs in through the provider in a
real Chromium, lands in the tenant their group maps to with the mapped role, and loses it once the
provider takes them out of the group; `trainyard login --sso` gets a token through the device flow."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import requests

from tenants.models import AuditEntry, Membership, Tenant
from tests.support import oidc
from tests.support.pages import WAIT_MS

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def idp(live_server, settings, tmp_path):
    provider = oidc.Provider(tmp_path / "oidc", redirect_uris=[f"{live_server.url}/sso/callback/"],
                             accounts={"carol": {"groups": ["ml-vision"]}})
    provider.start()
    for name, value in provider.settings(OIDC_GROUP_MAP="ml-vision=vision:researcher ml-leads=vision:admin").items():
        setattr(settings, name, value)
    settings.OIDC_RECHECK_S = 300
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    Tenant.objects.create(slug="vision", name="Vision")
    yield provider
    provider.stop()


@pytest.mark.browser
def test_a_person_signs_in_through_the_provider_and_loses_the_tenant_with_the_group(idp, server_browser, live_server,
                                                                                     settings):
    page = server_browser.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{live_server.url}/login/")
    page.get_by_test_id("sso-login").click()
    page.wait_for_url(re.compile(re.escape(idp.issuer)))  # the provider's own sign-in page
    page.locator("input[name=login]").fill("carol")
    page.locator("input[name=password]").fill("whatever the provider asks")
    page.get_by_role("button", name="Sign-in").click()
    page.wait_for_url(f"{live_server.url}/")

    current = page.request.get(f"{live_server.url}/api/v1/tenants/current/").json()
    assert current["tenant"]["slug"] == "vision" and current["role"] == "researcher"
    assert page.get_by_test_id("no-tenant").count() == 0

    idp.set_accounts({"carol": {"groups": []}})
    settings.OIDC_RECHECK_S = 1
    time.sleep(1.2)
    page.goto(f"{live_server.url}/")
    page.get_by_test_id("no-tenant").wait_for()
    assert page.request.get(f"{live_server.url}/api/v1/tenants/current/").status == 403
    assert not Membership.objects.filter(user__username="carol").exists()
    reason = AuditEntry.objects.get(target="carol@vision", action="deleted").after["reason"]
    assert reason == "the identity provider no longer has carol in ml-leads or ml-vision"


def test_trainyard_login_sso_gets_a_token_through_the_device_flow(idp, live_server, tmp_path):
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"), HOME=str(tmp_path))
    env.pop("TRAINYARD_TOKEN", None)
    cli = subprocess.Popen([sys.executable, "-m", "trainyard", "login", "--url", live_server.url, "--sso"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        prompt = cli.stderr.readline()
        link = re.search(r"open (\S+) and confirm the code (\S+)", prompt)
        assert link, prompt
        assert "Sign-in Success" in oidc.complete_device_flow(link.group(1), "carol")
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    assert "signed in as carol" in err and f"logged in to {live_server.url}: tenant vision as researcher" in out

    saved = json.loads((tmp_path / "config" / "trainyard" / "config.json").read_text())
    answer = requests.get(f"{live_server.url}/api/v1/tokens/", headers={"Authorization": f"Token {saved['token']}"},
                          timeout=10).json()
    assert [(t["name"], bool(t["expires_at"])) for t in answer["results"]] == [("trainyard login --sso", True)]
