"""Batch changes without a restart: the learners' half (docs/elastic.md, "Batch changes inside a
running attempt").

The autoscaler changes the number of an elastic job's learners through a checkpoint and a restart,
but its global batch alone inside the running learners (jobs.lifecycle.change_batch), when they say
they can:

1. the platform answers each post of the attempt's agents with the change it asks for; each agent
   writes it to a file its learner can read, named by TRAINYARD_BATCH_CONTROL (`write_request`);
2. learner 0 looks at that file at a step boundary (`BatchChanges.poll`, one `stat` when nothing
   changed) and shares what it found with the other learners in the step's own collective
   (`BatchChange.as_values` / `from_values`: the other learners contribute zeros to a sum), so all
   of them switch after the same step;
3. once switched, learner 0 says so (`applied`: report(batch_applied=id)); the report travels through
   the agent's spool like any metric, and the platform ends the timeline's stretch at the old batch
   and starts one at the new.

A learner that never makes a BatchChanges is never asked: `BatchChanges()` on learner 0 reports
LISTENING_METRIC once, and without it the autoscaler changes the batch through a restart instead.

Standard library only, like the rest of the package's helpers for learners.
"""
import json
import os
from dataclasses import dataclass

from learner_agent import report
from learner_agent.files import write_atomically

__all__ = ["APPLIED_METRIC", "CONTROL_ENV", "LISTENING_METRIC", "BatchChange", "BatchChanges", "write_request"]

CONTROL_ENV = "TRAINYARD_BATCH_CONTROL"
LISTENING_METRIC = "batch_changes"  # learner 0 applies batch changes while it runs (value 1)
APPLIED_METRIC = "batch_applied"  # learner 0 runs at the change with this id since this step


@dataclass(frozen=True)
class BatchChange:
    """A global batch the platform asks the running learners to switch to."""
    id: int  # the change's row in the platform's allocation timeline; grows with every change asked
    global_batch: int
    local_batch: int  # global_batch / world size
    lr_scale: float  # the learning-rate factor for global_batch (the manifest's lr_scaling)

    def as_values(self):
        """Four floats to share with the other learners (learner 0's; the others pass `NO_CHANGE`)."""
        return (float(self.id), float(self.global_batch), float(self.local_batch), float(self.lr_scale))

    @classmethod
    def from_values(cls, values):
        """The change `as_values` gave (summed with the other learners' zeros), or None for none."""
        change_id, global_batch, local_batch, lr_scale = (float(v) for v in values)
        if change_id < 1:
            return None
        return cls(int(round(change_id)), int(round(global_batch)), int(round(local_batch)), lr_scale)


NO_CHANGE = (0.0, 0.0, 0.0, 0.0)


class BatchChanges:
    """Learner 0's view of the changes asked; other learners get theirs through `from_values`."""

    def __init__(self, path=None, *, rank=None):
        self.path = path if path is not None else (os.environ.get(CONTROL_ENV) or "")
        self.rank = int(os.environ.get("RANK") or 0) if rank is None else rank
        self._applied = 0
        self._stamp = None
        self._asked = None
        if self.rank == 0 and self.path:
            report(**{LISTENING_METRIC: 1})

    def poll(self):
        """On learner 0: the latest change asked and not yet applied, or None (on any other learner,
        outside the platform, or when the file is unreadable: a half-written or foreign file is
        read again at the next poll)."""
        if self.rank != 0 or not self.path:
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        if stamp != self._stamp:
            self._asked = _read(self.path)
            self._stamp = stamp if self._asked is not None else None
        return self._asked if self._asked is not None and self._asked.id > self._applied else None

    def applied(self, change, *, step=None):
        """The learners run at `change` from now on; learner 0 tells the platform."""
        self._applied = max(self._applied, change.id)
        if self.rank == 0:
            report(**{APPLIED_METRIC: change.id}, step=step)


def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        change = BatchChange(id=data["id"], global_batch=data["global_batch"], local_batch=data["local_batch"],
                             lr_scale=float(data["lr_scale"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (change.id, change.global_batch, change.local_batch)) or not change.lr_scale > 0:
        return None
    return change


def write_request(path, request):
    """The agent's half: put the platform's request where the learner (maybe of a uid of its own)
    reads it, whole or not at all."""
    write_atomically(path, json.dumps({key: request[key] for key in ("id", "global_batch", "local_batch",
                                                                      "lr_scale")}), mode=0o644)
