"""What `pip install` gets holds no test code: each distribution in the repository (its pyproject.toml),
built as a wheel from a copy of the working tree, has no tests package, no test-support builders or
fakes, no conftest and no benchmark."""
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.shipped import ROOT

NOT_SOURCE = ("*.egg-info", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis")
NOT_COPIED = (".git", ".venv", "node_modules", "var", *NOT_SOURCE)
PROJECTS = sorted(p.parent.relative_to(ROOT).as_posix()
                  for p in [ROOT / "pyproject.toml", *ROOT.glob("*/pyproject.toml")]
                  if not any(part in (".venv", "node_modules") for part in p.parts))


def test_code_in_a_wheel_is_flagged(tmp_path):
    """The check itself: a wheel holding a test package, a builder, a conftest or a bench module is named."""
    wheel = tmp_path / "bad-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("jobs/__init__.py", "jobs/tests/__init__.py", "tests/support/builders.py", "conftest.py",
                     "bench/__main__.py", "gpu_scheduler/core.py"):
            zf.writestr(name, "")
    assert members_that_are_tests(wheel) == ["bench/__main__.py", "conftest.py", "jobs/tests/__init__.py",
                                   "tests/support/builders.py"]


@pytest.mark.parametrize("project", PROJECTS)
def test_the_wheel_holds_no_test_code(project, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_COPIED))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheels"), str(source / project)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (tmp_path / "wheels").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith("/__init__.py") for name in names), f"{wheel.name} holds no package: {names}"
    assert members_that_are_tests(wheel) == []


def members_that_are_tests(wheel):
    """The members of `wheel` that are test code, sorted."""
    found = []
    for name in zipfile.ZipFile(wheel).namelist():
        parts = name.split("/")
        if (parts[0] in ("tests", "bench") or "tests" in parts[:-1] or parts[-1] in ("conftest.py", "builders.py")
                or parts[-1].startswith("test_")):
            found.append(name)
    return sorted(found)
