"""What a learner pod's status means for the learner: a pure mapping from the pod (as the API server
returns it, a dict) to a LearnerStatus with a reason a user can act on.

Job status on Kubernetes comes mainly from the agent's ingest reports; this mapping is what reconcile
uses to settle learners whose agent could not report: killed for memory, an image that never pulled,
a pod nobody can schedule, a node that went away.
"""
from datetime import datetime, timezone

from jobs.backends.base import LearnerState, LearnerStatus
from jobs.backends.k8s.api import parse_quantity
from learner_agent.sizes import format_bytes  # the agent words the local backend's reason the same way

# Waiting reasons that will not fix themselves: the kubelet has given up or cannot even try.
IMAGE_PULL_FAILED = {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable"}
CONFIG_FAILED = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
NODE_LOST = {"NodeLost", "Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown",
             "UnexpectedAdmissionError"}


def learner_status(index, pod, *, exit_record=None, now=None, unschedulable_timeout_s=300.0):
    """The learner's status from its pod (None: no such pod) and its agent's exit record, if any.

    `exit_record` ({"exit_code", "reason"}, the agent's exit.json) is the learner's own outcome: the
    container's exit code is the agent's, which is 0 whenever the agent itself worked.
    """
    if pod is None:
        return LearnerStatus(index, LearnerState.MISSING, reason="its pod is gone (deleted, or its node was lost)")
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    container = _learner(status.get("containerStatuses"))
    terminated = (container.get("state") or {}).get("terminated") if container else None
    if phase in ("Succeeded", "Failed") or terminated:
        return _ended(index, pod, status, terminated, exit_record)
    if phase == "Unknown":
        node = (pod.get("spec") or {}).get("nodeName") or "?"
        return LearnerStatus(index, LearnerState.MISSING, reason=f"node {node} stopped reporting (pod phase Unknown)")
    if (pod.get("metadata") or {}).get("deletionTimestamp") and phase != "Running":
        return LearnerStatus(index, LearnerState.MISSING, reason="its pod is being deleted")
    stuck = _stuck_container(status)
    if stuck is not None:
        return LearnerStatus(index, LearnerState.EXITED, None, stuck)
    waiting = (container.get("state") or {}).get("waiting") if container else None
    if phase == "Running" and container and "running" in (container.get("state") or {}):
        return LearnerStatus(index, LearnerState.RUNNING)
    unschedulable = _unschedulable(status, pod)
    if unschedulable is not None:
        since, message = unschedulable
        waited = ((now or datetime.now(timezone.utc)) - since).total_seconds() if since else 0.0
        if waited >= unschedulable_timeout_s:
            return LearnerStatus(index, LearnerState.MISSING,
                                 reason=f"unschedulable for {waited:.0f}s: {message}")
        return LearnerStatus(index, LearnerState.PENDING, reason=f"unschedulable: {message}")
    return LearnerStatus(index, LearnerState.PENDING, reason=(waiting or {}).get("reason", ""))


def _ended(index, pod, status, terminated, exit_record):
    terminated = terminated or {}
    reason = terminated.get("reason") or ""
    if reason == "OOMKilled":
        limit = _memory_limit(pod)
        what = f"memory limit {format_bytes(limit)} exceeded" if limit else "memory limit exceeded"
        return LearnerStatus(index, LearnerState.EXITED, terminated.get("exitCode", 137), f"OOMKilled: {what}")
    if exit_record is not None:
        return LearnerStatus(index, LearnerState.EXITED, exit_record.get("exit_code"), exit_record.get("reason") or "")
    pod_reason = status.get("reason") or ""
    if pod_reason in NODE_LOST or (not terminated and status.get("phase") == "Failed"):
        message = status.get("message") or pod_reason or "the pod failed before its container ran"
        return LearnerStatus(index, LearnerState.MISSING, reason=f"{pod_reason or 'pod failed'}: {message}")
    detail = ((terminated.get("message") or "").strip().splitlines()[-1:] or [reason])[0] or "no reason given"
    return LearnerStatus(index, LearnerState.EXITED, terminated.get("exitCode"),
                         f"learner agent ended without an exit record ({detail})")


def _stuck_container(status):
    """Why a container (the agent-copying init container or the learner) can never start, or None."""
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in IMAGE_PULL_FAILED:
            image = container.get("image") or f"the {container.get('name')} image"
            return f"image pull failed: {image}: {waiting.get('message') or reason}"
        if reason in CONFIG_FAILED:
            return f"container {container.get('name')} could not start ({reason}): {waiting.get('message') or '-'}"
    return None


def _learner(containers):
    """The learner's container among a pod's `containers` (its spec's or their statuses), or None."""
    return next((container for container in containers or [] if container.get("name") == "learner"), None)


def _memory_limit(pod):
    container = _learner((pod.get("spec") or {}).get("containers")) or {}
    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return int(parse_quantity(limit)) if limit else None


def _unschedulable(status, pod):
    """(since, scheduler's message) when the scheduler could not place the pod, else None."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable":
            return _time(condition.get("lastTransitionTime")), condition.get("message") or "no node fits"
    return None


def _time(value):
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
