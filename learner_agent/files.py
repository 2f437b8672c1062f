"""The agent's small JSON and text files, written whole or not at all: whoever reads them (the
backend, a later agent, the platform's other processes) sees the old content or the new, never half
of it. Stdlib only, like the rest of the agent."""
import json
import os


def read_json_object(path):
    """The JSON object in the file, or None when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_atomically(path, text, *, mode=0o600, durable=False):
    """Write `text` to a temporary file beside `path` and rename it over `path`. `durable`: on the
    disk itself before the rename (fsync), for a file that must outlive the machine going down."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
