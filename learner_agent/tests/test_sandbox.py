"""What the learner can see and do: the environment always, the machine when bubblewrap is there."""
import json
import os
import socket

import pytest

from learner_agent import sandbox
from learner_agent.sandbox import SandboxError, build_argv, build_env, bwrap_plan
from tests.support.agent_runs import PACKAGE_PARENT, run_agent, write_agent_config

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
port, hidden, outside, readonly, results, host_socket = sys.argv[1:7]
attempt("network", lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2).close())
def connect_unix():
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(host_socket)
attempt("host_socket", connect_unix)
attempt("run", lambda: os.listdir("/run"))
attempt("cgroups", lambda: os.listdir("/sys/fs/cgroup"))
attempt("cpus", os.cpu_count)
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
    host_socket = socket.socket(socket.AF_UNIX)  # a host service, open to every uid
    host_socket.bind(os.path.join(base, "service.sock"))
    os.chmod(os.path.join(base, "service.sock"), 0o777)
    host_socket.listen()
    config = write_agent_config(
        base, ingest, sandbox=mode, files={"probe.py": PROBE},
        command=f"python3 probe.py {ingest.port} {hidden} {base} {readonly} {results} {base}/service.sock",
        hidden_dirs=[hidden, os.path.join(base, "job")], readonly_dirs=[readonly], writable_dirs=[results],
        env={"DATA_DIR": readonly, "RESULT_DIR": results, "LEARNER_ID": "0"})
    with host_socket:
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
    # Nothing of the host outside the allow-list exists in the learner's view.
    assert seen["hidden"] == ["error", "FileNotFoundError"]
    assert seen["host_socket"] == ["error", "FileNotFoundError"]  # listening, but not in the view
    assert seen["run"] == ["error", "FileNotFoundError"]
    assert seen["cgroups"] == ["error", "FileNotFoundError"]
    assert seen["cpus"] == ["ok", os.cpu_count()]  # /sys/devices/system/cpu is in the view
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
    assert build_argv("python train.py") == ["/bin/sh", "-c", "python train.py"]


def test_explicit_bwrap_that_cannot_work_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap is not on PATH")
    with pytest.raises(SandboxError, match="not on PATH"):
        sandbox.resolve_mode("bwrap")
    assert sandbox.resolve_mode("auto") == "none"
    with pytest.raises(SandboxError):
        sandbox.resolve_mode("docker")


def _binds(args):
    """(option, source, destination) of every bind in bubblewrap arguments."""
    return [tuple(args[i:i + 3]) for i, a in enumerate(args) if a in ("--bind", "--ro-bind", "--dev-bind")]


