"""An experiment started from the browser on the live platform: New experiment from the PyTorch
example's sweep, made small, runs its real trials to completion while its page follows them."""
import re

import pytest
import yaml

from tests.support.pages import log_in, shoot

pytestmark = [pytest.mark.e2e, pytest.mark.browser]


def test_an_asha_sweep_started_in_the_browser_runs_to_completion(browser, live_platform):
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/experiments/new/?example=pytorch-digits")
    editor = page.get_by_test_id("manifest")
    spec = yaml.safe_load(editor.input_value())
    assert spec["searcher"]["name"] == "asha" and set(spec["hyperparameters"]) == {"lr", "width", "batch_size"}
    spec["name"] = "browser-sweep"
    spec["searcher"].update(max_trials=3, max_concurrent_trials=3, max_length=2)
    spec["framework"]["command"] = spec["framework"]["command"].replace("--epochs 9", "--epochs 2")
    editor.fill(yaml.safe_dump(spec, sort_keys=False))
    page.get_by_test_id("submit").click()
    page.wait_for_url(re.compile(re.escape(live_platform.url) + r"/experiments/exp-[a-z0-9]+/$"))
    experiment_id = page.get_by_test_id("experiment-id").inner_text().strip()
    page.wait_for_selector("[data-testid=experiment-state]:has-text('COMPLETED')", timeout=240_000)
    shown = live_platform.api("GET", f"/api/v1/experiments/{experiment_id}/").json()
    assert shown["state"] == "COMPLETED" and len(shown["trials"]) == 3
    assert {t["state"] for t in shown["trials"]} <= {"completed", "stopped"}
    best = page.get_by_test_id("best-trial-link")
    assert best.is_visible() and f"trial {shown['best_trial']}" in best.inner_text()
    assert page.locator("[data-testid=trial-charts] canvas, [data-testid=trial-charts] svg").count() >= 1
    shoot(page, "experiment-run.png")
    page.close()
