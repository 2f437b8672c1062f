"""Pure scheduling decisions: which queued jobs run next and where. No Django, no I/O.

`schedule(snapshot, queued, policy)` runs one cycle; see core.py for its steps and rules, and
bench/simulator/ for the discrete-event simulator that replays traces through the same code."""
from gpu_scheduler.core import schedule
from gpu_scheduler.model import (PRIORITY_RANK, Decisions, Node, Placement, Resources, SchedulingInputError,
                                 Snapshot, TenantPolicy, Workload)
from gpu_scheduler.policy import Policy

__all__ = ["PRIORITY_RANK", "Decisions", "Node", "Placement", "Policy", "Resources", "SchedulingInputError",
           "Snapshot", "TenantPolicy", "Workload", "schedule"]
