"""Comments and docstrings of the shipped packages give the reason, not the figures of a run: timings,
profiles and bench runs belong in bench/results and docs/testing.md, where they are kept current."""
import ast
import io
import re
import tokenize

import pytest

from tests.support.shipped import PACKAGES, ROOT

FIGURES = re.compile(r"\d+(\.\d+)? ?(ms|µs)\b|py-spy|(?<!-m )\bbench (controlplane|concurrency|frameworks|overhead|recovery|"
                     r"scheduler|ui)\b")


def commentary(source):
    """(line number, text) of each comment and docstring in `source`."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return found


def shipped_modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/tests/" in relative or "/migrations/" in relative:
                continue
            yield relative


def test_a_figure_in_a_comment_or_docstring_is_found():
    source = ('"""Fast.\n\nIt took 12 ms (bench controlplane)."""\nX = 1  # py-spy: a third of the loop\n'
              'def f():\n    """0.5ms each."""\n# a minute, a 64-byte record, the bench compares policies\n')
    assert sorted(n for n, text in commentary(source) if FIGURES.search(text)) == [3, 4, 6]


@pytest.mark.parametrize("module", list(shipped_modules()))
def test_comments_carry_no_figures_of_a_run(module):
    lines = [f"{module}:{n}: {text.strip()}" for n, text in commentary((ROOT / module).read_text())
             if FIGURES.search(text)]
    assert lines == []
