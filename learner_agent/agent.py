"""The learner agent: runs one learner's command and reports everything it does to the platform.

One agent runs beside each learner (a detached process for the local backend, the container's main
process on Kubernetes). In order, it: records `preparing`; unpacks the code; starts the command
(sandboxed) and records `running`; ships every output line as a log record plus any metric points
found in it; enforces the memory limit; obeys terminate (SIGTERM) and halt (SIGUSR1) and the
platform's 410; and when the command ends writes `exit.json` and records `exited`, then keeps trying to
deliver what is left for as long as `flush_timeout_s`.

`exit.json` is written before the final delivery on purpose: if the platform is down until the agent
gives up, the backend still learns how the learner ended from the file.

Every record is spooled to disk (learner_agent.spool) until the platform acks it. An agent started
again for a learner whose agent died (SIGKILL, OOM, a reboot) never runs the command again: it ends
what is left of the learner (bubblewrap's --die-with-parent has usually done so already), delivers
what the dead agent spooled, continuing its numbering, and reports the learner's end: exit code 137
("killed with its agent") or no code when the command had not started. The platform treats that as
any failed learner (a retry if the job has one left). See `_resume`.
"""
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from queue import SimpleQueue

from learner_agent import (address, archive, batch_changes, cgroups, diskwatch, procfs, sandbox, telemetry, tfevents,
                           trees)
from learner_agent.config import HALT_MARK, ConfigError, load_config
from learner_agent.files import read_json_object, write_atomically
from learner_agent.learner import LearnerProcess, end_process, iter_lines
from learner_agent.metrics import MetricExtractor, RegexProcess
from learner_agent.pace import Pace
from learner_agent.shipper import Shipper
from learner_agent.sizes import format_bytes
from learner_agent.spool import Spool, has_undelivered

log = logging.getLogger("learner_agent")

TERMINATE_GRACE_S = 5.0
MEMORY_CHECK_INTERVAL_S = 0.5
READERS_DRAIN_TIMEOUT_S = 10.0
# Once the learner has ended, a SIGTERM means "go away": deliver what you can quickly, then exit.
LAST_CALL_FLUSH_S = 5.0
# Variables the agent itself may keep; everything else is dropped by re-executing (see main()).
AGENT_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "SSL_CERT_FILE", "SSL_CERT_DIR")
_CLEAN_ENV_MARK = "LEARNER_AGENT_CLEAN_ENV"
HALT_FILE_POLL_S = 1.0
PREPARING_QUIET_S = 0.25  # a learner still preparing after this is shown as such (Agent._hold_status)
SPOOL_DIR = "spool"
# The folder the learner reads the platform's batch changes from (learner_agent.batch_changes), read-only to it.
CONTROL_DIR = "control"
BATCH_CONTROL_FILE = "batch.json"
SPOOL_RETRY_S, MAX_SPOOL_RETRY_S = 0.1, 5.0  # the learner's output waits out a spool that refuses it
LEARNER_PID_FILE = "learner.pid"  # {"pid", "start", "sandboxed"}: for an agent that has to end it after us


class PrepareError(Exception):
    """The command could not be started; the message is the `exited` reason."""