def test_the_view_is_an_allow_list_not_the_whole_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", ())  # wherever this checkout lives, e.g. under /tmp
    storage = tmp_path / "storage"
    work, results, data, other = (storage / "job" / "work", storage / "job" / "results",
                                  storage / "job" / "data", tmp_path / "missing")
    for d in (work, results, data):
        d.mkdir(parents=True)
    plan = bwrap_plan("python train.py", work_dir=str(work), env={"A": "1"}, writable_dirs=[str(results)],
                      readonly_dirs=[str(data), str(other)], hidden_dirs=[str(storage)], tmp_bytes=2**20)
    args = plan["bwrap_args"]
    assert plan["bwrap"] == "/usr/bin/bwrap" and plan["command"] == ["/bin/sh", "-c", "python train.py"]
    assert plan["uid"] is None and plan["stage"] == []  # no identity: the agent's own uid, nothing staged
    isolation = args[:args.index("--uid")]
    assert {"--unshare-net", "--unshare-pid", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session"} <= set(isolation)
    assert isolation[isolation.index("--cap-drop") + 1] == "ALL"
    assert args[args.index("--uid") + 1] == str(os.getuid())
    binds = _binds(args)
    # Not the machine's / read-only (through which a learner could connect() to the Unix sockets of
    # host services), but the system's folders, each where the machine has it, and the learner's own.
    assert not [b for b in binds if b[1] == "/" or b[2] == "/"]
    learner = {("--bind", str(work), str(work)), ("--bind", str(results), str(results)),
               ("--ro-bind", str(data), str(data))}
    assert learner <= set(binds)
    system = [b for b in binds if b not in learner]
    assert system and all(option == "--ro-bind" and source == dest and source in sandbox.SYSTEM_PATHS
                          for option, source, dest in system), system
    for host_only in ("/run", "/var/run", "/var", "/sys/fs/cgroup", "/sys", "/home", "/root", "/etc"):
        assert host_only not in [dest for _, _, dest in binds]
    assert ("--ro-bind", "/usr", "/usr") in system
    assert ["--proc", "/proc"] == args[args.index("--proc"):args.index("--proc") + 2]
    assert args[args.index("--dev"):args.index("--dev") + 7] == [
        "--dev", "/dev", "--size", str(2**20), "--tmpfs", "/dev/shm", "--remount-ro"]
    mounts = args[args.index("/dev/shm") + 3:args.index("--chdir")]
    assert mounts[:4] == ["--size", str(2**20), "--tmpfs", "/tmp"]
    # The hidden storage is in no folder of the view: nothing to hide, and no mount for it.
    assert str(storage) not in mounts
    assert str(other) not in args  # a missing directory is skipped, not an error inside bwrap
    assert mounts[-2:] == ["--remount-ro", "/"]  # bwrap's own root, once every mount point is on it
    assert args[args.index("--chdir"):] == ["--chdir", str(work), "--clearenv", "--setenv", "A", "1"]


def test_the_system_view_keeps_symlinks_and_skips_what_the_machine_lacks(tmp_path):
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "resolv.conf").symlink_to("/run/systemd/resolve/stub-resolv.conf")
    (tmp_path / "lib32").mkdir()
    (tmp_path / "lib64").mkdir()
    paths = [str(tmp_path / name) for name in ("usr", "bin", "resolv.conf", "missing")] + [str(tmp_path / "lib*")]
    assert sandbox.system_view(paths) == [
        "--ro-bind", str(tmp_path / "usr"), str(tmp_path / "usr"),
        "--symlink", "usr/bin", str(tmp_path / "bin"),
        # A link stays a link: its target shows only if it is in the view (/run is not).
        "--symlink", "/run/systemd/resolve/stub-resolv.conf", str(tmp_path / "resolv.conf"),
        "--ro-bind", str(tmp_path / "lib32"), str(tmp_path / "lib32"),
        "--ro-bind", str(tmp_path / "lib64"), str(tmp_path / "lib64")]


def test_a_hidden_dir_inside_a_visible_one_stays_hidden(tmp_path, monkeypatch):
    runtime = tmp_path / "checkout"  # e.g. the platform's data folder inside the checkout's runtime
    (runtime / "var").mkdir(parents=True)
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", (str(runtime),))
    work = tmp_path / "work"
    work.mkdir()
    args = sandbox._mount_args(work_dir=str(work), writable_dirs=(), readonly_dirs=(),
                               hidden_dirs=(str(runtime / "var"), str(tmp_path / "elsewhere")), tmp_size="1024")
    assert args.index(str(runtime)) < args.index(str(runtime / "var"))
    assert args[args.index(str(runtime / "var")) - 1] == "--tmpfs"
    assert args[-2:] == ["--remount-ro", str(runtime / "var")]
    assert str(tmp_path / "elsewhere") not in args


