"""A fake ingest endpoint and builders for agent runs, shared by the learner_agent and jobs tests (the
`ingest` and `outside_tmp` fixtures are in tests.support.fixtures).

The fake implements the ingest protocol the way the platform does (store only what continues the
stored sequence, drop resends, 409 on a gap, 410 when the attempt is over) and can drop connections at
random, before or after storing, to show that nothing is lost or repeated.
"""
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zipfile
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from learner_agent import cgroups, sandbox

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "test-token"


class IngestServer:
    def __init__(self, *, drop_rate=0.0, seed=0, token=TOKEN):
        self.records = defaultdict(list)  # (attempt, learner) -> stored records, in seq order
        self.requests = 0
        self.batches = []  # the seqs each request carried, in order of arrival
        self.body_sizes = []
        self.dropped = 0
        self.gone = False
        self.status_override = None  # answer every request with this status
        self.scripted = []  # statuses to answer the next requests with, before storing anything
        self.max_store_per_request = None  # store only a prefix of each batch (a partial ack)
        self.refused = defaultdict(list)  # (attempt, learner) -> refused records
        self.refuse = None  # record -> error text or None: refused records are acked and named, as the platform does
        self.answer_extra = {}  # added to every 200 answer (the platform's batch change: {"batch": {...}})
        self.drop_rate = drop_rate
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._token = token
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    @property
    def port(self):
        return self.httpd.server_address[1]

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/api/v1/ingest/training-test0001/"

    def stored(self, attempt=1, learner=0):
        with self._lock:
            return list(self.records[(attempt, learner)])

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, body):
        """(status, payload) or "drop-before"/"drop-after"; the protocol's rules live here."""
        with self._lock:
            drop = None
            if self._random.random() < self.drop_rate:
                drop = self._random.choice(["drop-before", "drop-after"])
                self.dropped += 1
            if drop == "drop-before":
                return drop
            data = json.loads(body)
            stored = self.records[(data["attempt"], data["learner"])]
            refused = self.refused[(data["attempt"], data["learner"])]
            acked = len(stored) + len(refused)
            if self.scripted:
                return self.scripted.pop(0), {"acked": acked}
            records = data["records"]
            self.batches.append([record["seq"] for record in records])
            if records and records[0]["seq"] > acked + 1:
                return 409, {"acked": acked}
            len_before = acked
            rejected = []
            for record in records:
                if record["seq"] <= acked:
                    continue
                if record["seq"] != acked + 1:
                    return 409, {"acked": acked}
                if self.max_store_per_request is not None and acked - len_before >= self.max_store_per_request:
                    break
                error = self.refuse and self.refuse(record)
                if error:
                    rejected.append({"seq": record["seq"], "error": error})
                    refused.append(record)
                else:
                    stored.append(record)
                acked += 1
            if drop:
                return drop
            if self.gone:
                return 410, {"detail": "attempt is over"}
            return 200, {"acked": acked, **({"rejected": rejected} if rejected else {}), **self.answer_extra}


def _handler_for(server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the platform's server does

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with server._lock:
                server.requests += 1
                server.body_sizes.append(len(body))
            if self.headers.get("Authorization") != f"Ingest {server._token}":
                return self._respond(401, {"detail": "bad token"})
            if server.status_override:
                return self._respond(server.status_override, {"detail": "override"})
            outcome = server.handle(body)
            if isinstance(outcome, str):
                return self._reset()
            self._respond(*outcome)

        def _respond(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _reset(self):
            # SO_LINGER 0 turns close() into a TCP reset: the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def log_message(self, *args):
            pass

    return Handler


def make_zip(path, files):
    with zipfile.ZipFile(path, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return path


def write_agent_config(base, ingest, *, command, files=None, **overrides):
    """A learner directory like the local backend's; returns the agent.json path."""
    learner_dir = os.path.join(base, "job", "attempt-1", "learner-0")
    os.makedirs(learner_dir)
    archive = make_zip(os.path.join(base, "job", "code.zip"), files or {"README": "code\n"})
    config = {
        "job_id": "training-test0001", "attempt": 1, "learner": 0, "command": command,
        "code_archive": archive, "work_dir": os.path.join(learner_dir, "work"),
        "env": {"TRAINYARD_JOB_ID": "training-test0001", "LEARNER_ID": "0"},
        "writable_dirs": [os.path.join(base, "job", "results")], "readonly_dirs": [],
        "hidden_dirs": [], "ingest_url": ingest.url, "ingest_token": TOKEN,
        "metric_regexes": {}, "sandbox": "none", "cpus": 1.0, "memory_bytes": 2**30,
        "checkpoint_signal": "SIGTERM", "grace_seconds": 5, "max_unpacked_bytes": 10**7,
        "max_members": 100, "flush_timeout_s": 30,
    }
    config.update(overrides)
    path = os.path.join(learner_dir, "agent.json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.chmod(path, 0o600)
    return path


def agent_command(config_path, *extra):
    return [sys.executable, "-m", "learner_agent", "run", "--config", config_path, *extra]


def agent_env(**extra):
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT, **extra)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def run_agent(config_path, *, timeout=30, **env):
    return subprocess.run(agent_command(config_path), env=agent_env(**env), timeout=timeout,
                          capture_output=True, text=True)


def read_exit(config_path):
    with open(os.path.join(os.path.dirname(config_path), "exit.json")) as f:
        return json.load(f)


def wait_for(predicate, *, timeout=10, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def has_status(server, state):
    return any(r["kind"] == "status" and r["state"] == state for r in server.stored())


def stop_process(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _real_cgroups_problem():
    if os.geteuid() != 0:
        return "cgroups need root"
    if sandbox.bwrap_problem() is not None:
        return sandbox.bwrap_problem()
    try:
        cgroups.create("probe", memory_bytes=2**30, cpus=1, max_processes=10).remove()
    except cgroups.CgroupError as e:
        return str(e)
    return None


_CGROUPS_PROBLEM = _real_cgroups_problem()
needs_cgroups = pytest.mark.skipif(_CGROUPS_PROBLEM is not None, reason=f"no writable cgroups here: {_CGROUPS_PROBLEM}")


CPU_BURNER = ("python3 -c \"import time\n"
              "wall, cpu = time.monotonic(), time.process_time()\n"
              "while time.monotonic() - wall < 2: pass\n"
              "print('cpu share', round((time.process_time() - cpu) / (time.monotonic() - wall), 2))\"")
