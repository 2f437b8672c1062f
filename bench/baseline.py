"""The bare side of an overhead ratio: the command alone, at the CPU limit its learner gets.

Through Trainyard a learner runs in a control group holding it to its manifest's `cpus`
(learner_agent.cgroups); a bare run without one may use every core, so the ratio would charge the
limit the researcher asked for to the platform. `cpu_limited(cpus)` gives the bare run the same
group. Not a benchmark of its own (excluded from `bench all`).
"""
import os
import uuid
from contextlib import contextmanager

from learner_agent import cgroups


@contextmanager
def cpu_limited(cpus):
    """A `preexec_fn` that moves the child into a fresh group of `cpus` CPUs, removed afterwards;
    raises cgroups.CgroupError where none can be made (the bench then says so, never runs unlimited)."""
    group = cgroups.create(f"bench-bare-{uuid.uuid4().hex[:10]}", memory_bytes=None, cpus=cpus, max_processes=4096)

    def join():
        for procs in group.procs_files:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    try:
        yield join
    finally:
        group.remove()