def test_as_root_the_learner_gets_its_own_uid_and_its_folders_are_staged(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", ())
    monkeypatch.setattr(sandbox, "STAGE_DIR", str(tmp_path / "stage"))
    private = tmp_path / "private"  # e.g. a 0700 data directory the learner's uid cannot enter
    work, data = private / "job" / "work", private / "job" / "data"
    work.mkdir(parents=True)
    data.mkdir()
    private.chmod(0o700)
    identity = sandbox.Identity(2_000_000_123, 2_000_000_123)
    plan = bwrap_plan("true", work_dir=str(work), env={}, readonly_dirs=[str(data)], identity=identity,
                      cgroup_procs=["/cg/cgroup.procs"], network_namespace="/proc/42/ns/net")
    args = plan["bwrap_args"]
    assert (plan["uid"], plan["gid"]) == (identity.uid, identity.gid)
    assert args[args.index("--uid") + 1] == str(identity.uid)
    assert plan["stage"] == [str(work), str(data)]
    stage = str(tmp_path / "stage")
    assert ["--bind", f"{stage}/0", str(work)] == args[args.index("--bind"):args.index("--bind") + 3]
    assert ["--ro-bind", f"{stage}/1", str(data)] == args[args.index(f"{stage}/1") - 1:args.index(f"{stage}/1") + 2]
    # The system's folders are bound straight (everyone may read them), never staged.
    assert ("--ro-bind", "/usr", "/usr") in _binds(args)
    # What the uid could not enter lies in no folder of the view: bwrap makes the mount points on its
    # own root, nothing is mounted over it. Nor over the stage: nothing of /run is in the view.
    (outermost,) = sandbox.unsearchable_ancestors([str(work)], identity)  # private, or above it (pytest's 0700)
    assert str(private).startswith(outermost) and outermost not in args
    assert stage not in args and not [a for a in args if a.startswith("/run")]
    assert plan["cgroup_procs"] == ["/cg/cgroup.procs"]
    assert "--unshare-net" not in args and plan["network_namespace"] == "/proc/42/ns/net"


def test_learner_identities_are_per_job_in_the_documented_range(monkeypatch):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    a, b = sandbox.learner_identity("training-aaaaaaaaaa"), sandbox.learner_identity("training-bbbbbbbbbb")
    assert a == sandbox.learner_identity("training-aaaaaaaaaa") and a != b
    for identity in (a, b):
        assert sandbox.LEARNER_ID_BASE <= identity.uid < sandbox.LEARNER_ID_BASE + sandbox.LEARNER_ID_COUNT
        assert identity.gid == identity.uid
    # Numbered by the platform (jobs.models.LearnerUid): distinct for any LEARNER_ID_COUNT jobs in a row.
    numbered = [sandbox.learner_identity("training-aaaaaaaaaa", n).uid for n in (1, 2, sandbox.LEARNER_ID_COUNT + 1)]
    assert numbered == [sandbox.LEARNER_ID_BASE + 1, sandbox.LEARNER_ID_BASE + 2, sandbox.LEARNER_ID_BASE + 1]
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    assert sandbox.learner_identity("training-aaaaaaaaaa") is None  # not root: nothing to switch to


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_hand_over_gives_the_work_tree_and_only_the_tops_of_the_other_dirs(tmp_path):
    identity = sandbox.Identity(2_000_000_321, 2_000_000_321)
    work, results = tmp_path / "work", tmp_path / "results"
    (work / "src").mkdir(parents=True)
    (work / "src" / "train.py").write_text("")
    (results / "old").mkdir(parents=True)
    sandbox.hand_over(identity, tree=str(work), dirs=[str(results)])
    for path in (work, work / "src", work / "src" / "train.py", results):
        assert (path.stat().st_uid, path.stat().st_gid) == (identity.uid, identity.gid)
    assert (results / "old").stat().st_uid == 0


@pytest.mark.parametrize(("visible", "expected"), [
    ("1,3", ["nvidia1", "nvidia3", "nvidiactl", "nvidia-uvm"]),
    ("0", ["nvidia0", "nvidiactl", "nvidia-uvm"]),
    (" 2 , 0 ", ["nvidia2", "nvidia0", "nvidiactl", "nvidia-uvm"]),
    ("", []),  # a CPU job gets no GPU device at all, not even the control ones
    (None, []),
    ("7", ["nvidiactl", "nvidia-uvm"]),  # a GPU this machine does not have
])
def test_only_the_jobs_own_gpus_are_passed(tmp_path, visible, expected):
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).touch()
    assert sandbox.gpu_devices(visible, dev=str(tmp_path)) == [str(tmp_path / n) for n in expected]


def test_the_gpu_devices_reach_bwrap_before_dev_turns_read_only(monkeypatch):
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", ())
    args = bwrap_plan("true", work_dir="/nonexistent", env={}, devices=["/dev/nvidia1"])["bwrap_args"]
    assert args.index("--dev") < args.index("/dev/nvidia1") < args.index("--remount-ro")
    assert args[args.index("/dev/nvidia1") - 1] == "--dev-bind"


def test_the_python_runtime_stays_visible_under_a_hidden_dir(tmp_path, monkeypatch):
    # e.g. a checkout (and its .venv) under /tmp, which the learner gets a private copy of
    runtime = tmp_path / "checkout" / ".venv"
    runtime.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(sandbox, "_RUNTIME_DIRS", (str(runtime),))
    args = sandbox._mount_args(work_dir=str(work), writable_dirs=(), readonly_dirs=(), hidden_dirs=(str(tmp_path),),
                               tmp_size="1024")
    private_tmp_at = args.index("/tmp") - 1
    exposed_at = args.index("--ro-bind")
    assert args[private_tmp_at] == "--tmpfs" and private_tmp_at < exposed_at
    assert args[exposed_at:exposed_at + 3] == ["--ro-bind", str(runtime), str(runtime)]
    assert str(tmp_path) not in args  # hidden, but in no folder of the view: nothing to mount over it
