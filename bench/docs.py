"""The manual's benchmarks page, written from bench/results/*.json: `python -m bench.docs` rewrites
docs/benchmarks.md, and tests/test_docs.py fails while the page is not what the results say."""
import json
import sys
from pathlib import Path

from bench.report import RESULTS
from bench.targets import BENCHES

PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
VERDICT = {True: "met", False: "**missed**", None: ""}

INTRO = """# Benchmarks

This page is written from `bench/results/*.json` by `python -m bench.docs`; CI checks that it matches
them. `make bench` runs every benchmark, `python -m bench NAME` one of them; each prints a table and
writes its figures to `bench/results/NAME.json`, including many more than the headline figures here.

The machines these run on drift 2–3× by the hour, so a figure is a ratio against a baseline measured
in the same run wherever one applies. A figure whose interval straddles its target is reported as
measured.
"""


def render(results_dir=RESULTS):
    parts = [INTRO]
    for bench in BENCHES:
        results = _read(Path(results_dir) / f"{bench.name}.json")
        parts.append(f"\n## {bench.name}\n\n{bench.method}\n")
        if results is None:
            parts.append("\nNot measured yet.\n")
            continue
        beside = results.get("beside")  # the old code's figures from the same sitting (bench.beside)
        parts.append(f"\nMeasured {results.get('measured_at', 'at an unrecorded time')} on "
                     f"{results.get('machine', 'an unrecorded machine')} (`bench/results/{bench.name}.json`)")
        if beside:
            parts.append(f", beside revision `{beside['revision']}` measured right before it on the same machine "
                         f"(`python -m bench {bench.name} --beside {beside['revision']}`)")
        parts.append(".\n\n| figure | key | value | target | |" + (f" `{beside['revision']}` |" if beside else "")
                     + "\n|---|---|---|---|---|" + ("---|" if beside else "") + "\n")
        for figure in bench.figures:
            value = results.get(figure.key)
            parts.append(f"| {figure.meaning} | `{figure.key}` | {_shown(value)} | {figure.target} | "
                         f"{VERDICT[figure.met(value)]} |" + (f" {_shown(beside['figures'].get(figure.key))} |"
                                                             if beside else "") + "\n")
    return "".join(parts)


def _read(path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _shown(value):
    return "not measured" if value is None else _number(value)


def _number(value):
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def main():
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    sys.exit(main())
