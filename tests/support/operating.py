"""README's "Operating Trainyard" section as data: the series it documents, for the tests that hold
/metrics and the Grafana dashboard to it."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def documented_series():
    """{name: (type, label set)} from the table of README's "Operating Trainyard" section."""
    section = README.read_text().split("## Operating Trainyard", 1)[1].split("\n## ", 1)[0]
    series = {}
    for name, kind, labels in re.findall(r"^\| `(\w+)` \| (\w+) \|([^|]*)\|", section, re.M):
        # A label's example values follow it in brackets: `stream` (`job`, `list`).
        series[name] = (kind, frozenset(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels))))
    return series
