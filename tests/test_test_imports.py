"""Test modules share code through tests.support (builders, fakes, fixtures) or a helper module of
their own suite, never by importing another test module, a conftest or a shipped package's tests: a
test module imported elsewhere drags its tests and fixtures along by name, and ties one suite's
refactoring to another's."""
import ast

import pytest

from tests.support.shipped import PACKAGES, ROOT

SUITES = ("tests", "bench", *PACKAGES)


def modules_of_tests():
    for top in SUITES:
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if top == "bench" or "tests" in relative.parts[:-1]:
                if "support" not in relative.parts:
                    yield relative.as_posix()


def imports_of_test_code(source):
    """The modules `source` imports that are test modules, conftests or a shipped package's tests."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append("." * node.level + (node.module or ""))
            continue
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            parts = name.split(".")
            if ("conftest" in parts or any(part.startswith("test_") for part in parts)
                    or (parts[0] in PACKAGES and "tests" in parts)):
                found.append(name)
    return found


def test_an_import_of_test_code_is_found():
    source = ("import os\nfrom conftest import skip_or_fail\nfrom jobs.tests.builders import job\n"
              "from tests.e2e.test_browser import log_in\nimport tests.chaos.invariants\n"
              "from tests.support.builders import member\nfrom . import helpers\n")
    assert imports_of_test_code(source) == ["conftest", "jobs.tests.builders", "tests.e2e.test_browser", "."]


@pytest.mark.parametrize("module", list(modules_of_tests()))
def test_it_imports_shared_test_code_from_tests_support_only(module):
    assert imports_of_test_code((ROOT / module).read_text()) == []
