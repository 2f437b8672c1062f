"""The agent's configuration file (`agent.json`), read and checked in one place.

The platform's backend writes it (mode 0600, next to `agent.pid`, `agent.log` and `exit.json`); the
agent refuses to start on a config it doesn't understand rather than guessing, so a mistake shows up
as one clear error at deploy time instead of a learner that runs with the wrong limits.
"""
import json
import os
import re
import signal
from dataclasses import dataclass, field

from learner_agent import diskwatch, tfevents
from learner_agent.sandbox import MODES

MIN_SPOOL_BYTES = 2**20  # below this a few long lines would fill it
# What a halt file holds once a halt is asked for (a Kubernetes annotation line reads `trainyard.io/halt="<time>"`).
HALT_MARK = "trainyard.io/halt="
_REQUIRED_STRINGS = ("job_id", "command", "code_archive", "work_dir", "ingest_url")


class ConfigError(ValueError):
    """The config file is missing, unreadable, or breaks a rule; the message says which."""


@dataclass(frozen=True)
class AgentConfig:
    path: str  # the config file itself; its directory holds the agent's other files
    job_id: str
    attempt: int
    learner: int
    command: str
    code_archive: str
    work_dir: str
    ingest_url: str
    ingest_token: str = field(repr=False)
    # Where the token was read from on Kubernetes; the agent deletes it there before the learner starts.
    ingest_token_file: str = field(default="", repr=False)
    env: dict = field(default_factory=dict, repr=False)
    writable_dirs: tuple = ()
    readonly_dirs: tuple = ()
    hidden_dirs: tuple = ()
    metric_regexes: dict = field(default_factory=dict)
    # The manifest's `evaluation_metrics.in` for `type: tensorboard` (learner_agent.tfevents), else "".
    tensorboard_dir: str = ""
    sandbox: str = "auto"
    cpus: float = 1.0
    memory_bytes: int | None = None
    checkpoint_signal: str = "SIGTERM"
    grace_seconds: float = 60.0
    max_unpacked_bytes: int = 4 * 2**30
    # The job's caps on its folders (learner_agent.diskwatch.Cap), measured while the learner runs;
    # the `work` cap also bounds the unpacked code. `tmp_bytes`: /tmp's and /dev/shm's size (at most
    # memory_bytes, since they are memory).
    disk_caps: tuple = ()
    tmp_bytes: int | None = None
    max_members: int = 100_000
    # The learner's processes and threads (a pids cgroup, or RLIMIT_NPROC of the job's own uid):
    # enough for data-loader workers and their threads, few enough to stop a fork bomb.
    max_processes: int = 4096
    # The platform's number for the job's learners' uid (learner_agent.sandbox.learner_identity).
    uid_number: int | None = None
    flush_timeout_s: float = 86400.0
    # Records the platform has not acked yet, on disk (learner_agent.spool); when full, the learner's
    # output waits. 256MiB is about 2.5 million typical lines: a day of a chatty learner.
    spool_max_bytes: int = 256 * 2**20
    # How fast the learner's output is shipped (learner_agent.pace): past `log_burst_bytes`, at most
    # `log_bytes_per_second`; a learner printing faster waits on its own writes. 0: no pace.
    log_bytes_per_second: int = 0
    log_burst_bytes: int = 16 * 2**20
    # How often the learner's CPU, memory and GPUs are sampled (learner_agent.telemetry); 0: never,
    # unless the platform asks (TRAINYARD_RESOURCE_SAMPLE_S), so a config from before has no new records.
    resource_sample_s: float = 0.0
    # A pynvml-compatible file loaded in place of pynvml (learner_agent.telemetry.load_nvml): the
    # local backend's virtual GPUs (TRAINYARD_LOCAL_NVML_MODULE). "": the real NVML.
    nvml_module: str = ""
    network_namespace: str = ""  # /proc/<pid>/ns/net shared by a distributed job's learners (netns.py)
    # On Kubernetes the config is a read-only mount: the agent keeps its files in `state_dir`
    # instead. It halts when `halt_file` holds HALT_MARK: the pod's annotations (a downward-API file)
    # on Kubernetes, a file the local backend writes before its signal, which an agent still
    # coming up would miss.
    state_dir: str = ""
    halt_file: str = ""
    # Where the platform says its current address (learner_agent.address): the local backend's
    # agents outlive a restart of the platform, which may come back elsewhere. "" for none.
    platform_file: str = ""

    @property
    def agent_dir(self):
        return self.state_dir or os.path.dirname(self.path)

    def agent_file(self, name):
        return os.path.join(self.agent_dir, name)


def load_config(path):
    path = os.path.abspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a JSON object")
    return parse_config(data, path=path)


