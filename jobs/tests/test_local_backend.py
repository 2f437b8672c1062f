"""The local backend starting learner agents: detached, with a clean environment, one start-up each."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.backends import local
from jobs.backends.base import BackendError, DeploySpec, LearnerSpec
from jobs.backends.local import LocalBackend
from learner_agent import procfs
from learner_agent.config import parse_config
from learner_agent.agent import _CLEAN_ENV_MARK, AGENT_ENV_KEEP, clean_environment
from tests.support.agent_runs import wait_for, write_agent_config
# The spares' command lines name their FIFO, in the spare dir: found the way a platform stop finds agents.
from portal.runner import _agent_pids as spare_pids, stop_learner_agents


def _stat_fields(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _exit_record(folder):
    path = folder / "exit.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("setsid", [local.SETSID, None], ids=["setsid", "agent-detaches-itself"])
def test_it_starts_the_agent_detached_and_it_runs_the_learner(outside_tmp, ingest, monkeypatch, setsid):
    if setsid is None and local.SETSID is None:
        pytest.skip("no setsid here: the fallback is the only path")
    monkeypatch.setattr(local, "SETSID", setsid)
    folder = Path(write_agent_config(outside_tmp, ingest, command="sleep 1; echo done")).parent
    local.LocalBackend()._start_agent(folder)
    pid = wait_for(lambda: local._agent_pid(folder))
    fields = _stat_fields(pid)
    assert int(fields[1]) != os.getpid()  # not our child: it outlives a restarted worker
    assert int(fields[3]) != os.getsid(0)  # a session of its own: stopping the worker's group spares it
    assert wait_for(lambda: _exit_record(folder), timeout=20)["exit_code"] == 0
    wait_for(lambda: any(r.get("state") == "exited" for r in ingest.stored()))
    assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["done"]


@pytest.fixture
def with_a_spare(settings):
    """A local backend with one spare agent ready: (backend, the spare's pid). Every agent and spare
    under the test's data dir is stopped afterwards, as a platform stop does."""
    if local.SETSID is None:
        pytest.skip("spares are started with setsid")
    settings.SPARE_AGENTS = 1
    backend = local.LocalBackend()
    try:
        backend.replenish_spares()
        wait_for(lambda: list(backend.spare_dir.glob("*.ready")), timeout=20)
        [pid] = spare_pids(backend.spare_dir)
        yield backend, pid
    finally:
        stop_learner_agents(settings.DATA_DIR, wait_s=5)
    assert spare_pids(backend.spare_dir) == []


def test_a_learner_goes_to_a_ready_spare_and_the_next_one_starts(outside_tmp, ingest, with_a_spare):
    backend, spare_pid = with_a_spare
    folder = Path(write_agent_config(outside_tmp, ingest, command="sleep 1; echo done")).parent
    backend._start_agent(folder)
    assert wait_for(lambda: local._agent_pid(folder)) == spare_pid
    assert local._agent_alive(folder)
    assert wait_for(lambda: _exit_record(folder), timeout=20)["exit_code"] == 0
    assert [r["line"] for r in ingest.stored() if r["kind"] == "log"] == ["done"]
    backend.replenish_spares()  # what jobs.tasks.spare_agents does a moment after a deploy
    wait_for(lambda: list(backend.spare_dir.glob("*.ready")), timeout=20)
    assert spare_pids(backend.spare_dir) and spare_pid not in spare_pids(backend.spare_dir)


def test_a_starting_worker_replaces_the_spares_it_finds(with_a_spare):
    """They may be of the code an upgrade replaced (jobs.tasks.start_spare_agents)."""
    backend, old = with_a_spare
    backend.restart_spares()
    wait_for(lambda: not Path(f"/proc/{old}").exists(), timeout=20)
    wait_for(lambda: list(backend.spare_dir.glob("*.ready")), timeout=20)
    assert len(spare_pids(backend.spare_dir)) == 1


def test_without_spares_each_learner_gets_an_agent_of_its_own(outside_tmp, ingest, settings):
    settings.SPARE_AGENTS = 0
    backend = local.LocalBackend()
    backend.replenish_spares()
    assert not backend.spare_dir.exists()
    folder = Path(write_agent_config(outside_tmp, ingest, command="echo done")).parent
    backend._start_agent(folder)
    assert wait_for(lambda: _exit_record(folder), timeout=20)["exit_code"] == 0


def test_it_refuses_an_agent_config_the_agent_would_refuse(outside_tmp, monkeypatch):
    backend = local.LocalBackend()
    monkeypatch.setattr(backend, "_agent_config", lambda *a, **k: {"job_id": "j"})  # no command, no token
    monkeypatch.setattr(local, "_check_framework", lambda *a: None)
    spec = DeploySpec(job_id="j-1", attempt=1, tenant="t", command="true", code_archive="/nowhere.zip",
                            job_dir=str(outside_tmp), learners=(local_learner(),), cpus=1, memory_bytes=0, gpus=0,
                            env={}, metric_regexes={}, checkpoint_signal="SIGTERM", grace_seconds=1,
                            ingest_url="http://127.0.0.1:9/", framework="custom", framework_version="", image="")
    monkeypatch.setattr(local.storage, "learner_dir", lambda *a: Path(outside_tmp) / "l0")
    with pytest.raises(BackendError, match="learner agent config: .*required") as raised:
        backend.deploy(spec)
    assert raised.value.permanent
    assert not (Path(outside_tmp) / "l0" / "agent.json").exists()


def test_the_learners_python_is_found_through_a_linked_virtual_environment(tmp_path, monkeypatch):
    # The sandbox binds the environment at its real path; PATH named it through the link, where the
    # learner's `sh -c "python ..."` found nothing (exit 127).
    linked = tmp_path / "checkout" / ".venv"
    linked.parent.mkdir()
    linked.symlink_to(Path(local.sys.executable).parent.parent, target_is_directory=True)
    monkeypatch.setattr(local.sys, "executable", str(linked / "bin" / Path(local.sys.executable).name))
    seen = {}
    monkeypatch.setattr(local.subprocess, "run", lambda argv, **kwargs: seen.update(kwargs) or
                        local.subprocess.CompletedProcess(argv, 0))
    local.LocalBackend()._launch(["true"], cwd=tmp_path, log_path=tmp_path / "agent.log")
    first = seen["env"]["PATH"].split(os.pathsep)[0]
    assert first == os.path.realpath(linked / "bin") and os.path.realpath(first) == first


def local_learner():
    return LearnerSpec(index=0, env={}, gpu_ids=(), node="", ingest_token="t")


def test_a_clean_environment_keeps_only_harmless_variables_and_is_marked():
    env = clean_environment({"PATH": "/bin", "LANG": "C.UTF-8", "SECRET_KEY": "s", "DATABASE_URL": "postgres://x"})
    assert set(env) == {"PATH", "LANG", "PYTHONPATH", _CLEAN_ENV_MARK}
    assert set(env) - {"PYTHONPATH", _CLEAN_ENV_MARK} <= set(AGENT_ENV_KEEP)


def test_a_deploy_has_the_spares_topped_up_a_moment_later_not_beside_its_learner(
        outside_tmp, ingest, with_a_spare, monkeypatch, settings):
    # Starting one at once took CPU from the learner's own start (bench frameworks' timeline).
    backend, spare_pid = with_a_spare
    sent = []
    monkeypatch.setattr(local.dispatch, "send", lambda task, *args, **kwargs: sent.append((task, args, kwargs)))
    archive = Path(write_agent_config(outside_tmp, ingest, command="true")).parent.parent.parent / "code.zip"
    job_dir = Path(settings.DATA_DIR) / "storage" / "team-a" / "training-spares01"
    spec = DeploySpec(
        job_id="training-spares01", attempt=1, tenant="team-a", command="sleep 1; echo done",
        code_archive=str(archive), job_dir=str(job_dir), learners=(LearnerSpec(index=0, env={}, ingest_token="t"),),
        cpus=1.0, memory_bytes=2**30, gpus=0, env={"CHECKPOINT_DIR": str(job_dir / "checkpoints" / "attempt-1"),
                                               "JOB_STATE_DIR": str(job_dir / "state")},
        metric_regexes={}, checkpoint_signal="SIGTERM", grace_seconds=5, ingest_url=ingest.url)
    backend.deploy(spec)
    folder = backend._learner_folder(spec, spec.learners[0])
    assert wait_for(lambda: local._agent_pid(folder)) == spare_pid
    assert sent == [("spare_agents", (), {"countdown": local.SPARES_AFTER_DEPLOY_S})]
    assert spare_pids(backend.spare_dir) == [spare_pid]  # none started beside it
    from jobs.tasks import spare_agents
    spare_agents()  # what the message does when it comes
    wait_for(lambda: list(backend.spare_dir.glob("*.ready")), timeout=20)
    assert len(spare_pids(backend.spare_dir)) == 2


def test_the_agent_gets_the_jobs_disk_caps_and_tmp_size(tmp_path):
    job_dir = tmp_path / "job"
    folder = job_dir / "attempt-1" / "learner-0"
    spec = DeploySpec(
        job_id="training-disk0001", attempt=1, tenant="team-a", command="true", code_archive=str(job_dir / "code.zip"),
        job_dir=str(job_dir), learners=(local_learner(),), cpus=1.0, memory_bytes=2**30, gpus=0,
        env={"CHECKPOINT_DIR": str(job_dir / "checkpoints" / "attempt-1"), "JOB_STATE_DIR": str(folder / "state")},
        metric_regexes={}, checkpoint_signal="SIGTERM", grace_seconds=5, ingest_url="http://127.0.0.1:1/",
        disk={"results": 1000, "checkpoints": 2000, "work": 3000, "tmp": 4000, "logs": 5, "log_lines": 6},
        uid_number=41)
    config = parse_config(LocalBackend()._agent_config(spec, local_learner(), folder), path=str(folder / "agent.json"))
    assert config.uid_number == 41  # the platform's number for the job's learners' uid
    caps = {cap.name: (cap.limit, cap.paths) for cap in config.disk_caps}
    assert caps == {"results": (1000, (str(job_dir / "results"),)),
                    "checkpoints": (2000, (str(job_dir / "checkpoints"),)),
                    "work": (3000, (str(folder / "work"), str(folder / "state")))}
    assert config.tmp_bytes == 4000


def test_teardown_removes_the_learners_work_and_state_folders_and_keeps_their_output(tmp_path, settings):
    settings.STORAGE_URL = f"file://{tmp_path}"
    folder = local.storage.learner_dir("team-a", "training-disk0002", 1, 0)
    for name in ("work/code.py", "state/logs/x", ".work.abc.unpacking/y", "exit.json"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    LocalBackend().delete(tenant="team-a", job_id="training-disk0002", attempt=1, learners=1, wait_s=0)
    assert sorted(p.name for p in folder.iterdir()) == ["exit.json"]


def test_a_halt_asked_for_before_the_agent_is_up_stops_the_learner_from_starting(outside_tmp, ingest, monkeypatch):
    # The deploy has written the learner's folder, but its agent has no pid yet: no signal can reach it.
    folder = Path(write_agent_config(outside_tmp, ingest, command="echo started; sleep 30",
                                     halt_file=str(Path(outside_tmp) / "job" / "attempt-1" / "learner-0" / local.HALT_FILE))).parent
    monkeypatch.setattr(local.storage, "learner_dir", lambda *a: folder)
    backend = LocalBackend()
    backend.halt(tenant="team-a", job_id="training-test0001", attempt=1, learners=1)
    backend._start_agent(folder)
    record = wait_for(lambda: _exit_record(folder), timeout=20)
    assert (record["exit_code"], record["reason"]) == (None, "halted")
    assert not [r for r in ingest.stored() if r["kind"] == "log" and r["line"] == "started"]


def test_each_agent_is_told_where_its_halt_file_is(tmp_path):
    folder = tmp_path / "job" / "attempt-1" / "learner-0"
    spec = DeploySpec(
        job_id="training-halt0001", attempt=1, tenant="team-a", command="true", code_archive=str(tmp_path / "code.zip"),
        job_dir=str(tmp_path / "job"), learners=(local_learner(),), cpus=1.0, memory_bytes=2**30, gpus=0,
        env={"CHECKPOINT_DIR": str(tmp_path / "c"), "JOB_STATE_DIR": str(folder / "state")},
        metric_regexes={}, checkpoint_signal="SIGTERM", grace_seconds=5, ingest_url="http://127.0.0.1:1/")
    config = parse_config(LocalBackend()._agent_config(spec, local_learner(), folder), path=str(folder / "agent.json"))
    assert config.halt_file == str(folder / local.HALT_FILE)


@pytest.mark.parametrize("spares", [0, 1], ids=["cold-start", "spare"])
def test_a_learner_deleted_before_its_agent_is_up_never_starts(outside_tmp, ingest, monkeypatch, settings, spares):
    # A job terminated while it was being deployed: its agent (or the spare handed it) has no pid yet,
    # so no signal reaches it, and the teardown must still keep its command from ever starting.
    settings.SPARE_AGENTS = spares
    backend = LocalBackend()
    spare_pid = None
    if spares:
        if local.SETSID is None:
            pytest.skip("spares are started with setsid")
        backend.replenish_spares()
        wait_for(lambda: list(backend.spare_dir.glob("*.ready")), timeout=20)
        [spare_pid] = spare_pids(backend.spare_dir)
    started = Path(outside_tmp) / "started"
    folder = Path(write_agent_config(outside_tmp, ingest, command=f"touch {started}; sleep 30")).parent
    monkeypatch.setattr(local.storage, "learner_dir", lambda *a: folder)
    where = {"tenant": "team-a", "job_id": "training-test0001", "attempt": 1, "learners": 1}
    try:
        if spare_pid:
            os.kill(spare_pid, signal.SIGSTOP)  # a spare is quick, but not always first to run
        backend._start_agent(folder)
        backend.delete(**where, wait_s=10)
        if spare_pid:
            os.kill(spare_pid, signal.SIGCONT)
        log = folder / "agent.log"
        # The agent leaves on finding the learner ended, or locked while that was being written.
        wait_for(lambda: started.exists() or log.exists() and re.search("not again|leaving it alone", log.read_text()),
                 timeout=20)
        assert not started.exists()
        [learner] = backend.status(**where)
        assert learner.state == local.LearnerState.EXITED
        wait_for(lambda: spare_pids(backend.spare_dir) == [], timeout=20)  # the spare handed it left too
    finally:
        stop_learner_agents(settings.DATA_DIR, wait_s=5)


# Stands for an agent between taking its learner's lock and writing its pid (learner_agent.agent.run_agent);
# its command line names the learner's agent.json, as an agent's does.
AGENT_COMING_UP = """
import fcntl, os, signal, sys, time
folder = os.path.dirname(sys.argv[1])
fcntl.flock(os.open(os.path.join(folder, "agent.lock"), os.O_WRONLY | os.O_CREAT), fcntl.LOCK_EX)
open(os.path.join(folder, "locked"), "w").close()
time.sleep(1)
signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(folder, "terminated"), "w").close(), sys.exit(0)))
open(os.path.join(folder, "agent.pid"), "w").write(f"{os.getpid()}\\n")
time.sleep(30)
"""


def test_delete_waits_for_an_agent_that_holds_its_learner_but_has_no_pid_yet_and_stops_it(
        outside_tmp, ingest, monkeypatch):
    folder = Path(write_agent_config(outside_tmp, ingest, command="true")).parent
    monkeypatch.setattr(local.storage, "learner_dir", lambda *a: folder)
    agent = subprocess.Popen([sys.executable, "-c", AGENT_COMING_UP, str(folder / "agent.json")])
    try:
        wait_for(lambda: (folder / "locked").exists(), timeout=20)
        LocalBackend().delete(tenant="team-a", job_id="training-test0001", attempt=1, learners=1, wait_s=10)
        assert (folder / "terminated").exists()
        assert agent.wait(timeout=10) == 0
    finally:
        agent.kill()
        agent.wait()


def test_a_process_that_took_over_an_agents_pid_does_not_keep_its_learner_running(outside_tmp, ingest, monkeypatch):
    # A learner can run any command line, one naming another tenant's learner's agent.json too, and
    # can fork until it gets the pid that learner's agent had: that learner must not look alive for ever
    # (its job held its room, its teardown never confirmed).
    folder = Path(write_agent_config(outside_tmp, ingest, command="true")).parent
    (folder / "exit.json").write_text(json.dumps({"exit_code": 0, "reason": ""}))
    where = {"tenant": "team-a", "job_id": "training-test0001", "attempt": 1, "learners": 1}
    monkeypatch.setattr(local.storage, "learner_dir", lambda *a: folder)
    impostors = []

    def impostor(**kwargs):
        impostors.append(subprocess.Popen(["/bin/sh", "-c", "sleep 30; true", str(folder / "agent.json")],
                                          start_new_session=True, **kwargs))
        wait_for(lambda: procfs.argv(impostors[-1].pid)[-1:] == [str(folder / "agent.json")])
        (folder / "agent.pid").write_text(f"{impostors[-1].pid}\n")
    try:
        impostor(user=2_000_000_123)  # a learner's uid, not the agents'
        assert [s.state for s in LocalBackend().status(**where)] == [local.LearnerState.EXITED]
        impostor()  # the agents' uid (a platform not run as root), but started after the pid was written
        an_hour_ago = time.time() - 3600
        os.utime(folder / "agent.pid", (an_hour_ago, an_hour_ago))
        assert [s.state for s in LocalBackend().status(**where)] == [local.LearnerState.EXITED]
    finally:
        for process in impostors:
            os.killpg(process.pid, signal.SIGKILL)  # its sleep too
            process.wait()
