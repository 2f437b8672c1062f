"""Debian's PgBouncer, configured as deploy/pgbouncer/pgbouncer.ini configures it, in front of a
PostgreSQL server: for the tests of that file and for `bench controlplane`, which runs the platform
the way a deployment does. Only where things are changes (the server, a free port, trust auth on
this machine); pooling and resetting are the shipped file's.
"""
import configparser
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import dj_database_url

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "pgbouncer" / "pgbouncer.ini"


def executable():
    """The pgbouncer program, or None where it is not installed."""
    found = shutil.which("pgbouncer")
    if found is None and Path("/usr/sbin/pgbouncer").exists():
        found = "/usr/sbin/pgbouncer"
    return found


def shipped_config():
    config = configparser.ConfigParser(interpolation=None, comment_prefixes=(";",), delimiters=("=",))
    config.optionxform = str  # keys as written
    config.read(SHIPPED)
    return config


def on_server(connect_string, host, port):
    """A [databases] connect string pointed at host:port; its other settings as they are."""
    kept = [part for part in connect_string.split() if not part.startswith(("host=", "port="))]
    return " ".join([f"host={host}", f"port={port}", *kept])


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running(url):
    """PgBouncer in front of the server `url` names (postgres://...); yields a function that turns a
    database name into the URL of that database through PgBouncer. Stopped on leaving."""
    params = dj_database_url.parse(url)
    host, port, user = params["HOST"] or "127.0.0.1", int(params["PORT"] or 5432), params["USER"] or "postgres"
    config = shipped_config()
    listen = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    folder.chmod(0o755)  # PgBouncer refuses to run as root: it drops to the postgres user, who reads these
    config["databases"] = {"*": on_server(config["databases"]["*"], host, port)}
    config["pgbouncer"].update({"listen_addr": "127.0.0.1", "listen_port": str(listen), "auth_type": "trust",
                                "auth_file": str(folder / "userlist.txt"), "unix_socket_dir": ""})
    (folder / "userlist.txt").write_text(f'"{user}" "{params["PASSWORD"] or ""}"\n')
    with open(folder / "pgbouncer.ini", "w") as out:
        config.write(out)
    for path in folder.iterdir():
        path.chmod(0o644)
    command = [executable(), str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        command[1:1] = ["-u", "postgres"]
    log = open(folder / "pgbouncer.log", "w+b")  # opened here: PgBouncer's user need not write the folder
    bouncer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=1).close()
                break
            except OSError:
                if bouncer.poll() is not None:
                    raise RuntimeError(f"PgBouncer ended: {(folder / 'pgbouncer.log').read_text()}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("PgBouncer did not start listening") from None
                time.sleep(0.05)
        credentials = f"{user}:{params['PASSWORD']}@" if params["PASSWORD"] else f"{user}@"
        yield lambda name: f"postgres://{credentials}127.0.0.1:{listen}/{name}"
    finally:
        bouncer.terminate()
        bouncer.wait(10)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