class Agent:
    def __init__(self, config, *, shipper=None, launcher=None, standby=None):
        self.config = config
        self._launcher = launcher  # a sandbox launcher started ahead by a spare agent (Popen), or None
        # The control group that launcher already waits in (cgroups.standby), or None; once adopted
        # as the learner's, the launcher need not join it (the slow step: learner_agent.cgroups).
        self._standby = standby
        self._launcher_in_group = False
        self._spent_groups = []  # standby groups not adopted, removed with the learner's
        self._batch_request = None  # the id of the platform's batch change last written for the learner
        self.shipper = shipper or Shipper(
            config.ingest_url, config.ingest_token, attempt=config.attempt, learner=config.learner,
            # On Kubernetes the learner shares our uid and sees our folder (state_dir), and nothing
            # ever starts a second agent: segments without a name keep it from forging records.
            spool=Spool(config.agent_file(SPOOL_DIR), max_bytes=config.spool_max_bytes,
                        anonymous=bool(config.state_dir)),
            on_gone=lambda: self.request_stop("gone"),
            on_answer=self._heard,
            # The local backend's agents outlive the platform's processes; a platform started again
            # elsewhere is found through the file it writes (learner_agent.address).
            current_url=((lambda: address.ingest_url(config.platform_file, config.job_id))
                         if config.platform_file else None))
        self._started_at = time.time()
        self._regexes = RegexProcess(config.metric_regexes, started=self._join_learner_group,
                                     on_stop=lambda reason: self._system_notice(
                                         f"{reason}; metrics are no longer taken from its log lines by regex "
                                         "(TRAINYARD_METRIC lines still count)"))
        self._extractor = MetricExtractor(searcher=self._regexes)
        self._metric_failures_logged = set()  # the streams whose failed metric extraction was logged
        self._pace = (Pace(config.log_bytes_per_second, config.log_burst_bytes)
                      if config.log_bytes_per_second else None)
        self._paced = False  # the learner has been told once that its output is slowed
        self._requests = SimpleQueue()  # reentrant put(): safe from signal handlers
        self._lock = threading.Lock()
        self._status_lock = threading.Lock()
        self._held_statuses = []  # status records waiting to leave with the next one (_hold_status)
        self._learner = None
        self._stop_kind = None  # "halt" | "terminate" | "gone", the strongest requested so far
        self._killed_after_grace = False
        self._oom_reason = None
        self._disk_reason = None  # a folder over its disk cap (learner_agent.diskwatch)
        self._cgroup = None  # the learner's control group, when the machine gives us one
        self._streams_open = True
        self._learner_ended = threading.Event()
        self._finished = False
        self._flush_deadline = None
        self._tailer_stop = threading.Event()
        self._tailer_thread = None

    # --- requests from outside (signal handlers, the shipper) ---

    def request_stop(self, kind):
        """Ask for "halt", "terminate" or "gone"; handled on the control thread."""
        self._requests.put(kind)

    def install_signal_handlers(self):
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("terminate"))
        signal.signal(signal.SIGINT, lambda *_: self.request_stop("terminate"))
        signal.signal(signal.SIGUSR1, lambda *_: self.request_stop("halt"))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    # --- the run, in order ---

    def run(self):
        """Run the learner to the end; returns the agent's exit code (0 unless the agent itself broke)."""
        threading.Thread(target=self._control_loop, name="control", daemon=True).start()
        if self.shipper.last_seq > 0 or os.path.exists(self.config.agent_file("exit.json")):
            return self._resume()
        if self.config.halt_file and self._halt_file_asks():
            self._handle_stop("halt")  # asked for before this agent was up: the command never starts
        elif self.config.halt_file:
            threading.Thread(target=self._watch_halt_file, name="halt-file", daemon=True).start()
        # Usually over in milliseconds: then `preparing` leaves with `running` (see _hold_status).
        self._hold_status("preparing", PREPARING_QUIET_S)
        try:
            argv, env, plan = self._prepare()
            sandboxed = plan is not None
            with self._lock:
                if self._stop_kind is not None:  # stopped while unpacking: never start it
                    raise PrepareError(self._stop_reason(killed=False))
                self._learner = (self._launch(plan) if sandboxed else
                                 LearnerProcess.start(argv, env=env, cwd=self.config.work_dir, sandboxed=False))
        except PrepareError as e:
            log.warning("not starting the command: %s", e)
            return self._finish(exit_code=None, reason=str(e))
        except OSError as e:
            log.exception("cannot start the command")
            return self._finish(exit_code=None, reason=f"cannot start the command: {e}")
        log.info("started the command as pid %d (sandbox: %s)", self._learner.pid,
                 "bwrap" if sandboxed else "none")
        write_atomically(self.config.agent_file(LEARNER_PID_FILE), json.dumps({
            "pid": self._learner.pid, "start": procfs.start_time(self._learner.pid), "sandboxed": sandboxed}),
            durable=True)
        self._record_status("running")
        tailer = self._event_file_tailer()
        if tailer is not None:
            self._tailer_thread = threading.Thread(target=tailer.run, args=(self._tailer_stop,),
                                                   name="tfevents", daemon=True)
            self._tailer_thread.start()
        returncode = self._supervise(self._learner)
        self._drain_event_files(tailer)
        exit_code = self._check_disk_at_end(returncode if returncode >= 0 else 128 - returncode)
        return self._finish(exit_code=exit_code, reason=self._exit_reason(returncode))

    def _prepare(self):
        config = self.config
        try:
            mode = sandbox.resolve_mode(config.sandbox)
        except sandbox.SandboxError as e:
            raise PrepareError(str(e)) from e
        if mode == "none" and config.sandbox == "auto":
            log.warning("running without a sandbox: %s", sandbox.bwrap_problem())
        try:
            for d in self._dirs_to_create():
                os.makedirs(d, exist_ok=True)
            self._unpack_code()
        except archive.ArchiveError as e:
            raise PrepareError(f"code archive rejected: {e}") from e
        except OSError as e:
            log.exception("preparing failed")
            raise PrepareError(f"preparing failed: {e}") from e
        if config.network_namespace and not os.path.exists(config.network_namespace):
            raise PrepareError(f"the job's network namespace {config.network_namespace} is gone "
                               "(its holder ended); the learners cannot reach each other")
        env = sandbox.build_env(work_dir=config.work_dir, cpus=config.cpus, learner_env=config.env)
        env[batch_changes.CONTROL_ENV] = os.path.join(self._control_dir(), BATCH_CONTROL_FILE)
        if mode == "none":
            self.discard_launcher()
            return sandbox.build_argv(config.command, network_namespace=config.network_namespace), env, None
        identity = sandbox.learner_identity(config.job_id, config.uid_number)
        if identity is not None:
            try:
                sandbox.hand_over(identity, tree=config.work_dir, dirs=self._dirs_to_create())
            except OSError as e:
                raise PrepareError(f"preparing failed: cannot hand the learner its folders: {e}") from e
        self._cgroup = self._adopt_standby() or self._make_cgroup()
        plan = sandbox.bwrap_plan(
            config.command, work_dir=config.work_dir, env=env, writable_dirs=config.writable_dirs,
            readonly_dirs=(*config.readonly_dirs, self._control_dir()), network_namespace=config.network_namespace,
            # The agent's own directory (config with the ingest token, pid, log) is never the learner's
            # business; its work/ directory inside is bound back as writable.
            hidden_dirs=(*config.hidden_dirs, config.agent_dir), identity=identity,
            tmp_bytes=self._tmp_bytes(), devices=sandbox.gpu_devices(env.get("CUDA_VISIBLE_DEVICES")),
            cgroup_procs=self._cgroup.procs_files if self._cgroup else (),
            # Without a pids cgroup, the job's own uid still bounds its processes.
            rlimit_nproc=config.max_processes if identity is not None and self._cgroup is None else None)
        log.info("learner uid %s; cgroup %s", identity.uid if identity else os.getuid(),
                 self._cgroup.procs_files if self._cgroup else "none")
        file_limit = diskwatch.file_size_limit(config.disk_caps, self._tmp_bytes())
        if file_limit is not None:
            plan = {**plan, "rlimit_fsize": file_limit}  # learner_agent.launch sets it last
        return None, None, plan

    def _tmp_bytes(self):
        """/tmp's and /dev/shm's size: the job's tmp cap, and never more than its memory (they are memory)."""
        sizes = [n for n in (self.config.memory_bytes, self.config.tmp_bytes) if n]
        return min(sizes) if sizes else None

    def _launch(self, plan):
        """The sandboxed learner: the launcher (learner_agent.launch) given its plan, the one started
        ahead by a spare agent if there is one (its interpreter's start-up then is not the learner's
        to wait for), else a new one. It moves the learner into its work_dir itself."""
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            try:
                # One already in the learner's group does not join it again (the kernel would wait again).
                ahead_plan = {**plan, "cgroup_procs": []} if self._launcher_in_group else plan
                return LearnerProcess.hand_plan(launcher, sandbox.encode_plan(ahead_plan), sandboxed=True)
            except OSError as e:  # it died meanwhile (EPIPE): start one as if there had been none
                log.warning("the launcher started ahead is gone (%s); starting another", e)
                end_process(launcher)
        plan_fd = sandbox.write_plan(plan)
        try:
            # The launcher's environment is fixed (sandbox.LAUNCHER_ENV): it may be root, and the
            # job's variables (LD_PRELOAD, PYTHONPATH) must not reach it; the learner's own travel in the plan.
            return LearnerProcess.start(sandbox.launcher_argv(plan_fd), env=sandbox.LAUNCHER_ENV,
                                        cwd=sandbox.PACKAGE_PARENT, sandboxed=True, pass_fds=(plan_fd,))
        finally:
            os.close(plan_fd)

    def discard_launcher(self):
        """End a launcher started ahead that no learner took (no sandbox after all, a resumed learner)."""
        _discard(self._launcher, self._standby)
        self._launcher = self._standby = None

    def _adopt_standby(self):
        """The group the launcher started ahead waits in, made the learner's (cgroups.Cgroup.adopt);
        None if there is none or it can't be (then the launcher joins a new one, as it would)."""
        standby, self._standby = self._standby, None
        if standby is None or self._launcher is None:
            if standby is not None:
                self._spent_groups.append(standby)
            return None
        config = self.config
        try:
            standby.adopt(f"{config.job_id}-a{config.attempt}-l{config.learner}", memory_bytes=config.memory_bytes,
                          cpus=config.cpus, max_processes=config.max_processes)
        except cgroups.CgroupError as e:
            log.info("the launcher's standby group is not the learner's (%s); making one", e)
            self._spent_groups.append(standby)  # empty once the launcher has joined the new one
            return None
        self._launcher_in_group = True
        return standby

    def _make_cgroup(self):
        config = self.config
        try:
            return cgroups.create(f"{config.job_id}-a{config.attempt}-l{config.learner}",
                                  memory_bytes=config.memory_bytes, cpus=config.cpus,
                                  max_processes=config.max_processes)
        except (cgroups.CgroupError, OSError) as e:
            log.warning("no control group for the learner (%s): memory is enforced by polling its "
                        "processes' RSS (files in its tmpfs are not counted; /tmp and /dev/shm are "
                        "capped at the memory limit instead), and there is no CPU quota", e)
            return None

    def _release_cgroup(self):
        groups, self._spent_groups = [self._cgroup, *self._spent_groups], []
        self._cgroup = None
        for group in groups:
            for problem in group.remove() if group is not None else ():
                log.warning("control group not removed: %s", problem)

    def _control_dir(self):
        return self.config.agent_file(CONTROL_DIR)

    def _heard(self, answer):
        """The platform's answer to a post (on the shipping thread): a batch change it asks of the
        learner goes into the learner's control file."""
        request = answer.get("batch")
        if not isinstance(request, dict) or request.get("id") == self._batch_request:
            return
        try:
            batch_changes.write_request(os.path.join(self._control_dir(), BATCH_CONTROL_FILE), request)
        except (OSError, KeyError, TypeError, ValueError) as e:
            log.warning("cannot hand the learner the platform's batch change %r: %s", request, e)
            return
        self._batch_request = request.get("id")
        log.info("the platform asks for global batch %s (change %s)", request.get("global_batch"), request.get("id"))

    def _dirs_to_create(self):
        env = self.config.env
        return [*self.config.writable_dirs, self._control_dir(),
                *(env[k] for k in ("RESULT_DIR", "CHECKPOINT_DIR", "JOB_STATE_DIR", "LOG_DIR")
                  if os.path.isabs(env.get(k, "")))]

    def _unpack_code(self):
        work_dir = self.config.work_dir
        if os.path.islink(work_dir):
            raise PrepareError(f"work_dir {work_dir} is a symlink")
        if os.path.isdir(work_dir) and os.listdir(work_dir):
            # A restarted agent starts again from a clean copy of the code.
            log.info("removing the previous contents of %s", work_dir)
            if not trees.remove(work_dir):
                raise PrepareError(f"the previous contents of {work_dir} could not be removed")
        work_cap = next((cap for cap in self.config.disk_caps if cap.name == "work"), None)
        limit = self.config.max_unpacked_bytes
        if work_cap is not None and work_cap.limit < limit:
            limit = work_cap.limit  # the code is the work folder's first content
        try:
            info = archive.extract_archive(self.config.code_archive, work_dir, max_unpacked_bytes=limit,
                                           max_members=self.config.max_members)
        except archive.ArchiveTooLarge as e:
            if limit == self.config.max_unpacked_bytes:
                raise
            raise PrepareError(f"disk cap: the code archive unpacks to more than the work folder's cap of "
                               f"{format_bytes(limit)} ({e}); nothing was run") from e
        log.info("unpacked %s: %d members, %d bytes", info.kind, info.members, info.unpacked_bytes)

    def _supervise(self, learner):
        """Ship the learner's output and watch its memory until it ends; returns its returncode."""
        readers = [threading.Thread(target=self._ship_lines, args=(pipe, stream), daemon=True,
                                    name=f"read-{stream}")
                   for pipe, stream in ((learner.stdout, "stdout"), (learner.stderr, "stderr"))]
        for reader in readers:
            reader.start()
        if self.config.memory_bytes:
            threading.Thread(target=self._watch_memory, args=(learner,), name="memory",
                             daemon=True).start()
        if self.config.disk_caps:
            threading.Thread(target=self._watch_disk, args=(learner,), name="disk", daemon=True).start()
        sampler = self._start_sampler(learner)
        returncode = learner.wait()
        self._learner_ended.set()
        self._note_kernel_oom_kill()
        if sampler is not None:
            sampler.stop()  # its last sample reads the group before anything is killed or removed
        # Anything the command left running in the background dies with it, as in a container; it
        # would otherwise keep the pipes open and the readers waiting forever.
        learner.kill()
        deadline = time.monotonic() + READERS_DRAIN_TIMEOUT_S
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            # A straggler (a process that escaped the group) must not add lines after `exited`.
            self._streams_open = False
        self._regexes.close()
        if any(reader.is_alive() for reader in readers):
            log.warning("output still open %.0fs after the command ended; ignoring the rest",
                        READERS_DRAIN_TIMEOUT_S)
        log.info("the command ended with returncode %d", returncode)
        return returncode

    def _start_sampler(self, learner):
        """Sample the learner's CPU, memory and GPUs into `resource` records (learner_agent.telemetry)."""
        config = self.config
        if not config.resource_sample_s:
            return None
        sampler = telemetry.Sampler(period_s=config.resource_sample_s, emit=self.shipper.add,
                                    cgroup=self._sampled_group(), pid=learner.pid,
                                    memory_limit_bytes=config.memory_bytes,
                                    visible_gpus=config.env.get("CUDA_VISIBLE_DEVICES"), nvml_module=config.nvml_module)
        sampler.start()
        return sampler

    def _join_learner_group(self, pid):
        """The process searching the manifest's regexes (RegexProcess) spends the learner's CPU quota."""
        if self._cgroup is not None:
            self._cgroup.join(pid)

    def _sampled_group(self):
        """The group the sampler reads: the learner's own; in a Kubernetes pod, where no group of its
        own can be made, the container's (the learner's and this agent's), whose memory the pod's limit
        is judged on; else none (the learner's processes from /proc)."""
        if self._cgroup is not None or not self.config.state_dir:
            return self._cgroup
        return cgroups.own_v2()

    def _ship_lines(self, pipe, stream):
        try:
            for line in iter_lines(pipe):
                now = time.time()
                records = [{"kind": "log", "stream": stream, "time": now, "line": line}]
                try:
                    records += [{"kind": "metric", **point, "time": now}
                                for point in self._extractor.extract(line)]
                except Exception:  # a metric bug must never cost a log line
                    # Once per stream: a learner repeating the line that fails would fill agent.log,
                    # which no cap of the job's counts, with a traceback per line.
                    if stream not in self._metric_failures_logged:
                        self._metric_failures_logged.add(stream)
                        log.exception("metric extraction failed on a %s line (further failures not logged)", stream)
                # Outside the lock: a full spool or the pace holds this pipe (and so the learner)
                # back, never the agent's stop handling.
                self._keep_pace(len(line))
                self.shipper.wait_for_room()
                if not self._spool_lines(records):
                    return
        except (OSError, ValueError):
            log.exception("reading the command's %s failed", stream)

    def _spool_lines(self, records):
        """Hand the records to the shipper; False once the streams are closed. While the spool cannot
        take them (its disk refuses even a new segment: learner_agent.spool) this waits and tries again,
        holding the learner's pipe back: a reader that gave up would leave the learner blocked on it."""
        delay = SPOOL_RETRY_S
        while True:
            with self._lock:
                if not self._streams_open:
                    return False
                try:
                    self.shipper.add_many(records)
                    return True
                except OSError as e:
                    problem = e
            log.warning("the spool cannot take the learner's output (%s); trying again in %.1fs", problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, MAX_SPOOL_RETRY_S)

    def _keep_pace(self, nbytes):
        if self._pace is None or not self._pace.take(nbytes) or self._paced:
            return
        self._paced = True
        self._system_notice(f"the learner prints faster than the platform takes output "
                            f"({format_bytes(self._pace.rate)}/s after {format_bytes(self._pace.burst)}): "
                            "its output is slowed to that pace, and its writes wait; nothing is dropped")

    def _watch_memory(self, learner):
        """Kill the whole learner once it exceeds its memory limit: as soon as the kernel OOM-killed
        any of its processes (with a cgroup), or when its processes' RSS sum is over (without)."""
        limit = self.config.memory_bytes
        while not self._learner_ended.wait(MEMORY_CHECK_INTERVAL_S):
            if self._cgroup is not None:
                if not self._note_kernel_oom_kill():
                    continue
            else:
                used = learner.rss_bytes()
                if used <= limit:
                    continue
                log.warning("the learner used %s", format_bytes(used))
                with self._lock:
                    self._oom_reason = self._memory_reason()
            learner.kill()
            return

    def _watch_disk(self, learner):
        """Kill the whole learner as soon as one of its capped folders is over (learner_agent.diskwatch)."""
        group = self._cgroup
        breach = diskwatch.watch(self.config.disk_caps, self._learner_ended,
                                 pids=lambda: learner_pids(learner, group))
        if breach is not None:
            self._note_disk_breach(breach)
            learner.kill()

    def _note_disk_breach(self, breach):
        log.warning("%s", breach.reason)
        with self._lock:
            if self._disk_reason is None:
                self._disk_reason = breach.reason

    def _check_disk_at_end(self, exit_code):
        """The learner's exit code, or 1 if it ended with a folder over its cap (the watchdog's kill may
        come as it exits 0 by itself, or it wrote fast and exited before a measurement): the attempt
        must not count as a success."""
        if self.config.disk_caps and self._disk_reason is None:
            breach, _ = diskwatch.check(self.config.disk_caps)
            if breach is not None:
                self._note_disk_breach(breach)
        if self._disk_reason is not None:
            return exit_code or 1
        return exit_code

    def _note_kernel_oom_kill(self):
        """True (and the exit reason set) when the kernel killed a process for the memory limit."""
        if self._cgroup is None or not self.config.memory_bytes or self._cgroup.oom_kills() == 0:
            return False
        with self._lock:
            if self._oom_reason is None:
                self._oom_reason = self._memory_reason()
                log.warning("%s (the kernel killed a process of the learner)", self._oom_reason)
        return True

    def _memory_reason(self):
        return f"memory limit {format_bytes(self.config.memory_bytes)} exceeded (OOM killed)"

    def _finish(self, *, exit_code, reason):
        """Write exit.json, record `exited`, deliver everything (patiently), then return 0."""
        self._release_cgroup()
        self._remove_scratch()
        self._write_exit(exit_code=exit_code, reason=reason)
        self._record_status("exited", exit_code=exit_code, reason=reason)
        return self._deliver()

    def _write_exit(self, *, exit_code, reason):
        """exit.json, on the disk itself: how the learner ended, for the backend even if the platform never hears."""
        write_atomically(self.config.agent_file("exit.json"), json.dumps(
            {"exit_code": exit_code, "reason": reason, "finished_at": time.time()}), durable=True)

    def _remove_scratch(self):
        """The learner's work folder (the unpacked code and whatever it wrote there) and its state
        folder are of no use once it has ended: they go, as the platform's teardown would remove
        them too. Results and checkpoints stay."""
        for folder in (self.config.work_dir, self.config.env.get("JOB_STATE_DIR", "")):
            # Only folders of this learner's own (beside agent.json): never a path the env could aim elsewhere.
            if folder and os.path.dirname(os.path.abspath(folder)) == os.path.abspath(self.config.agent_dir):
                trees.remove(folder)

    def _deliver(self):
        """Deliver everything spooled (patiently), then return 0; the spool goes once it is all
        acked, or can never be (410, refused credential), and stays for a later agent otherwise."""
        with self._lock:
            self._finished = True
            self._flush_deadline = time.monotonic() + self.config.flush_timeout_s
        delivered = False
        while True:
            with self._lock:
                remaining = self._flush_deadline - time.monotonic()
            if remaining <= 0 or self.shipper.stopped_reason is not None:
                break
            if self.shipper.flush(timeout=min(remaining, 1.0)):
                delivered = True
                break
        if delivered:
            log.info("all %d records delivered; exiting", self.shipper.last_seq)
        else:
            log.error("exiting with records %d..%d undelivered (%s)", self.shipper.acked + 1,
                      self.shipper.last_seq, self.shipper.stopped_reason or "flush timed out")
        self.shipper.close(timeout=1.0, discard_spool=delivered or self.shipper.stopped_reason is not None)
        return 0

    # --- TensorBoard event files (learner_agent.tfevents) ---

    def _event_file_tailer(self):
        """The reader of the learner's event files, or None when the manifest asks for none."""
        config = self.config
        if not config.tensorboard_dir:
            return None
        try:
            root, parts = tfevents.resolve_dir(config.tensorboard_dir, env=config.env, work_dir=config.work_dir)
        except tfevents.PathError as e:
            self._system_notice(f"TensorBoard event files are not read: {e}")
            return None
        return tfevents.EventFileTailer(root, parts, state_dir=config.agent_dir, ship=self._ship_event_records,
                                        notice=self._system_notice)

    def _ship_event_records(self, records):
        self.shipper.wait_for_room()  # a full spool holds the reading back; the file keeps the rest
        self.shipper.add_many(records, spool_now=True)

    def _drain_event_files(self, tailer):
        """Stop the timer's passes and read what the learner wrote last, before `exited` is recorded
        (the platform takes nothing of an attempt after its last learner ended)."""
        if tailer is None:
            return
        self._tailer_stop.set()
        if self._tailer_thread is not None:
            self._tailer_thread.join(READERS_DRAIN_TIMEOUT_S)
        try:
            tailer.drain()
        except Exception:
            log.exception("reading the last TensorBoard events failed")
        if tailer.skipped:
            log.info("tfevents: %d records skipped (over %d bytes, or failing their checksum)",
                     tailer.skipped, tfevents.MAX_RECORD_BYTES)

    def _system_notice(self, text):
        log.warning("%s", text)
        self.shipper.add({"kind": "log", "stream": "system", "line": f"learner agent: {text}"})

    # --- after an agent of this learner died ---

    def _resume(self):
        """Take over from a dead agent: end its learner, deliver its spool, report the learner's end.

        Running the command again here would ship a second run's output under the first run's
        numbering (the platform could not tell them apart); a lost learner is the lifecycle's to
        retry, as a new attempt, like any other failed learner."""
        with self._lock:
            self._streams_open = False  # nothing of the old learner's output can still arrive
        ended = read_json_object(self.config.agent_file("exit.json"))
        if ended is None:
            started = self._end_orphaned_learner()
            ended = {"exit_code": 137 if started else None,
                     "reason": ("killed: its learner agent died while it ran, and took it along" if started
                                else "its learner agent died before the command started")}
            self._write_exit(**ended)
        log.warning("resuming after a dead agent: %d records spooled, %d acked; the learner ended: %s",
                    self.shipper.last_seq, self.shipper.acked, ended)
        last = self.shipper.last_record()
        if not (last and last.get("kind") == "status" and last.get("state") == "exited"):
            # The dead agent's learner may have written summaries it never read: the offsets it
            # kept say where to continue (records it spooled again are dropped by the platform).
            self._drain_event_files(self._event_file_tailer())
            self._record_status("exited", exit_code=ended.get("exit_code"), reason=ended.get("reason", ""))
        return self._deliver()

    def _end_orphaned_learner(self):
        """Kill what is left of the dead agent's learner; False when it never started the command."""
        started = read_json_object(self.config.agent_file(LEARNER_PID_FILE))
        if started is None:
            return False
        pid = started.get("pid")
        if isinstance(pid, int) and procfs.start_time(pid) == started.get("start"):  # not a reused pid
            for victim in [*procfs.descendants(pid), pid]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(victim, signal.SIGKILL)
        if started.get("sandboxed"):
            self._cgroup = self._make_cgroup()  # the same group: whatever escaped the tree is in it
            self._release_cgroup()
        return True

    # --- stopping ---

    def _watch_halt_file(self):
        """Halt once the halt file holds HALT_MARK: Kubernetes updates the pod's downward-API
        annotations file when the backend annotates the pod (no signal can reach us); the local
        backend writes its file before it signals, for an agent that was not up yet to get the
        signal (run() reads it once before starting the command)."""
        while not self._learner_ended.wait(HALT_FILE_POLL_S):
            if self._halt_file_asks():
                self.request_stop("halt")
                return

    def _halt_file_asks(self):
        try:
            with open(self.config.halt_file, encoding="utf-8") as f:
                return HALT_MARK in f.read()
        except OSError:
            return False

    def _control_loop(self):
        while True:
            self._handle_stop(self._requests.get())

    def _handle_stop(self, kind):
        with self._lock:
            if self._finished:
                if kind != "halt":  # "go away": stop waiting for a platform that may be down
                    self._flush_deadline = min(self._flush_deadline, time.monotonic() + LAST_CALL_FLUSH_S)
                return
            if self._learner_ended.is_set():
                return
            # A stronger request (terminate, gone) overrides a halt in progress; nothing overrides those.
            if self._stop_kind is not None and not (self._stop_kind == "halt" and kind != "halt"):
                return
            self._stop_kind = kind
            learner = self._learner
        log.info("stop requested: %s", kind)
        if learner is not None:  # else run() sees _stop_kind before starting the command
            threading.Thread(target=self._stop_learner, args=(learner, kind), daemon=True,
                             name=f"stop-{kind}").start()

    def _stop_learner(self, learner, kind):
        if kind == "halt":
            sig, grace = signal.Signals[self.config.checkpoint_signal], self.config.grace_seconds
        else:
            sig, grace = signal.SIGTERM, TERMINATE_GRACE_S
        learner.send_signal(sig)
        if self._learner_ended.wait(grace):
            return
        with self._lock:
            if self._stop_kind == kind == "halt":
                self._killed_after_grace = True
        log.warning("the learner did not stop within %.0fs of %s; killing it", grace, sig.name)
        learner.kill()

    def _exit_reason(self, returncode):
        with self._lock:
            if self._oom_reason:
                return self._oom_reason
            if self._disk_reason:
                return self._disk_reason
            if self._stop_kind is not None:
                return self._stop_reason(killed=self._killed_after_grace)
        if returncode < 0:
            return f"killed by {signal.Signals(-returncode).name}"
        return ""

    def _stop_reason(self, *, killed):
        if self._stop_kind == "halt":
            return "halted: grace period expired, killed" if killed else "halted"
        if self._stop_kind == "gone":
            return "terminated: the platform ended this attempt"
        if self.config.platform_file and address.stopped_since(self.config.platform_file, self._started_at):
            # Its retry (if any) says so: the job did nothing wrong, the platform went away.
            return "terminated: the platform was stopped while the learner ran"
        return "terminated"

    def _record_status(self, state, **fields):
        """Record a status change, after any held back (_hold_status), in the same batch."""
        self._release_held_statuses({"kind": "status", "state": state, **fields})

    def _hold_status(self, state, seconds):
        """Record `state` (as of now) with the next status change, or on its own after `seconds`.

        Recorded at once, `preparing` went out in a request of its own just as the command was being
        started, and the agent's and the platform's work on it took the very moments the learner's
        start waited for. Held back, it leaves with `running` in one request, in order and with its own time, so the
        job's events say the same; an unpack that takes longer is still shown while it lasts."""
        with self._status_lock:
            self._held_statuses.append({"kind": "status", "state": state, "time": time.time()})
        timer = threading.Timer(seconds, self._release_held_statuses)
        timer.daemon = True
        timer.start()

    def _release_held_statuses(self, *then):
        with self._status_lock:
            held, self._held_statuses = self._held_statuses, []
            if held or then:
                self.shipper.add_many([*held, *then])


