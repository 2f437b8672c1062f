"""The manual (docs/, built with MkDocs): it builds in strict mode, it names every setting and every
CLI command with its options, and its benchmarks page says what bench/results holds."""
import ast
import json
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from bench import beside as bench_beside
from bench import docs as bench_docs
from tests.support.optional import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("portal", "tenants", "jobs", "notifications", "gpu_scheduler", "learner_agent", "trainyard")
SETTING = re.compile(r"TRAINYARD_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL|REDIS_URL")


def manual():
    return "\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))


def settings_read_by_the_product():
    """{name: [module]} of every environment variable the shipped code names (a string literal that
    is a whole TRAINYARD_* name, DATABASE_URL or REDIS_URL)."""
    found = {}
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if {"tests", "migrations"} & set(path.parts):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and SETTING.fullmatch(node.value):
                    found.setdefault(node.value, []).append(str(path.relative_to(ROOT)))
    return found


def cli_help(*args):
    result = subprocess.run([sys.executable, "-m", "trainyard", *args, "--help"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def cli_commands():
    """The subcommands `trainyard --help` lists under COMMAND."""
    listing = cli_help().split("COMMAND\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in listing.splitlines() if re.match(r"^ {4}\S", line)]


def cli_options(command):
    """Each option of `trainyard COMMAND` as the tuple of its names (`-o`, `--output`), help aside."""
    options = []
    for line in cli_help(command).splitlines():
        if match := re.match(r"^  (-[^ ].*?)(?:  |$)", line):
            names = tuple(part.split()[0] for part in match.group(1).split(", "))
            if "--help" not in names:
                options.append(names)
    return options


def test_it_documents_every_setting():
    text = manual()
    missing = {name: modules for name, modules in settings_read_by_the_product().items()
               if not re.search(rf"(?<![A-Z0-9_]){name}(?![A-Z0-9_])", text)}
    assert not missing, f"settings the manual (docs/*.md) never names: {missing}"


def test_it_finds_settings_in_the_code():
    found = settings_read_by_the_product()
    assert {"DATABASE_URL", "REDIS_URL", "TRAINYARD_BACKEND", "TRAINYARD_URL"} <= set(found)


def test_it_documents_every_cli_command_and_option():
    commands = cli_commands()
    assert {"train", "logs", "login"} <= set(commands), commands
    page = (ROOT / "docs" / "cli.md").read_text()
    missing = []
    for command in commands:
        if f"`trainyard {command}" not in page:
            missing.append(command)
        row = next((line for line in page.splitlines() if line.startswith(f"| `trainyard {command}")), "")
        missing += [f"{command} {'/'.join(names)}" for names in cli_options(command)
                    if not any(re.search(rf"{name}(?![\w-])", row) for name in names)]
    assert not missing, f"CLI commands or options docs/cli.md's table does not show: {missing}"


def test_the_benchmarks_page_is_what_the_results_say():
    assert bench_docs.PAGE.read_text() == bench_docs.render(), (
        "docs/benchmarks.md is not what bench/results holds: run `python -m bench.docs`")


def test_the_benchmarks_page_states_a_missed_target(tmp_path):
    (tmp_path / "concurrency.json").write_text('{"jct_ratio_40_vs_1": 1.3, "jct_ratio_100_vs_1": 1.2}')
    page = bench_docs.render(tmp_path)
    assert "| `jct_ratio_40_vs_1` | 1.3 | ≤ 1.10 | **missed** |" in page
    assert "| `jct_ratio_100_vs_1` | 1.2 | ≤ 1.25 | met |" in page
    assert "## overhead\n" in page and "Not measured yet." in page


def test_the_old_codes_figures_from_the_same_sitting_stand_beside_the_new(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_beside, "RESULTS", tmp_path)
    (tmp_path / "concurrency.json").write_text('{"jct_ratio_40_vs_1": 1.05, "jct_ratio_100_vs_1": 1.3}')
    bench_beside.record("concurrency", "0432a7e", {"jct_ratio_40_vs_1": 1.08, "jct_ratio_100_vs_1": 1.2,
                                                   "measured_at": "2026-11-27T17:00:00Z", "sleep_s": 30})
    assert json.loads((tmp_path / "concurrency.json").read_text())["beside"] == {
        "revision": "0432a7e", "measured_at": "2026-11-27T17:00:00Z",
        "figures": {"jct_ratio_40_vs_1": 1.08, "jct_ratio_100_vs_1": 1.2}}
    page = bench_docs.render(tmp_path)
    assert "beside revision `0432a7e`" in page
    assert "| `jct_ratio_40_vs_1` | 1.05 | ≤ 1.10 | met | 1.08 |" in page
    assert "| `jct_ratio_100_vs_1` | 1.3 | ≤ 1.25 | **missed** | 1.2 |" in page


def test_the_manual_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        skip_or_fail("building the manual needs mkdocs-material (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()
