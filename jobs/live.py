"""Fan-out of job updates to websocket clients, through the channel layer (Redis).

Publishing happens after the transaction commits, so a client never sees a status or a log line
that a rollback later takes back. A broken channel layer never fails the write that triggered it.
"""
import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)
CHUNK = 500  # lines per websocket message: big enough to batch, small enough to render smoothly


def job_group(job_id):
    return f"job.{job_id}"


def tenant_group(tenant_id):
    return f"tenant.{tenant_id}.jobs"


def publish_status_on_commit(job):
    from jobs.serializers import JobSerializer
    message = {"type": "job.status", "status": {
        "job": job.id, "status": job.status, "reason": job.status_reason, "attempt": job.attempt,
        "exit_code": job.exit_code, "time": job.updated_at.isoformat()},
        "job": JobSerializer(job).data}
    transaction.on_commit(lambda: _send([job_group(job.id), tenant_group(job.tenant_id)], message))


def publish_records_on_commit(job_id, lines, points):
    """lines, points: already in their JSON shape (jobs.serializers)."""
    if not lines and not points:
        return
    messages = [{"type": "job.logs", "lines": lines[i:i + CHUNK]} for i in range(0, len(lines), CHUNK)]
    if points:
        messages.append({"type": "job.metrics", "points": points})
    transaction.on_commit(lambda: [_send([job_group(job_id)], m) for m in messages])


def _send(groups, message):
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        for group in groups:
            async_to_sync(layer.group_send)(group, message)
    except Exception:  # noqa: BLE001 - live updates are best effort; REST and the backlog are the record
        log.warning("could not publish to %s", groups, exc_info=True)
