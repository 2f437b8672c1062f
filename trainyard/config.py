"""Where the client finds the platform and its token: TRAINYARD_URL, TRAINYARD_TOKEN and
TRAINYARD_TENANT, each winning over what `trainyard login` saved in ~/.config/trainyard/config.json
(or under XDG_CONFIG_HOME). The CLI and `trainyard.Client()` read the same settings."""
import json
import os
import re
from dataclasses import dataclass

from trainyard.errors import ConfigError

CONFIGURE_HINT = "set TRAINYARD_URL and TRAINYARD_TOKEN, or run `trainyard login --url URL --token TOKEN`"


@dataclass(frozen=True)
class Config:
    url: str
    token: str
    tenant: str = ""


def config_path(environ=None):
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "trainyard", "config.json")


def read_saved_config(path):
    try:
        with open(path) as saved:
            data = json.load(saved)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); run `trainyard login` again") from None
    return data if isinstance(data, dict) else {}


def load_config(environ=None, *, url=None, token=None, tenant=None):
    """Explicit arguments win, then environment variables, then what `trainyard login` saved, one
    setting at a time; but the saved token goes only to the platform it was saved for: with another
    URL (a TRAINYARD_URL set for a project, say) the token must be given as well."""
    environ = os.environ if environ is None else environ
    saved = read_saved_config(config_path(environ))
    url = url or environ.get("TRAINYARD_URL") or saved.get("url") or ""
    if not url:
        raise ConfigError(f"no Trainyard URL configured: {CONFIGURE_HINT}")
    url = normalize_url(url)
    token = token or environ.get("TRAINYARD_TOKEN") or ""
    if not token and saved.get("token"):
        if _saved_url(saved) != url:
            raise ConfigError(f"the token `trainyard login` saved is for {saved.get('url')}, not {url}: set "
                              "TRAINYARD_TOKEN for this one, or run `trainyard login` for it")
        token = saved["token"]
    tenant = tenant or environ.get("TRAINYARD_TENANT") or saved.get("tenant") or ""
    if not token:
        raise ConfigError(f"no API token configured: {CONFIGURE_HINT}")
    return Config(url=url, token=token, tenant=tenant)


def _saved_url(saved):
    try:
        return normalize_url(str(saved.get("url") or ""))
    except ConfigError:
        return None


def normalize_url(url):
    """The platform's base URL: no trailing slash, and no API path a user copied with it
    (`http://host:8000/api/v1` is the platform at `http://host:8000`; the client adds the path)."""
    if not re.match(r"^https?://[^/]+", url):
        raise ConfigError(f"{url!r} is not a Trainyard URL; write it like http://localhost:8000")
    return re.sub(r"(/api(/v1)?)?/*$", "", url)


def save_config(config, path):
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    data = {"url": config.url, "token": config.token, "tenant": config.tenant}
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.chmod(path, 0o600)  # also when the file existed with looser permissions
    with os.fdopen(descriptor, "w") as out:
        json.dump(data, out, indent=2)
        out.write("\n")
