"""Debian's PgBouncer, configured as deploy/pgbouncer/pgbouncer.ini configures it, in front of a
PostgreSQL server: for the tests of that file and for `bench controlplane`, which runs the platform
the way a deployment does. Only where things are changes (the server, a free port); pooling,
resetting and authentication are the shipped file's: clients log in with SCRAM against a SCRAM secret
in the user list, as docs/operating.md tells a deployment to list them, so every login costs what it
costs there.
"""
import base64
import configparser
import contextlib
import hashlib
import hmac
import os
import secrets
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


def scram_secret(password, iterations=4096):
    """The SCRAM-SHA-256 secret of `password` (RFC 7677), as PostgreSQL stores it in pg_authid and
    PgBouncer reads it from a user list: a login checks the client's proof against it without
    deriving a key from a password."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    encoded = [base64.b64encode(part).decode() for part in (salt, stored_key, server_key)]
    return f"SCRAM-SHA-256${iterations}:{encoded[0]}${encoded[1]}:{encoded[2]}"


class Bouncer:
    """A running PgBouncer: the URL of a database through it, and how many clients have logged in."""

    def __init__(self, user, password, port, log):
        self.user, self.password, self.port, self.log = user, password, port, log

    def url(self, name):
        return f"postgres://{self.user}:{self.password}@127.0.0.1:{self.port}/{name}"

    def logins(self):
        """Clients logged in so far (PgBouncer logs each login, log_connections being on by default)."""
        return self.log.read_bytes().count(b" login attempt: ")


@contextlib.contextmanager
def running(url):
    """PgBouncer in front of the server `url` names (postgres://...); yields its Bouncer. Clients log
    in to it with a password of its own; it logs in to the server as `url` does. Stopped on leaving."""
    params = dj_database_url.parse(url)
    host, port, user = params["HOST"] or "127.0.0.1", int(params["PORT"] or 5432), params["USER"] or "postgres"
    config = shipped_config()
    listen = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    folder.chmod(0o755)  # PgBouncer refuses to run as root: it drops to the postgres user, who reads these
    # Its own logins to the server use the server's password, where it has one (the user list holds the
    # clients' secret, not the server's).
    server = on_server(config["databases"]["*"], host, port)
    config["databases"] = {"*": f"{server} password={params['PASSWORD']}" if params["PASSWORD"] else server}
    config["pgbouncer"].update({"listen_addr": "127.0.0.1", "listen_port": str(listen),
                                "auth_file": str(folder / "userlist.txt"), "unix_socket_dir": ""})
    password = secrets.token_urlsafe(24)
    (folder / "userlist.txt").write_text(f'"{user}" "{scram_secret(password)}"\n')
    with open(folder / "pgbouncer.ini", "w") as out:
        config.write(out)
    for path in folder.iterdir():
        path.chmod(0o644)
    command = [executable(), str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        command[1:1] = ["-u", "postgres"]
    log_path = folder / "pgbouncer.log"
    log = open(log_path, "w+b")  # opened here: PgBouncer's user need not write the folder
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
        yield Bouncer(user, password, listen, log_path)
    finally:
        bouncer.terminate()
        bouncer.wait(10)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
