"""The platform's secret key when the operator sets none: generated once, kept in the data directory.

Django signs sessions, CSRF tokens and password-reset links with SECRET_KEY, and data-store credentials
are sealed with a key derived from it (jobs.datastores), so it must be unguessable and the same in
every process (web server, Celery worker, beat, manage.py) that shares TRAINYARD_DATA_DIR. The first
process to start writes a fresh random key; the others, even when they start at the same moment, read
that one. An explicit TRAINYARD_SECRET_KEY always wins (portal.settings).
"""
import os
import secrets
from pathlib import Path

from portal.env import ConfigError

FILE_NAME = "secret_key"
MIN_LENGTH = 50  # Django's own check (security.W009) wants at least 50 characters


class SecretKeyError(ConfigError):
    """The key file cannot be created or is unsafe to use; the message names the file and the fix."""


def load_or_create(data_dir):
    """The key kept in `data_dir`, created (mode 0600) if there is none yet."""
    path = Path(data_dir) / FILE_NAME
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    try:
        _create(path)
    except FileExistsError:
        pass  # another process created it first: everyone uses that one
    except OSError as exc:
        raise SecretKeyError(f"cannot create the secret key file {path}: {exc.strerror or exc}; make "
                             f"TRAINYARD_DATA_DIR writable or set TRAINYARD_SECRET_KEY") from exc
    return _read(path)


def _create(path):
    """Write a new key so that it appears complete or not at all, and only if no key exists yet.

    The key goes into a private temporary file first (O_EXCL, 0600) and is then hard-linked to its
    name; link() fails if the name exists, so of two processes starting together exactly one wins
    and the other never sees a half-written file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(64) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.link(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _read(path):
    mode = path.stat().st_mode
    if mode & 0o077:
        raise SecretKeyError(f"{path} is readable by other users (mode {mode & 0o777:o}); "
                             f"run: chmod 600 {path}")
    key = path.read_text(encoding="utf-8").strip()
    if len(key) < MIN_LENGTH:
        raise SecretKeyError(f"{path} holds no usable key (fewer than {MIN_LENGTH} characters); "
                             f"delete it to have a new one generated, or set TRAINYARD_SECRET_KEY")
    return key
