"""The `local` backend: each learner is a learner-agent process tree on this machine.

The agent is started detached (its own session, a child of init rather than of the Celery worker), so
learners keep running when the worker, the web server or Redis restarts. Everything the backend
knows is on disk in the learner's folder (agent.pid, exit.json), so a restarted worker finds it.

A learner runs in the platform's own Python environment, so its framework (trainyard.frameworks) must be
importable there; that is checked before anything starts. The learners of a distributed job share
one private network namespace, held per attempt (learner_agent.netns, `attempt-<n>/netns.pid`):
they reach each other on 127.0.0.1 and nothing else.
"""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import logging
import time
from functools import cached_property, lru_cache
from pathlib import Path

from django.conf import settings

from jobs import dispatch, storage
from jobs.backends.base import (BackendError, Capacity, DeploySpec, LearnerState, LearnerStatus, Node,
                                agent_config_base, read_exit_record)
from learner_agent import address, netns, procfs, sandbox, spare, spool, trees
from learner_agent.agent import agent_argv, clean_environment
from learner_agent.config import HALT_MARK, ConfigError, parse_config
from learner_agent.files import write_atomically
from trainyard import frameworks

log = logging.getLogger(__name__)

DEPLOY_GRACE_S = 60  # an agent that has not written its pid this long after deploy counts as missing
AGENT_SPOOL = "spool"  # the agent's unacked records (learner_agent.spool)
HALT_FILE = "halt"  # in a learner's folder: the agent halts when it holds HALT_MARK (halt())
AGENT_RESTARTED = "agent.restarted"  # a second agent was started after the first died: never a third
SPARES_AFTER_DEPLOY_S = 0.5  # a deploy has the spares topped up this long after it (jobs.tasks.spare_agents)
SETSID = shutil.which("setsid")  # util-linux: starts a program in a session of its own, detached


