"""`pip install trainyard` is the client alone: the wheel, built from a copy of the working tree and
installed into a fresh virtual environment, brings requests and the client's few libraries but not
Django (the server is the [server] extra); its `trainyard` command runs there, and `trainyard validate` applies the
manifest rules the server applies (trainyard.manifest, trainyard.elasticity)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.optional import skip_or_fail
from tests.support.shipped import ROOT

NOT_COPIED = (".git", ".venv", "node_modules", "var", "*.egg-info", "build", "dist", "__pycache__",
              ".pytest_cache", ".hypothesis")
# What pip prints when the index cannot be reached or holds no match: a machine without one skips.
UNREACHABLE = ("No matching distribution found", "Could not find a version", "Failed to establish",
               "Temporary failure in name resolution", "Network is unreachable", "ProxyError")
SERVER_DISTRIBUTIONS = {"django", "djangorestframework", "celery", "channels", "kubernetes", "psycopg2-binary"}
# Learner counts 3..4 find no global batch in 10..11 that splits evenly: a rule of trainyard.elasticity.
UNSPLITTABLE = """\
name: elastic
framework: {name: pytorch, version: "2.13", command: python train.py}
elastic:
  min_learners: 1
  max_learners: 4
  batch_size: {global: 10, min: 10, max: 11}
"""


@pytest.fixture(scope="module")
def client_env(tmp_path_factory):
    """A fresh virtual environment with the wheel of this working tree installed, without extras."""
    work = tmp_path_factory.mktemp("client-install")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_COPIED))
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                 "-w", str(work / "wheels"), str(source)], cwd=work)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (work / "wheels").glob("trainyard-*.whl")
    env = work / "venv"
    made = run([sys.executable, "-m", "venv", str(env)], cwd=work)
    assert made.returncode == 0, made.stdout + made.stderr
    installed = run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                     str(wheel)], cwd=work, timeout=600)
    if installed.returncode != 0 and any(sign in installed.stdout + installed.stderr for sign in UNREACHABLE):
        skip_or_fail(f"the client's dependencies cannot be installed here: {installed.stderr.strip()[-300:]}")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return env


def run(argv, *, cwd, timeout=300):
    """Run outside the repository, with nothing of this checkout or its settings on the path."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_it_installs_the_client_without_django(client_env):
    listed = run([str(client_env / "bin" / "python"), "-m", "pip", "list", "--format=json"], cwd=client_env)
    names = {entry["name"].lower() for entry in json.loads(listed.stdout)}
    assert {"trainyard", "requests", "requests-toolbelt", "tenacity", "pyyaml", "websockets", "pydantic"} <= names, names
    assert not names & SERVER_DISTRIBUTIONS, names & SERVER_DISTRIBUTIONS
    django = run([str(client_env / "bin" / "python"), "-c", "import django"], cwd=client_env)
    assert django.returncode != 0 and "No module named 'django'" in django.stderr, django.stderr


def test_its_command_runs(client_env):
    shown = run([str(client_env / "bin" / "trainyard"), "--help"], cwd=client_env)
    assert shown.returncode == 0, shown.stderr
    assert "validate" in shown.stdout and "train" in shown.stdout


def test_it_validates_manifests_with_the_servers_rules(client_env, tmp_path):
    example = ROOT / "examples" / "pytorch-elastic" / "manifest.yml"
    good = run([str(client_env / "bin" / "trainyard"), "validate", str(example)], cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    assert "ok" in good.stdout and "pytorch-elastic" in good.stdout

    bad = tmp_path / "manifest.yml"
    bad.write_text(UNSPLITTABLE)
    refused = run([str(client_env / "bin" / "trainyard"), "validate", str(bad)], cwd=tmp_path)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "elastic.batch_size" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
