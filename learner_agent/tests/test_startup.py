"""What a learner waits for before its command starts: the agent's and the launcher's interpreter start-ups.

Both run once per learner, in series, so what they import is paid on every job. They need only the
standard library (the agent also runs in any container image on Kubernetes), which lets them skip
site-packages; these tests keep it that way.
"""
import json
import os
import subprocess
import sys
import tempfile
import venv

import pytest

from learner_agent import sandbox
from learner_agent.agent import agent_argv, clean_environment
from tests.support.agent_runs import wait_for, write_agent_config


def _imported(argv, *, env, cwd=None):
    """Module names the interpreter `argv` starts imported (python -X importtime), and its stderr."""
    argv = [argv[0], "-X", "importtime", *argv[1:]]
    result = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, timeout=60)
    modules = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    return modules, result.stderr


def test_the_agent_starts_without_site_packages_and_with_only_what_starting_the_command_needs():
    env = clean_environment({"PATH": os.environ.get("PATH", os.defpath)})
    modules, stderr = _imported(agent_argv("/nonexistent/agent.json"), env=env)
    assert "learner_agent.agent" in modules, stderr
    assert "site" not in modules
    # What only sending needs is imported on the shipping thread, after the command has started.
    assert "http.client" not in modules and "learner_agent.netns" not in modules
    assert "/nonexistent/agent.json" in stderr  # and it said what was wrong with its config


def test_the_agent_needs_nothing_outside_the_standard_library():
    """Also what lets it run in any container image on Kubernetes (jobs.backends.k8s copies it in)."""
    env = clean_environment({"PATH": os.environ.get("PATH", os.defpath)})
    interpreter = agent_argv("unused")[:2]
    listing = ("import sys, sysconfig, learner_agent.agent, learner_agent.shipper, learner_agent.netns, http.client\n"
               "stdlib = (sysconfig.get_paths()['stdlib'], sysconfig.get_paths()['platstdlib'])\n"
               "for m in list(sys.modules.values()):\n"
               "    f = getattr(m, '__file__', None) or ''\n"
               "    if f and not f.startswith(stdlib) and '/learner_agent/' not in f: print(f)\n")
    result = subprocess.run([*interpreter, "-c", listing], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_the_launcher_imports_neither_site_nor_this_package(tmp_path):
    # As the agent starts it (a fixed environment, from the package's parent); fd 99 is not a plan,
    # so it stops right after its imports with the launcher's own error.
    argv = sandbox.launcher_argv(99)
    modules, stderr = _imported(argv, env={"PATH": os.defpath, "LANG": "C.UTF-8"}, cwd=sandbox.PACKAGE_PARENT)
    assert "trainyard sandbox: the learner could not be started" in stderr
    assert "site" not in modules
    assert not {m for m in modules if m.startswith("learner_agent")}


def test_the_launcher_ignores_python_variables_and_its_own_folder(tmp_path):
    """-I: it may run as root until it drops to the learner's uid, so nothing on its path is anyone's."""
    (tmp_path / "json.py").write_text("raise SystemExit('imported the planted json')\n")
    argv = sandbox.launcher_argv(99)
    result = subprocess.run(argv, env={"PATH": os.defpath, "PYTHONPATH": str(tmp_path), "PYTHONSTARTUP": "x"},
                            cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert "planted" not in result.stderr
    assert "trainyard sandbox: the learner could not be started" in result.stderr


@pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason=f"bubblewrap unusable here: {sandbox.bwrap_problem()}")
def test_a_sandboxed_learner_finds_the_platforms_python_in_a_virtual_environment_under_tmp(outside_tmp, ingest):
    """Without site (-S) sys.prefix is not the virtual environment; a checkout in /tmp (CI's) has its
    environment under the dir the sandbox hides, and the learner's `python` went missing with it."""
    with tempfile.TemporaryDirectory(prefix="trainyard-venv-", dir="/tmp") as environment:
        os.chmod(environment, 0o755)  # like a checkout's: the learner's uid may enter it
        venv.EnvBuilder(with_pip=False, system_site_packages=True).create(environment)
        python = os.path.join(environment, "bin", "python")
        config = write_agent_config(outside_tmp, ingest, command="python -c 'import sys; print(sys.prefix)'",
                                    sandbox="bwrap")
        env = clean_environment({"PATH": f"{os.path.dirname(python)}:{os.environ.get('PATH', os.defpath)}"})
        subprocess.run([python, *agent_argv(config)[1:]], env=env, cwd=os.path.dirname(config), timeout=60,
                       stdin=subprocess.DEVNULL, capture_output=True)
        exit_file = os.path.join(os.path.dirname(config), "exit.json")
        assert wait_for(lambda: os.path.exists(exit_file), timeout=30)
        lines = [r["line"] for r in ingest.stored() if r["kind"] == "log"]
        assert json.loads(open(exit_file).read())["exit_code"] == 0, lines
        assert lines == [environment]
