"""Trainyard's Python client: submit training jobs, wait for them, stream their logs, read their
metrics, halt, resume, terminate and download what they produced.

    from trainyard import Client

    client = Client()  # TRAINYARD_URL, TRAINYARD_TOKEN (TRAINYARD_TENANT), or what `trainyard login` saved
    job = client.submit("examples/pytorch-digits/manifest.yml", "examples/pytorch-digits")
    for line in client.logs(job["id"], follow=True):
        print(line["line"])
    job = client.wait(job["id"])
    print(job["status"], job["latest_metrics"])
    client.download(job["id"], "out/")

The `trainyard` command (`trainyard.cli`) is built on this. The package needs only what its
distribution declares (requests and a few small libraries, pyproject.toml); it never imports Django.
"""
from trainyard.client import FINAL_STATUSES, RESTING_STATUSES, Client, Downloaded
from trainyard.errors import (ApiError, BadRequest, ConfigError, Conflict, ConnectionFailed, NotFound, PackingError,
                              ServerError, TrainyardError, Unauthorized, UsageError, WaitTimeout)

__all__ = ["Client", "Downloaded", "FINAL_STATUSES", "RESTING_STATUSES", "TrainyardError", "UsageError",
           "ConfigError", "PackingError", "ConnectionFailed", "WaitTimeout", "ApiError", "BadRequest",
           "Unauthorized", "NotFound", "Conflict", "ServerError"]
