"""How every benchmark reports: a readable table, then its figures as one JSON object on the last
line, also written to bench/results/NAME.json."""
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values, fraction):
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def median(values):
    return statistics.median(values)


def publish(name, rows, figures):
    """rows: [(label, value, target-or-"")]; figures: the JSON object."""
    width = max(len(label) for label, _, _ in rows)
    print(f"\n{name}")
    print("-" * (width + 36))
    for label, value, target in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{label:<{width}}  {shown:>14}  {target}")
    figures = dict(figures, bench=name, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   machine=f"{platform.machine()} {platform.processor() or ''}".strip())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