class LocalBackend:
    name = "local"

    # --- deploy ------------------------------------------------------------------------------------
    def deploy(self, spec: DeploySpec):
        _check_framework(spec.framework, spec.framework_version)
        pending = [learner for learner in spec.learners
                   if not (self._learner_folder(spec, learner) / "exit.json").exists()
                   and not _agent_alive(self._learner_folder(spec, learner))]
        if not pending:
            return  # already deployed: deploy is repeated after worker restarts
        network = self._shared_network(spec)
        for learner in pending:
            folder = self._learner_folder(spec, learner)
            folder.mkdir(parents=True, exist_ok=True)
            config = self._agent_config(spec, learner, folder, network)
            try:
                # Checked here, as the agent would check it, since the agent starts detached and
                # could only say so in its own log.
                parse_config(config, path=str(folder / "agent.json"))
            except ConfigError as exc:
                raise BackendError(f"learner agent config: {exc}", permanent=True) from exc
            _write_private_text(folder / "agent.json", json.dumps(config))
            self._start_agent(folder)
        # A moment later, not now: a spare starting beside this job's agents takes CPU from their learners.
        dispatch.send("spare_agents", countdown=SPARES_AFTER_DEPLOY_S)

    def _learner_folder(self, spec, learner):
        return storage.learner_dir(spec.tenant, spec.job_id, spec.attempt, learner.index)

    def _shared_network(self, spec):
        """The network namespace the learners of a distributed job share ("" for one learner)."""
        if len(spec.learners) < 2:
            return ""
        attempt_dir = storage.learner_dir(spec.tenant, spec.job_id, spec.attempt, 0).parent
        attempt_dir.mkdir(parents=True, exist_ok=True)
        try:
            return netns.create(attempt_dir, len(spec.learners))
        except (netns.NetnsError, OSError, subprocess.SubprocessError) as exc:
            if sandbox.resolve_mode(settings.SANDBOX) == "none":
                # Without a sandbox a learner is a plain process on the host's network anyway.
                log.warning("%s: learners share the host network: %s", spec.job_id, exc)
                return ""
            raise BackendError(f"the learners of a distributed job need a shared private network "
                               f"namespace, which cannot be created here: {exc}", permanent=True) from exc

    def _agent_config(self, spec, learner, folder, network=""):
        job_dir = Path(spec.job_dir)
        work_dir = folder / "work"
        env = dict(spec.env, **learner.env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in learner.gpu_ids)
        return {
            **agent_config_base(spec, learner),
            "work_dir": str(work_dir),
            "env": env,
            # Earlier attempts' checkpoints are readable (RESUME_FROM), only this attempt's writable.
            "writable_dirs": [str(work_dir), str(job_dir / "results"), env["CHECKPOINT_DIR"], env["JOB_STATE_DIR"]],
            # The learner sees the machine read-only, minus everything Trainyard keeps: other
            # jobs, the database, the agent's own config with its ingest credential.
            "hidden_dirs": sorted({str(settings.DATA_DIR), str(storage.root())}),
            "ingest_url": spec.ingest_url,
            "platform_file": str(self.platform_file),  # where it is after a restart (announce)
            "halt_file": str(folder / HALT_FILE),  # see halt()
            "ingest_token": learner.ingest_token,  # this learner's own; never in its env or argv
            "sandbox": settings.SANDBOX,
            "max_unpacked_bytes": settings.MAX_UNPACKED_BYTES,
            "max_members": settings.MAX_ARCHIVE_MEMBERS,
            "log_bytes_per_second": settings.LOG_PACE_BYTES_PER_SECOND,
            "log_burst_bytes": settings.LOG_PACE_BURST_BYTES,
            "resource_sample_s": settings.RESOURCE_SAMPLE_S,
            "nvml_module": settings.LOCAL_NVML_MODULE,
            "network_namespace": network,
            **_disk_config(spec.disk, job_dir=job_dir, work_dir=work_dir, state_dir=env["JOB_STATE_DIR"]),
        }

    def _start_agent(self, folder):
        """Start the learner's agent, detached, and return at once: a spare one if one is ready
        (learner_agent.spare: the interpreter and the agent's imports already paid for), else a new one."""
        if settings.SPARE_AGENTS and spare.hand_over(self.spare_dir, folder / "agent.json"):
            return
        self._launch(agent_argv(folder / "agent.json"), cwd=folder, log_path=folder / "agent.log")

    def replenish_spares(self):
        """Keep SPARE_AGENTS spare agents ready for the next deploys; a failure costs only speed.
        Only with setsid: a spare is started detached, it does not detach itself."""
        if not settings.SPARE_AGENTS or not SETSID:
            return
        directory = self.spare_dir
        try:
            spare.replenish(directory, settings.SPARE_AGENTS, lambda fifo: self._launch(
                spare.spare_argv(fifo), cwd=directory, log_path=directory / "spares.log"))
        except (BackendError, OSError, subprocess.SubprocessError) as exc:
            log.warning("could not start a spare learner agent in %s: %s", directory, exc)

    def restart_spares(self):
        """At a worker's start: the ready spares exit (they may run the code this worker replaced)
        and fresh ones start."""
        try:
            spare.retire(self.spare_dir)
        except OSError as exc:
            log.warning("could not retire the spare learner agents in %s: %s", self.spare_dir, exc)
        self.replenish_spares()

    @property
    def spare_dir(self):
        return Path(settings.DATA_DIR) / "spare-agents"

    def announce(self, ingest_url):
        """At a worker's start: tell the agents (running ones too, which outlive the platform's
        processes) where the platform takes their posts now, `ingest_url` with address.JOB_ID in it.
        A platform started again on another address is found there (learner_agent.address)."""
        try:
            address.announce(self.platform_file, ingest_url)
        except OSError as exc:
            log.error("could not write the platform's address to %s: agents of a platform that moved "
                      "cannot find it: %s", self.platform_file, exc)

    @property
    def platform_file(self):
        return Path(address.path_in(settings.DATA_DIR))

    def _launch(self, argv, *, cwd, log_path):
        """Start an agent (or a spare) detached with one Python start-up.

        `setsid --fork` does the detaching (its own session, a child of init), so neither a
        detaching Python process nor the re-exec that clears the agent's environment runs first:
        the agent gets its clean environment (learner_agent.agent.clean_environment) from here.
        The deploy does not wait for an interpreter, so a worker deploys many jobs a second.
        Without setsid the agent detaches itself (`--detach`)."""
        # The platform's own Python comes first on PATH: on the local backend, the frameworks a
        # learner's `python` imports are the ones installed beside Trainyard. Its folder as the sandbox
        # shows it, at its real path: a `.venv` that is a link is not there under the link's name.
        python_dir = Path(sys.executable).parent.resolve()  # the folder, not the interpreter a venv links to
        path = os.pathsep.join([str(python_dir), os.environ.get("PATH", "/usr/bin:/bin")])
        env = clean_environment({"PATH": path, "LANG": "C.UTF-8"})
        argv = [SETSID, "--fork", *argv] if SETSID else [*argv, "--detach"]
        with open(log_path, "ab") as log_file:
            result = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=log_file, timeout=30)
        if result.returncode != 0:
            raise BackendError(f"learner agent did not start (exit {result.returncode}); see {log_path}")

    # --- observe -----------------------------------------------------------------------------------
    def status(self, *, tenant, job_id, attempt, learners):
        return [self._learner_status(storage.learner_dir(tenant, job_id, attempt, i), i) for i in range(learners)]

    def _learner_status(self, folder, index):
        if _agent_alive(folder) or self._restart_dead_agent(folder):
            return LearnerStatus(index, LearnerState.RUNNING)
        outcome = read_exit_record(folder)
        if outcome is not None:
            return LearnerStatus(index, LearnerState.EXITED, outcome["exit_code"], outcome["reason"])
        config = folder / "agent.json"
        never_started = not (folder / "agent.pid").exists()
        if never_started and config.exists() and time.time() - config.stat().st_mtime < DEPLOY_GRACE_S:
            return LearnerStatus(index, LearnerState.PENDING)
        return LearnerStatus(index, LearnerState.MISSING, reason="learner agent is not running and left no exit record")

    def _restart_dead_agent(self, folder):
        """Start a second agent, once, for an agent that died (SIGKILL, OOM, a reboot) leaving records
        in its spool that the platform has not acked, or no exit record. The second one delivers the
        spool and reports how the learner ended; it never runs the command again (learner_agent.agent,
        `Agent._resume`). True if one was started."""
        marker, pid_file = folder / AGENT_RESTARTED, folder / "agent.pid"
        if marker.exists():  # the second one counts as running until it has written its pid
            return (time.time() - marker.stat().st_mtime < DEPLOY_GRACE_S and pid_file.exists()
                    and pid_file.stat().st_mtime < marker.stat().st_mtime)
        ended, spool_dir = (folder / "exit.json").exists(), folder / AGENT_SPOOL
        if not pid_file.exists() or not spool.has_undelivered(spool_dir) and (ended or not spool_dir.exists()):
            return False
        marker.touch(mode=0o600)
        log.warning("learner agent in %s died; starting another to deliver what it spooled", folder)
        try:
            self._start_agent(folder)
        except (BackendError, OSError, subprocess.SubprocessError) as exc:
            log.error("could not start a second learner agent in %s: %s", folder, exc)
            return False
        return True

    def capacity(self):
        return Capacity(nodes=(Node(name="local", gpus=self._gpus, cpus=settings.LOCAL_CPUS,
                                    memory_bytes=self._memory_bytes),))

    @cached_property
    def _gpus(self):
        return settings.LOCAL_GPUS if settings.LOCAL_GPUS >= 0 else _detect_gpus()

    @cached_property
    def _memory_bytes(self):
        if settings.LOCAL_MEMORY_MB:
            return settings.LOCAL_MEMORY_MB * 2**20
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # --- stop --------------------------------------------------------------------------------------
    def halt(self, *, tenant, job_id, attempt, learners):
        """Ask each agent to checkpoint-and-stop its learner (the agent waits the grace period).

        The halt file first, then the signal: an agent deployed a moment ago may not have written
        its pid yet, and would start its learner unhalted until a reconcile pass repeated the halt
        (a preempted job then held its room for a reconcile interval); it reads the file as it starts."""
        for index in range(learners):
            folder = storage.learner_dir(tenant, job_id, attempt, index)
            if folder.is_dir():  # else never deployed: deploy skips a halting job
                _write_private_text(folder / HALT_FILE, f"{HALT_MARK}\"{time.time():.3f}\"\n")
            _signal_agent(folder, signal.SIGUSR1)

    def delete(self, *, tenant, job_id, attempt, learners, wait_s=10.0):
        """Stop every learner of the attempt; SIGKILL what has not stopped after `wait_s`.

        An agent started a moment ago (a job ended while it was being deployed) has no pid yet for a
        signal to reach, and would start its learner after this: such a learner is barred instead
        (_bar_unstarted), or, while its agent holds it but has not written its pid, waited for."""
        folders = [storage.learner_dir(tenant, job_id, attempt, i) for i in range(learners)]
        waiting, signalled = list(folders), set()
        deadline = time.monotonic() + wait_s
        while True:
            for folder in waiting:
                if folder not in signalled and _agent_alive(folder):
                    _signal_agent(folder, signal.SIGTERM)
                    signalled.add(folder)
            waiting = [f for f in waiting if _agent_alive(f) or not _bar_unstarted(f)]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for folder in folders:
            _signal_agent(folder, signal.SIGKILL)
        if folders:
            netns.stop(folders[0].parent)
        for folder in folders:
            _remove_scratch(folder)


