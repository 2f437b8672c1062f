"""The manual's "Operating Trainyard" page (docs/operating.md) as data: the series it documents, for the tests that hold
/metrics and the Grafana dashboard to it."""
import re
from pathlib import Path

OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


def documented_series():
    """{name: (type, label set)} from the table of the "Operating Trainyard" page."""
    section = OPERATING.read_text()
    series = {}
    for name, kind, labels in re.findall(r"^\| `(\w+)` \| (\w+) \|([^|]*)\|", section, re.M):
        # A label's example values follow it in brackets: `stream` (`job`, `list`).
        series[name] = (kind, frozenset(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels))))
    return series
