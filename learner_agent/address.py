"""The platform's current address, in a file agents read: how an agent follows a platform that moved.

An agent is told where to post in its `agent.json`, written once at deploy. The local backend's
agents outlive the platform's processes (they are detached), and a platform started again may
listen elsewhere (`make demo` on another port, the first one taken): an agent that only knew the old
address would post there for as long as it runs, its learner's job stuck in PROCESSING. So each start
of the platform's worker writes the address here (`$TRAINYARD_DATA_DIR/platform.json`), `agent.json`
names the file (`platform_file`), and the agent reads it whenever it opens a connection: at its
start, and after every failed post. The platform's stop (the demo's Ctrl-C) marks the file stopped
before it stops the agents, so a learner stopped that way says why in its exit record.

{"ingest_url": "http://127.0.0.1:8001/api/v1/ingest/{job_id}/", "started_at": 1763726400.1,
 "stopped_at": null}

Standard library only (the agent's rule); the file holds no secret, only where the platform is.
"""
import json
import os
import time
import urllib.parse

from learner_agent.files import read_json_object, write_atomically

FILE_NAME = "platform.json"
JOB_ID = "{job_id}"  # stands for the agent's job in `ingest_url`


def path_in(data_dir):
    return os.path.join(str(data_dir), FILE_NAME)


def announce(path, ingest_url):
    """The platform (re)started and takes posts at `ingest_url` (with JOB_ID in it)."""
    _write(path, {"ingest_url": ingest_url, "started_at": time.time(), "stopped_at": None})


def mark_stopped(path):
    """The platform is stopping its learners; nothing is written when it never announced itself."""
    current = read(path)
    if current is not None:
        _write(path, dict(current, stopped_at=time.time()))


def read(path):
    """The file's content (a dict with a usable `ingest_url`), or None when absent or unusable."""
    data = read_json_object(path)
    if data is None or not _is_http_url(data.get("ingest_url")):
        return None
    return data


def ingest_url(path, job_id):
    """Where the agents of `job_id` post now, or None when the file does not say."""
    data = read(path)
    return data["ingest_url"].replace(JOB_ID, job_id) if data is not None else None


def stopped_since(path, since):
    """Whether the platform's stop was announced at or after `since` (a time.time())."""
    data = read(path)
    stopped = data.get("stopped_at") if data is not None else None
    return isinstance(stopped, (int, float)) and stopped >= since


def _is_http_url(value):
    if not isinstance(value, str):
        return False
    url = urllib.parse.urlsplit(value)
    return url.scheme in ("http", "https") and bool(url.hostname)


def _write(path, data):
    """Whole or not at all: agents read it at any moment."""
    write_atomically(path, json.dumps(data), mode=0o644)
