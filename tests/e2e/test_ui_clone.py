"""Clone in a real browser: a job's page shows what it ran, and Clone opens the submit form filled in
with its manifest and its code offered again; submitting the clone runs a new job on the same code."""
import re

import pytest

from tests.support.pages import log_in, shoot, wait_status

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

MANIFEST = """name: clone-me
description: a run to vary
cpus: 0.5
memory: 256MiB
framework:
  name: custom
  command: bash run.sh
"""


def test_clone_opens_the_submit_form_filled_in_and_runs_the_same_code(browser, live_platform):
    source = live_platform.submit("custom-shell", manifest_text=MANIFEST)
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/jobs/{source['id']}/")
    assert page.get_by_test_id("run-command").inner_text() == "bash run.sh"
    assert "description: a run to vary" in page.get_by_test_id("manifest-yaml").inner_text()
    shoot(page, "clone-job-page.png")

    page.get_by_role("link", name="Clone").click()
    page.wait_for_url(f"{live_platform.url}/submit/?clone={source['id']}")
    editor = page.get_by_test_id("manifest")
    assert editor.input_value() == MANIFEST
    assert page.get_by_test_id("reuse-code").is_checked()
    assert source["id"] in page.get_by_test_id("clone-note").inner_text()
    page.wait_for_selector("[data-testid=manifest-status][data-state=valid]")
    assert page.locator("[data-fact=cpus]").inner_text() == "0.5"
    shoot(page, "clone-submit-form.png")

    editor.fill(MANIFEST.replace("name: clone-me", "name: clone-me-2").replace("bash run.sh", "STEPS=3 bash run.sh"))
    page.get_by_test_id("submit").click()
    page.wait_for_url(re.compile(re.escape(live_platform.url) + r"/jobs/training-[a-z0-9]+/$"))
    assert page.get_by_role("heading", name="clone-me-2").is_visible()
    assert page.get_by_test_id("run-command").inner_text() == "STEPS=3 bash run.sh"
    clone_id = page.get_by_test_id("job-id").inner_text()
    wait_status(page, "COMPLETED", "FAILED")
    clone = live_platform.wait_for(clone_id)
    assert clone["status"] == "COMPLETED", clone.get("status_reason")
    assert (clone["code_sha256"], clone["code_bytes"]) == (source["code_sha256"], source["code_bytes"])
    assert any("3 steps" in line["line"] for line in live_platform.all_logs(clone_id))
    page.close()
