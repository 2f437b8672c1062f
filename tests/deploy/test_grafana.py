"""deploy/grafana/trainyard.json: a dashboard Grafana can import, whose panels query only the series
the manual's "Operating Trainyard" page documents, and every documented Trainyard series at least once."""
import json
import re
from pathlib import Path

from tests.support.operating import documented_series

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "trainyard.json"
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def queried_series(expr):
    return set(re.findall(r"\b((?:trainyard|django)_\w+)", expr))


def documented_name(series, documented):
    if series in documented:
        return series
    for part in HISTOGRAM_PARTS:
        base = series.removesuffix(part)
        if base != series and documented.get(base, ("",))[0] == "histogram":
            return base
    return None


def test_it_is_a_dashboard_whose_panels_query_documented_series_only():
    dashboard = json.loads(DASHBOARD.read_text())
    documented = documented_series()
    assert dashboard["title"] and dashboard["panels"]
    used = set()
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["targets"], panel.get("title")
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            names = queried_series(target["expr"])
            assert names, (panel["title"], target["expr"])
            for name in names:
                base = documented_name(name, documented)
                assert base, f"panel {panel['title']!r} queries {name}, which docs/operating.md does not document"
                used.add(base)
    trainyard = {name for name in documented if name.startswith("trainyard_")}
    assert trainyard - used == set(), "documented series without a panel"


def test_its_histogram_panels_ask_for_buckets_of_histograms_only():
    documented = documented_series()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            if "histogram_quantile" in target["expr"]:
                for name in queried_series(target["expr"]):
                    assert name.endswith("_bucket") and documented[name.removesuffix("_bucket")][0] == "histogram"