def _disk_config(caps, *, job_dir, work_dir, state_dir):
    """The agent's disk caps (learner_agent.diskwatch): the job's results and all its checkpoints
    as wholes, this learner's work and state folders together; /tmp's size."""
    folders = {"results": [str(job_dir / "results")], "checkpoints": [str(job_dir / "checkpoints")],
               "work": [str(work_dir), str(state_dir)]}
    return {"disk_caps": [{"name": name, "bytes": caps[name], "paths": paths}
                          for name, paths in folders.items() if caps.get(name)],
            "tmp_bytes": caps.get("tmp")}


def _bar_unstarted(folder):
    """Whether no agent can start the learner of `folder` any more. One that never had an agent
    (no agent.pid) gets an exit record, written under the agent's lock: an agent that comes later
    finds it and leaves without running the command (learner_agent.agent._claim_learner). False while
    an agent holds the lock and has not written its pid yet."""
    if (folder / "agent.pid").exists() or (folder / "exit.json").exists():
        return True
    try:
        fd = os.open(folder / "agent.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return True  # never deployed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        if not (folder / "agent.pid").exists() and not (folder / "exit.json").exists():
            write_atomically(folder / "exit.json", json.dumps(
                {"exit_code": None, "reason": "terminated before its learner agent started", "finished_at": time.time()}),
                durable=True)
    finally:
        os.close(fd)
    return True


def _remove_scratch(folder):
    """A learner's work and state folders go with its attempt (results and checkpoints stay). Its
    agent removes them as it ends; this is for one that was killed first. Only once no agent runs."""
    if _agent_alive(folder):
        return
    # ".work.*.unpacking": what an agent killed while unpacking the code left (learner_agent.archive).
    for path in [folder / "work", folder / "state", *folder.glob(".work.*.unpacking")]:
        trees.remove(path)


def _check_framework(name, version):
    """A learner here runs in the platform's Python: its framework must be importable, in the major
    version the manifest asked for (code for another major version rarely runs)."""
    framework = frameworks.REGISTRY.get(name)
    if framework is None:
        raise BackendError(f"framework {name!r} is not in the registry", permanent=True)
    installed = _installed_version(name)
    if installed is None:
        raise BackendError(f"framework {name}: the platform's Python environment cannot import "
                           f"{', '.join(framework.modules)}; install it beside Trainyard (for TensorFlow, Keras "
                           f"and JAX: pip install -e '.[frameworks]')", permanent=True)
    wanted, have = frameworks.parse_version(version), frameworks.parse_version(installed)
    if wanted and have and wanted[0] != have[0]:
        raise BackendError(f"framework {name}: the manifest asks for {framework.title} {version}, but the local "
                           f"backend runs the installed {framework.title} {installed}; ask for "
                           f"{have[0]}.x or \"latest\"", permanent=True)


@lru_cache(maxsize=None)
def _installed_version(name):
    return frameworks.REGISTRY[name].installed_version()


def _detect_gpus():
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _agent_pid(folder):
    try:
        return int((folder / "agent.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _agent_alive(folder):
    return procfs.agent_running(str(folder))


def _signal_agent(folder, signum):
    if not _agent_alive(folder):
        return
    try:
        os.kill(_agent_pid(folder), signum)
    except ProcessLookupError:
        pass


def _write_private_text(path, text):
    # A temporary name of its own: two deploys of one learner (a re-driven deploy) may write at once.
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)
