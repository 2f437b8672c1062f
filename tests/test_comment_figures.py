"""Comments and docstrings of the shipped packages give the reason, not the figures of a run: timings,
profiles and bench runs belong in bench/results and docs/testing.md, where they are kept current."""
import ast
import io
import re
import tokenize

import pytest

from tests.support.shipped import PACKAGES, ROOT

# Milliseconds, seconds with a fraction (a timing, not a setting's whole seconds), a profiler, a
# bench run named, or a machine's state: a run's figures, not the code's reasons.
FIGURES = re.compile(r"\d+(\.\d+)? ?(ms|µs)\b|\b\d+\.\d+ ?s\b|py-spy|idle machine|"
                     r"(?<!-m )\bbench\s+(controlplane|concurrency|frameworks|overhead|recovery|scheduler|ui)\b")


def commentary(source):
    """(line number, text) of each comment and whole docstring in `source` (a figure's words may
    run across a docstring's lines)."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def figures(source):
    """(line number, line) of each comment or docstring line where a run's figure starts."""
    found = []
    for start, text in commentary(source):
        for match in FIGURES.finditer(text):
            line = text.count("\n", 0, match.start())
            found.append((start + line, text.splitlines()[line].strip()))
    return sorted(set(found))


def shipped_modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/tests/" in relative or "/migrations/" in relative:
                continue
            yield relative


def test_a_figure_in_a_comment_or_docstring_is_found():
    source = ('"""Fast.\n\nIt took 12 ms (bench controlplane)."""\nX = 1  # py-spy: a third of the loop\n'
              'def f():\n    """0.5ms each."""\n# a minute, a 64-byte record, the bench compares policies\n'
              'def g():\n    """Slow rows (under load, bench\n    controlplane)."""\n'
              '# waits 5 s, then 60 s\n# 0.4 s of a cycle\n# faster on an idle machine\n')
    assert [n for n, _ in figures(source)] == [3, 4, 6, 9, 12, 13]


@pytest.mark.parametrize("module", list(shipped_modules()))
def test_comments_carry_no_figures_of_a_run(module):
    lines = [f"{module}:{n}: {text}" for n, text in figures((ROOT / module).read_text())]
    assert lines == []
