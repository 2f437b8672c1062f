"""What each node's learners used, minute by minute: the cluster page's history of use per node
(`GET /api/v1/cluster/use/`).

From the learners' resource samples (learner_agent.telemetry), every tenant's, in tenant-neutral
totals as the cluster page's other figures are. A sample's `cpu_cores` is its learner's cores over the
sampling period before it and `gpus_busy` its GPUs' utilisations summed (two GPUs at 50% are one busy
GPU), so a node's figure for a minute is, summed over its learners, each learner's mean over its
samples in the minute for as long as they cover (one sampling period each, at most the minute), over
the minute (over the part of it gone by, for the current one). The mean, not the sum: a learner
sending more samples than its period allows (jobs.ingest refuses most) counts once. A learner's
node is where its attempt placed it (the attempt's Allocation row); a node's GPU figure is None where
no sample of the minute read a GPU (no NVML there).

One GROUP BY over the window's samples, per learner and minute, whatever their number. Its cost grows
with every tenant's learners, and anyone signed in may ask: only the few WINDOWS are computed, each
shared by every caller for the minute it was made in (`shared_history`; a shorter history is cut from
the window that holds it), and a tenant has one computed at a time (tenants.throttling.CLUSTER_HISTORY).
"""
from datetime import timedelta

from django.conf import settings
from django.db.models import Avg, Count
from django.db.models.functions import TruncMinute
from django.utils import timezone

from jobs import shared_reads
from jobs.models import Allocation, ResourceSample

MINUTE_S = 60.0
MAX_MINUTES = 24 * 60
# The histories computed: any other length is cut from the shortest that holds it, so callers asking
# for each length in turn cannot make the database sum every tenant's samples again for each.
WINDOWS = (60, 6 * 60, MAX_MINUTES)


def shared_history(minutes):
    """history(minutes), as computed at most a minute ago for any caller: the minutes of the shortest
    of WINDOWS that holds it, from the minute `minutes` ago on."""
    window = next(w for w in WINDOWS if w >= minutes)
    since = timezone.now() - timedelta(minutes=minutes)
    return [{"name": node["name"], "points": points} for node in _window(window)
            if (points := [p for p in node["points"] if p["time"] > since - timedelta(seconds=MINUTE_S)])]


def _window(minutes):
    return shared_reads.shared(f"node-use:{minutes}", MINUTE_S, lambda: history(minutes))


def history(minutes, now=None):
    """[{"name": node, "points": [{"time", "cpu_cores", "gpus_busy"}]}] over the last `minutes`, oldest
    point first, nodes by name; only nodes and minutes some sample fell in."""
    now = now or timezone.now()
    since = now - timedelta(minutes=minutes)
    groups = list(ResourceSample.objects.filter(time__gte=since, time__lte=now)
                  .annotate(minute=TruncMinute("time"))
                  .values("job_id", "attempt", "learner", "minute")
                  .annotate(cpu=Avg("cpu_cores"), busy=Avg("gpus_busy"), samples=Count("id")))
    nodes = _nodes_of({(g["job_id"], g["attempt"]) for g in groups})
    period = settings.RESOURCE_SAMPLE_S or MINUTE_S
    totals = {}  # (node, minute) -> [core-seconds, busy GPU-seconds or None]
    for g in groups:
        node = nodes.get((g["job_id"], g["attempt"]), {}).get(g["learner"])
        if node is None:
            continue  # an attempt without a placement on record (it never ran)
        total = totals.setdefault((node, g["minute"]), [0.0, None])
        covered_s = min(MINUTE_S, g["samples"] * period)
        total[0] += g["cpu"] * covered_s
        if g["busy"] is not None:
            total[1] = (total[1] or 0.0) + g["busy"] * covered_s
    by_node = {}
    for (node, minute), (core_s, busy_s) in sorted(totals.items()):  # by node, then time
        span = max(1.0, min(MINUTE_S, (now - minute).total_seconds()))
        by_node.setdefault(node, []).append({
            "time": minute, "cpu_cores": round(core_s / span, 3),
            "gpus_busy": None if busy_s is None else round(busy_s / span, 3)})
    return [{"name": name, "points": points} for name, points in by_node.items()]


def _nodes_of(attempts):
    """{(job id, attempt): {learner index: node}} from the attempts' Allocation rows."""
    if not attempts:
        return {}
    job_ids = {job_id for job_id, _ in attempts}
    placed = {}
    for job_id, attempt, placement in (Allocation.objects.filter(job_id__in=job_ids)
                                       .values_list("job_id", "attempt", "placement")):
        if (job_id, attempt) in attempts:
            placed[(job_id, attempt)] = {i: p.get("node") for i, p in enumerate(placement or []) if p.get("node")}
    return placed
