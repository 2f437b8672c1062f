"""What the learner can see and do: the environment always, the machine when bubblewrap is there."""
import json
import os

import pytest

from learner_agent import sandbox
from learner_agent.sandbox import SandboxError, build_argv, build_env
from learner_agent.tests.conftest import PACKAGE_PARENT, run_agent, write_agent_config

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_problem() is not None,
                                 reason=f"bubblewrap unusable here: {sandbox.bwrap_problem()}")

PROBE = r'''
import json, os, socket, sys
result = {}
def attempt(name, action):
    try:
        result[name] = ["ok", action()]
    except Exception as e:
        result[name] = ["error", type(e).__name__]
port, hidden, outside, readonly, results = sys.argv[1:6]
attempt("network", lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2).close())
attempt("hidden", lambda: os.listdir(hidden))
attempt("write_outside", lambda: open(os.path.join(outside, "escaped.txt"), "w").close())
attempt("write_readonly", lambda: open(os.path.join(readonly, "x.txt"), "w").close())
attempt("read_readonly", lambda: open(os.path.join(readonly, "input.txt")).read())
attempt("write_results", lambda: open(os.path.join(results, "model.txt"), "w").write("w"))
attempt("write_work", lambda: open("out.txt", "w").write("w"))
attempt("agent_config", lambda: open(os.path.join(os.path.dirname(os.getcwd()), "agent.json")).read())
def environ_with_secret():
    found = False
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            found = found or b"hunter2" in open(f"/proc/{pid}/environ", "rb").read()
        except OSError:  # exited, or not ours to read
            pass
    return found
attempt("agent_environ", environ_with_secret)
result["secret_env"] = os.environ.get("TRAINYARD_SECRET_KEY")
result["env_keys"] = sorted(os.environ)
print("PROBE " + json.dumps(result))
'''


def run_probe(base, ingest, *, mode):
    hidden = os.path.join(base, "platform-data")
    os.makedirs(hidden)
    open(os.path.join(hidden, "db.sqlite3"), "w").close()
    readonly = os.path.join(base, "job", "data")
    os.makedirs(readonly)
    with open(os.path.join(readonly, "input.txt"), "w") as f:
        f.write("data")
    results = os.path.join(base, "job", "results")
    config = write_agent_config(
        base, ingest, sandbox=mode, files={"probe.py": PROBE},
        command=f"python3 probe.py {ingest.port} {hidden} {base} {readonly} {results}",
        hidden_dirs=[hidden, os.path.join(base, "job")], readonly_dirs=[readonly], writable_dirs=[results],
        env={"DATA_DIR": readonly, "RESULT_DIR": results, "LEARNER_ID": "0"})
    result = run_agent(config, TRAINYARD_SECRET_KEY="hunter2")
    assert result.returncode == 0, result.stderr
    lines = [r["line"] for r in ingest.stored() if r["kind"] == "log"]
    probes = [line for line in lines if line.startswith("PROBE ")]
    assert probes, lines
    return json.loads(probes[0][len("PROBE "):])


@needs_bwrap
def test_bwrap_isolates_the_learner(outside_tmp, ingest):
    seen = run_probe(outside_tmp, ingest, mode="bwrap")
    assert seen["network"][0] == "error"  # the ingest server is listening, but not for the learner
    assert seen["hidden"] == ["ok", []]
    assert seen["write_outside"] == ["error", "OSError"]
    assert not os.path.exists(os.path.join(outside_tmp, "escaped.txt"))
    assert seen["write_readonly"] == ["error", "OSError"]
    assert seen["read_readonly"] == ["ok", "data"]
    assert seen["write_results"] == ["ok", 1]
    assert seen["write_work"] == ["ok", 1]
    assert seen["agent_config"][0] == "error"  # the agent's directory is hidden, its work/ is not
    assert seen["agent_environ"] == ["ok", False]
    assert seen["secret_env"] is None


