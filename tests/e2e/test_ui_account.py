"""The Members, Account and Webhooks pages in a real browser: laid out in cards like the jobs pages, and
an invitation waiting for its answer shown on the Account link wherever the user is."""
import pytest

from tests.support.pages import log_in, shoot

pytestmark = [pytest.mark.e2e, pytest.mark.browser]


def test_an_invitation_shows_on_the_account_link_until_it_is_answered(browser, live_platform):
    live_platform.manage("tenant", "create", "team-c")
    live_platform.manage("tenant", "adduser", "team-c", "carol", "--role", "admin", "--password", "carol-password")
    carol = log_in(browser, live_platform.url, "carol", "carol-password")
    carol.goto(f"{live_platform.url}/tenant/members/")
    assert carol.locator("[data-testid=members-page] section.card").count() == 2  # members, invite
    carol.get_by_label("Username").fill(live_platform.username)
    carol.get_by_role("button", name="Invite").click()
    carol.wait_for_selector(f"[data-testid=invitation-{live_platform.username}]")
    shoot(carol, "members-page.png")
    carol.close()

    alice = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    badge = alice.locator("[data-testid=account-link] [data-testid=invitation-badge]")
    assert badge.inner_text().startswith("1")  # on the jobs page, where she lands
    alice.get_by_role("navigation", name="Main").get_by_role("link", name="Account").click()
    invitation = alice.locator("[data-testid=invitation-team-c]")
    assert invitation.is_visible() and "carol" in invitation.inner_text()
    assert alice.locator("[data-testid=account-page] section.card").count() == 2  # invitations, tokens
    shoot(alice, "account-page.png")
    invitation.get_by_role("button", name="Accept").click()
    alice.wait_for_selector("[data-testid=invitation-team-c]", state="detached")
    assert badge.count() == 0
    alice.close()


def test_the_webhooks_page_is_laid_out_in_cards(browser, live_platform):
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/account/webhooks/")
    form = page.locator("[data-testid=webhooks-page] section.card form[aria-label='Add a webhook']")
    assert form.is_visible()
    assert form.locator("input[type=checkbox]").count() >= 10  # one per event
    page.close()
