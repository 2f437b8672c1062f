"""Strict parsing of the environment variables that configure Trainyard.

Settings come only from the environment (12-factor), so a typo there must fail loudly at start-up
with the variable's name, not surface later as a confusing runtime error.
"""
import os
from pathlib import Path
from urllib.parse import urlparse


class ConfigError(Exception):
    """A configuration variable has a value Trainyard cannot use."""


def text(name, default=None, *, environ=None):
    """`environ`: another mapping to read instead of this process's environment (the runner's, for
    the processes it starts)."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value == "":
        return default
    return value


def boolean(name, default=False):
    value = text(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use true/false, yes/no, on/off or 1/0")


def integer(name, default, *, minimum=None, environ=None):
    return _parsed(name, default, int, "an integer", minimum, environ)


def number(name, default, *, minimum=None):
    return _parsed(name, default, float, "a number", minimum)


def _parsed(name, default, parse, kind, minimum, environ=None):
    value = text(name, environ=environ)
    if value is None:
        return default
    try:
        parsed = parse(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not {kind}") from None
    if minimum is not None and parsed < minimum:
        raise ConfigError(f"{name}={value!r} must be at least {minimum}")
    return parsed


def choice(name, default, choices):
    value = text(name, default)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(choices)}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(name, default):
    """A logging level's name in any case (`debug` is DEBUG), upper-cased. Django's logging set-up would
    refuse another name too, but with a traceback that does not name the variable."""
    value = text(name, default)
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{name}={value!r} is not a log level; use one of: {', '.join(LOG_LEVELS)} (any case)")
    return level


def url(name, default, *, schemes):
    value = text(name, default)
    scheme = urlparse(value).scheme
    if scheme not in schemes:
        raise ConfigError(f"{name}={value!r} must be a URL starting with one of: "
                          + ", ".join(f"{s}://" for s in schemes))
    return value


def host_list(name):
    """A comma-separated list of host names, IP addresses and CIDR networks, each one checked."""
    import ipaddress
    import re
    entries = tuple(entry.strip() for entry in (text(name) or "").split(",") if entry.strip())
    for entry in entries:
        try:
            ipaddress.ip_network(entry.strip("[]"), strict=False)
        except ValueError:
            labels = entry.rstrip(".").split(".")
            if len(entry) > 253 or not all(re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?", label)
                                           for label in labels):
                raise ConfigError(f"{name}: {entry!r} is not a host name, an IP address or a CIDR network "
                                  "(e.g. minio.internal, 10.0.5.7, 10.0.5.0/24)") from None
    return entries


def port_file(path, default):
    """The port number a file holds (a running process wrote it down), or `default` when there is
    no such file or it holds no port."""
    try:
        port = int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return default
    return port if 0 < port < 65536 else default
