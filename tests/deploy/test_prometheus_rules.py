"""deploy/prometheus/trainyard-rules.yml: Prometheus's own promtool finds its rules valid and its unit tests
(trainyard-rules.test.yml: the utilisation ratios and when each alert fires) pass, and every series it
reads is one the manual's "Operating Trainyard" page documents or one of its own recording rules."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.operating import documented_series
from tests.support.optional import skip_or_fail

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "trainyard-rules.yml"


@pytest.fixture
def promtool():
    path = shutil.which("promtool")
    if path is None:
        skip_or_fail("promtool (Debian's prometheus package) is not installed")
    return path


def test_promtool_finds_the_rules_valid_and_their_unit_tests_pass(promtool):
    for command in (["check", "rules", RULES.name], ["test", "rules", RULES.with_suffix(".test.yml").name]):
        result = subprocess.run([promtool, *command], cwd=RULES.parent, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_its_rules_read_documented_series_and_their_own_records_only():
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    documented = documented_series()
    for rule in rules:
        records = set(re.findall(r"\b(\w+:trainyard_\w+:\w+)", rule["expr"]))
        names = records | set(re.findall(r"(?<![\w:])(trainyard_\w+)", rule["expr"]))
        assert names, rule
        for name in names:
            assert name in documented or name in recorded, f"{rule.get('alert') or rule['record']} reads {name}"
    assert {"TrainyardTenantGpusUnderused", "TrainyardIdleGpuJobs"} <= {rule.get("alert") for rule in rules}