# --- process plumbing: the CLI entry point ---

def main(argv=None):
    """`python -m learner_agent run --config PATH [--detach]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m learner_agent")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run one learner")
    run_parser.add_argument("--config", required=True, help="path to agent.json")
    run_parser.add_argument("--detach", action="store_true",
                            help="detach from the caller (double fork); the caller returns at once")
    args = parser.parse_args(argv)
    try:
        # Checked before detaching, so whoever starts the agent gets a bad config as an error.
        config = load_config(args.config)
    except ConfigError as e:
        print(f"learner_agent: {e}", file=sys.stderr)
        return 2
    if args.detach and not _detach(config):
        return 0  # the caller's side of the double fork
    _drop_inherited_environment(config)
    return run_agent(config)


def run_agent(config, *, launcher=None, standby=None):
    """Run the agent in this process (signal handlers, pid file, agent.log) and return its exit code.
    `launcher`: a sandbox launcher a spare agent started ahead (Agent._launch), waiting in the control
    group `standby` (cgroups.standby) if it has one; the agent ends or adopts both."""
    if not _claim_learner(config):
        _discard(launcher, standby)
        return 0
    _guard_credential(config)
    _log_to_file(config.agent_file("agent.log"))
    agent = Agent(config, launcher=launcher, standby=standby)
    # Handlers first: the pid file is what the backend signals by, and SIGUSR1 unhandled would kill us.
    agent.install_signal_handlers()
    write_atomically(config.agent_file("agent.pid"), f"{os.getpid()}\n")
    log.info("agent %d for %s attempt %d learner %d", os.getpid(), config.job_id, config.attempt,
             config.learner)
    try:
        return agent.run()
    except Exception:
        log.exception("the agent failed")
        return 1
    finally:
        agent.discard_launcher()


def learner_pids(learner, group):
    """The learner's processes now: its control group's when it has one (a few small files, and a
    process that left the learner's tree is still in it), else the learner and its descendants, which
    reads every process on the machine at each measurement: with many agents, most of its CPU."""
    if group is not None:
        return group.pids()
    return [learner.pid, *procfs.descendants(learner.pid)]


def _discard(launcher, standby):
    """End a launcher started ahead, and remove the standby group it waited in (either may be None)."""
    if launcher is not None:
        end_process(launcher)
    if standby is not None:
        standby.remove()


def _claim_learner(config):
    """Make this the only agent that ever runs this learner; False (after saying why) if it is not.

    A deploy can be repeated while the agent it started is still coming up (reconcile re-drives a
    deploy it does not see progressing; a worker restarts mid-deploy): the backend then finds no pid
    yet and starts a second agent. Two agents would run the command twice and ship two different
    streams under the same seqs, which the platform cannot tell apart. So the first agent takes an
    exclusive lock on agent.lock for its whole life (the kernel drops it when the agent dies, however it
    dies), and an agent that finds the learner locked, or already ended (exit.json) with everything
    delivered, leaves at once. One that finds a dead agent's spool takes over from it (`Agent._resume`).
    """
    fd = os.open(config.agent_file("agent.lock"), os.O_WRONLY | os.O_CREAT, 0o600)  # not inherited
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        print(f"learner_agent {os.getpid()}: another agent is running this learner; leaving it alone",
              file=sys.stderr, flush=True)
        return False
    if os.path.exists(config.agent_file("exit.json")) and not has_undelivered(config.agent_file(SPOOL_DIR)):
        os.close(fd)
        print(f"learner_agent {os.getpid()}: this learner has already run (exit.json exists); not again",
              file=sys.stderr, flush=True)
        return False
    _CLAIMS.append(fd)
    return True


_CLAIMS = []  # the agent.lock descriptor, kept open (and locked) until the process exits


def _guard_credential(config):
    """Keep the ingest credential from the learner's own code, which may run as the agent's uid
    (always on Kubernetes, where they share a container).

    The token file (Kubernetes) is deleted now that it has been read, before the command starts; and
    the agent becomes non-dumpable, so a process of the same uid can neither ptrace it nor read its
    /proc/<pid>/mem or environ, where the token lives from now on. The command itself is unaffected:
    exec() makes it dumpable again."""
    if config.ingest_token_file:
        try:
            os.unlink(config.ingest_token_file)
        except FileNotFoundError:
            pass
        except OSError as e:  # a read-only mount: say so, the learner may be able to read it
            print(f"learner_agent: could not delete the ingest credential {config.ingest_token_file}: "
                  f"{e.strerror or e}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to guard this way
        import ctypes
        PR_SET_DUMPABLE = 4
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _detach(config):
    """Double fork: returns False in the caller (once the middle process is gone), True in the agent."""
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)  # exits right away; reaping it leaves no zombie in the caller
        return False
    try:
        os.setsid()  # no controlling terminal, not in the caller's process group
        if os.fork():
            os._exit(0)
        settle_in(config.agent_dir)  # the agent, now a child of init (or the nearest subreaper)
        return True
    except BaseException:
        os._exit(1)


def settle_in(agent_dir):
    """Work in the learner's folder, with stdin on /dev/null and stdout and stderr on its agent.log,
    so even a crash before logging is set up leaves a trace there (a detaching agent, a spare that
    was handed a learner: learner_agent.spare)."""
    os.chdir(agent_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(os.path.join(agent_dir, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)


def _drop_inherited_environment(config):
    """Re-exec with a minimal environment unless we already have one.

    Whoever starts the agent (a Celery worker) may hold platform secrets in its environment. The
    learner's environment is built fresh anyway, but without a sandbox a learner could still read the
    agent's /proc/<pid>/environ; after exec() that holds only harmless variables. The pid stays the same.
    """
    if os.environ.get(_CLEAN_ENV_MARK) or not sys.executable:
        return  # already re-executed or started clean (the marker also rules out an exec loop)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, agent_argv(config.path), clean_environment(os.environ))


def agent_argv(config_path):
    """The command line that starts an agent. `-S`: the agent needs only the standard library and
    finds this package through PYTHONPATH (clean_environment), so site-packages and their .pth
    files are skipped: a large share of the interpreter's start-up, paid once per learner before its
    command can start."""
    return [sys.executable, "-S", "-m", "learner_agent", "run", "--config", str(config_path)]


def clean_environment(environ):
    """What the agent keeps of `environ` (AGENT_ENV_KEEP), marked clean. A starter that gives the
    agent exactly this (the local backend) spares it the re-exec above: one interpreter start-up
    instead of two."""
    wanted = {k: environ[k] for k in AGENT_ENV_KEEP if k in environ}
    wanted["PYTHONPATH"] = sandbox.PACKAGE_PARENT
    wanted[_CLEAN_ENV_MARK] = "1"
    return wanted


def _log_to_file(path):
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