def parse_config(data, *, path):
    """An AgentConfig from the decoded JSON; relative paths are taken relative to the config's directory."""
    base = os.path.dirname(os.path.abspath(path))
    values = {"path": os.path.abspath(path)}
    for key in _REQUIRED_STRINGS:
        value = data.get(key)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: required, a non-empty string")
        values[key] = value
    values["ingest_token"] = _ingest_token(data)
    values["ingest_token_file"] = data.get("ingest_token_file") or ""
    for key in ("code_archive", "work_dir"):
        values[key] = os.path.join(base, values[key])
    for key in ("state_dir", "halt_file", "platform_file"):
        value = data.get(key) or ""
        if not isinstance(value, str):
            raise ConfigError(f"{key}: must be a path")
        values[key] = os.path.join(base, value) if value else ""
    for key in ("attempt", "learner"):
        values[key] = _integer(data, key, minimum=0 if key == "learner" else 1, required=True)
    env = data.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise ConfigError("env: must map variable names to values")
    values["env"] = {k: "" if v is None else str(v) for k, v in env.items()}
    for key in ("writable_dirs", "readonly_dirs", "hidden_dirs"):
        dirs = data.get(key) or []
        if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
            raise ConfigError(f"{key}: must be a list of directory paths")
        values[key] = tuple(os.path.join(base, d) for d in dirs)
    values["metric_regexes"] = _regexes(data.get("metric_regexes") or {})
    values["tensorboard_dir"] = _tensorboard_dir(data.get("tensorboard_dir") or "")
    sandbox = data.get("sandbox", "auto")
    if sandbox not in MODES:
        raise ConfigError(f"sandbox: must be one of {', '.join(MODES)}")
    values["sandbox"] = sandbox
    values["cpus"] = _number(data, "cpus", 1.0, minimum_exclusive=0)
    values["checkpoint_signal"] = _signal_name(data.get("checkpoint_signal", "SIGTERM"))
    values["grace_seconds"] = _number(data, "grace_seconds", 60.0, minimum=0)
    values["flush_timeout_s"] = _number(data, "flush_timeout_s", 86400.0, minimum=0)
    values["resource_sample_s"] = _number(data, "resource_sample_s", AgentConfig.resource_sample_s, minimum=0)
    for key, what in (("nvml_module", "an absolute path to a Python file"),
                      ("network_namespace", "an absolute path such as /proc/<pid>/ns/net")):
        value = data.get(key) or ""
        if not isinstance(value, str) or (value and not os.path.isabs(value)):
            raise ConfigError(f"{key}: must be {what}")
        values[key] = value
    for key in ("memory_bytes", "tmp_bytes", "max_unpacked_bytes", "max_members", "max_processes",
                "spool_max_bytes", "log_burst_bytes"):
        values[key] = _integer(data, key, minimum=1, default=getattr(AgentConfig, key))
    values["log_bytes_per_second"] = _integer(data, "log_bytes_per_second", minimum=0, default=0)
    values["uid_number"] = _integer(data, "uid_number", minimum=0, default=None)
    values["disk_caps"] = _disk_caps(data.get("disk_caps") or [], base)
    if values["spool_max_bytes"] < MIN_SPOOL_BYTES:
        raise ConfigError(f"spool_max_bytes: must be an integer >= {MIN_SPOOL_BYTES} (1MiB)")
    return AgentConfig(**values)


def _disk_caps(caps, base):
    """[{"name", "bytes", "paths"}, ...] → (diskwatch.Cap, ...); paths relative to the config's folder."""
    if not isinstance(caps, list):
        raise ConfigError("disk_caps: must be a list of {name, bytes, paths}")
    parsed = []
    for index, cap in enumerate(caps):
        where = f"disk_caps[{index}]"
        if not isinstance(cap, dict) or not isinstance(cap.get("name"), str) or not cap["name"]:
            raise ConfigError(f"{where}: must be a mapping with a name")
        limit, paths = cap.get("bytes"), cap.get("paths")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigError(f"{where}.bytes: must be an integer >= 1")
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError(f"{where}.paths: must be a non-empty list of folder paths")
        parsed.append(diskwatch.Cap(cap["name"], limit, tuple(os.path.join(base, p) for p in paths)))
    return tuple(parsed)


def _ingest_token(data):
    """The token itself (`ingest_token`), or read from `ingest_token_file` (a mounted Kubernetes Secret)."""
    token, token_file = data.get("ingest_token"), data.get("ingest_token_file")
    if (token is None) == (token_file is None):
        raise ConfigError("ingest_token or ingest_token_file: exactly one is required")
    if token_file is not None:
        if not isinstance(token_file, str) or not token_file:
            raise ConfigError("ingest_token_file: must be a path")
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ConfigError(f"ingest_token_file: cannot read {token_file}: {e.strerror or e}") from e
    if not isinstance(token, str) or not token:
        raise ConfigError("ingest_token: required, a non-empty string")
    return token


def _integer(data, key, *, minimum, required=False, default=None):
    value = data.get(key)
    if value is None and not required:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}: must be an integer >= {minimum}")
    return value


def _number(data, key, default, *, minimum=None, minimum_exclusive=None):
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: must be a number")
    if (minimum is not None and value < minimum) or (
            minimum_exclusive is not None and value <= minimum_exclusive):
        bound = f">= {minimum}" if minimum is not None else f"> {minimum_exclusive}"
        raise ConfigError(f"{key}: must be {bound}")
    return float(value)


def _regexes(regexes):
    if not isinstance(regexes, dict):
        raise ConfigError("metric_regexes: must map group names to regexes")
    for group, regex in regexes.items():
        if not isinstance(regex, str):
            raise ConfigError(f"metric_regexes.{group}: must be a regex string")
        try:
            re.compile(regex)
        except re.error as e:
            raise ConfigError(f"metric_regexes.{group}: not a valid regex ({e})") from e
    return dict(regexes)


def _tensorboard_dir(value):
    if not isinstance(value, str):
        raise ConfigError("tensorboard_dir: must be a path like $LOG_DIR/tb")
    if value:
        try:
            tfevents.split_dir(value)
        except tfevents.PathError as e:
            raise ConfigError(f"tensorboard_dir: {e}") from e
    return value


def _signal_name(name):
    if not isinstance(name, str) or name not in signal.Signals.__members__:
        raise ConfigError(f"checkpoint_signal: {name!r} is not a signal name like SIGTERM")
    return name