def test_without_a_sandbox_the_learner_still_gets_no_platform_secrets(outside_tmp, ingest):
    seen = run_probe(outside_tmp, ingest, mode="none")
    assert seen["secret_env"] is None
    # Not even through the agent's /proc/<pid>/environ: the agent re-executed itself without it.
    assert seen["agent_environ"] == ["ok", False]
    assert "TRAINYARD_SECRET_KEY" not in seen["env_keys"]
    assert {"PATH", "HOME", "PYTHONPATH", "RESULT_DIR", "LEARNER_ID", "OMP_NUM_THREADS"} <= set(seen["env_keys"])


def test_the_environment_is_built_fresh(monkeypatch):
    monkeypatch.setenv("TRAINYARD_SECRET_KEY", "hunter2")
    monkeypatch.setenv("DATABASE_URL", "postgres://secret")
    env = build_env(work_dir="/w", cpus=1.5, learner_env={"LEARNER_ID": 3, "HOME": "/home/l"},
                    path="/usr/bin:/bin")
    assert env == {
        "PATH": "/usr/bin:/bin", "HOME": "/home/l", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": PACKAGE_PARENT, "TMPDIR": "/tmp", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
        "OPENBLAS_NUM_THREADS": "2", "LEARNER_ID": "3"}


def test_the_learner_may_extend_pythonpath_but_keeps_the_helper(monkeypatch):
    env = build_env(work_dir="/w", cpus=0.25, learner_env={"PYTHONPATH": "/w/src"})
    assert env["PYTHONPATH"] == f"{PACKAGE_PARENT}:/w/src"
    assert env["OMP_NUM_THREADS"] == "1"


def test_none_runs_a_plain_shell():
    assert build_argv("python train.py", mode="none", work_dir="/w") == ["/bin/sh", "-c", "python train.py"]


def test_explicit_bwrap_that_cannot_work_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap is not on PATH")
    with pytest.raises(SandboxError, match="not on PATH"):
        sandbox.resolve_mode("bwrap")
    assert sandbox.resolve_mode("auto") == "none"
    with pytest.raises(SandboxError):
        sandbox.resolve_mode("docker")


def test_bwrap_hides_first_and_shows_the_learners_dirs_through(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", ())  # wherever this checkout lives, e.g. under /tmp
    storage = tmp_path / "storage"
    work, results, data, other = (storage / "job" / "work", storage / "job" / "results",
                                  storage / "job" / "data", tmp_path / "missing")
    for d in (work, results, data):
        d.mkdir(parents=True)
    argv = build_argv("python train.py", mode="auto", work_dir=str(work), writable_dirs=[str(results)],
                      readonly_dirs=[str(data), str(other)], hidden_dirs=[str(storage)])
    assert argv[:14] == ["/usr/bin/bwrap", "--unshare-net", "--unshare-pid", "--die-with-parent",
                         "--new-session", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                         "--tmpfs", "/tmp"]
    mounts = argv[14:argv.index("--chdir")]
    assert mounts[:2] == ["--tmpfs", str(storage)]
    assert {tuple(mounts[i:i + 3]) for i in range(2, len(mounts), 3)} >= {
        ("--bind", str(work), str(work)), ("--bind", str(results), str(results)),
        ("--ro-bind", str(data), str(data))}
    assert str(other) not in argv  # a missing directory is skipped, not an error inside bwrap
    assert argv[argv.index("--chdir"):] == ["--chdir", str(work), "--", "/bin/sh", "-c", "python train.py"]


def test_the_python_runtime_stays_visible_under_a_hidden_dir(tmp_path, monkeypatch):
    # e.g. a checkout (and its .venv) under /tmp, which the learner gets a private copy of
    runtime = tmp_path / "checkout" / ".venv"
    runtime.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", (str(runtime),))
    args = sandbox._mount_args(work_dir=str(work), writable_dirs=(), readonly_dirs=(), hidden_dirs=(str(tmp_path),))
    hidden_at = args.index(str(tmp_path)) - 1
    exposed_at = args.index("--ro-bind")
    assert args[hidden_at] == "--tmpfs" and hidden_at < exposed_at
    assert args[exposed_at:exposed_at + 3] == ["--ro-bind", str(runtime), str(runtime)]
