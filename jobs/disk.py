"""A job's disk: the caps on what it may write and keep, decided once at submission.

Caps (docs/submitting.md, "Disk caps"): `results` and `checkpoints` (bytes, per job: each folder as a whole,
every attempt's checkpoints together), `work` (bytes, per learner: its work folder with the unpacked
code, and its state folder), `tmp` (bytes, per learner: the size of its /tmp and /dev/shm, which are
memory), `logs` and `log_lines` (what of its log the platform stores, per job; jobs.logcap), `data`
(bytes, per job: the training data downloaded from its data stores; jobs.transfers).

Each is what the manifest's `disk` block asks, else the platform's default (settings.DISK_DEFAULTS).
A tenant's `disk_per_job_bytes` is the most any size cap of its jobs may be: a default above it is
lowered to it, and a manifest asking more is refused. Without that limit the defaults are also the
most a job may ask. The caps are stored with the job's runtime fields (jobs.runtime) and enforced
where the job writes: by the learner agent (learner_agent.diskwatch) for the folders, by the tmpfs
size for /tmp, by ingest for the log.

The tenant's `storage_bytes` quota bounds what all its jobs keep stored (tenants.quotas.stored_bytes):
a submission while the tenant is at or over it is refused.
"""
from django.conf import settings

from trainyard.units import format_bytes

SIZES = ("results", "checkpoints", "work", "tmp", "logs", "data")
CAPS = (*SIZES, "log_lines")


class DiskError(ValueError):
    """A job cannot have the disk it asks for; `field` names the manifest field (or the quota)."""

    def __init__(self, field_name, rule):
        self.field = field_name
        super().__init__(f"{field_name}: {rule}")


def caps_for(asked, quota):
    """{cap: value} for a new job of a tenant with `quota` (or None) whose manifest asks `asked`
    (trainyard.manifest.Manifest.disk)."""
    tenant_limit = quota.disk_per_job_bytes if quota is not None else None
    caps = {}
    for name in CAPS:
        default = settings.DISK_DEFAULTS[name]
        most = default if tenant_limit is None or name not in SIZES else tenant_limit
        value = asked.get(name)
        if value is None:
            caps[name] = min(default, most)
            continue
        if value > most:
            whose = ("the tenant's per-job disk limit" if most == tenant_limit and name in SIZES
                     else "the platform's limit")
            shown = str if name == "log_lines" else format_bytes
            raise DiskError(f"disk.{name}", f"{shown(value)} is more than {whose} ({shown(most)})")
        caps[name] = value
    return caps


def stored_caps(stored):
    """The caps kept in a job's runtime fields; a job submitted before caps existed gets today's defaults."""
    stored = stored or {}
    return {name: stored.get(name, settings.DISK_DEFAULTS[name]) for name in CAPS}


def describe(name, value):
    """"results folder cap 20.0 MiB" for messages."""
    if name == "log_lines":
        return f"log cap {value} lines"
    what = {"logs": "log", "tmp": "/tmp"}.get(name, f"{name} folder")
    return f"{what} cap {format_bytes(value)}"
