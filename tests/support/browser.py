"""Driving the portal in a real Chromium, for the browser tests and `bench ui` alike: where Chromium
is, the flags it needs on a headless machine, and logging in through the login page."""
import os
import shutil
from pathlib import Path

CHROMIUM = os.environ.get("TRAINYARD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_found():
    return bool(shutil.which(CHROMIUM)) or Path(CHROMIUM).exists()


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def log_in(browser, url, username, password, *, timeout_ms):
    """A new page logged in as `username`, on the jobs page."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(timeout_ms)
    page.goto(url + "/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(url + "/")
    return page
