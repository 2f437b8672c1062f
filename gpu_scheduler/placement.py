"""Where learners go: the free capacity of every node during one cycle, and the placement rules.

Nodes are kept in buckets by their number of free GPUs, so finding the fullest node that still fits
(packing) or the emptiest one (spread) costs a few dictionary looks, not a scan of a thousand nodes;
that is what keeps a cycle over 10,000 queued jobs within its budget. A node is in a bucket only
while it is schedulable and not reserved for a blocked job.
"""
from gpu_scheduler.model import CPU_EPSILON, Placement, SchedulingInputError
from gpu_scheduler.reasons import cpus_text, gib, gpus_text, learners_of

UNBOUNDED = 1 << 30


class NodeState:
    __slots__ = ("name", "total_gpus", "total_cpus", "total_memory", "gpu_ids", "cpus", "memory",
                 "schedulable", "reserved", "oldest_start")

    def __init__(self, node):
        self.name = node.name
        self.total_gpus, self.total_cpus, self.total_memory = node.gpus, node.cpus, node.memory_bytes
        self.gpu_ids = list(range(node.gpus))  # free GPU indices, ascending
        self.cpus, self.memory = node.cpus, node.memory_bytes
        self.schedulable = node.schedulable
        self.reserved = False
        self.oldest_start = None  # start time of the longest-running job here (None = nothing runs)


def learners_hosted(gpus, cpus, memory, per):
    """How many learners of shape `per` fit in the given free amounts."""
    count = UNBOUNDED
    if per.gpus:
        count = gpus // per.gpus
    if per.cpus > 0:
        count = min(count, int((cpus + CPU_EPSILON) // per.cpus))
    if per.memory_bytes:
        count = min(count, memory // per.memory_bytes)
    return max(count, 0)


class FreeMap:
    """Free capacity per node, after everything running (stopping jobs included) is subtracted."""

    def __init__(self, nodes, running):
        self.nodes = {}
        for node in nodes:
            if node.name in self.nodes:
                raise SchedulingInputError(f"node {node.name} appears twice in the snapshot")
            self.nodes[node.name] = NodeState(node)
        self._subtract_running(running)
        self.max_gpus = max((n.total_gpus for n in self.nodes.values()), default=0)
        self.buckets = [dict() for _ in range(self.max_gpus + 1)]  # free GPUs -> ordered set of nodes
        self.reserved_free_gpus = 0
        self.free_total = [0, 0.0, 0]  # over schedulable nodes, whatever their fragmentation
        for state in self.nodes.values():
            if state.schedulable:
                self.buckets[len(state.gpu_ids)][state] = None
                self._count_free(len(state.gpu_ids), state.cpus, state.memory)
        self._ever_hosts = {}
        self._kinds = None
        # Most of a long queue does not fit once the cluster is full: remember, per job shape, the
        # version of the free map at which it did not fit (and why), until something changes.
        self.version = 0
        self._no_fit = {}
        self._why_not = {}

    def _subtract_running(self, running):
        for workload in running:
            per = workload.per_learner
            for placement in workload.placement:
                state = self.nodes.get(placement.node)
                if state is None:
                    continue  # the node has left the cluster; its learners hold nothing placeable
                ids = state.gpu_ids
                for gpu in placement.gpu_ids:
                    try:
                        ids.remove(gpu)
                    except ValueError:
                        raise SchedulingInputError(
                            f"job {workload.job_id}: GPU {gpu} on node {state.name} is out of range or "
                            f"already held by another job") from None
                state.cpus -= per.cpus
                state.memory -= per.memory_bytes
                if state.oldest_start is None or workload.started < state.oldest_start:
                    state.oldest_start = workload.started

    # --- looking ---------------------------------------------------------------------------------
    def available(self):
        """Schedulable, unreserved nodes, emptiest first."""
        for bucket in reversed(self.buckets):
            yield from bucket

    def with_free_gpus(self, gpus):
        """Schedulable, unreserved nodes with at least this many free GPUs."""
        for free in range(gpus, self.max_gpus + 1):
            yield from self.buckets[free]

    def largest_block(self):
        for free in range(self.max_gpus, -1, -1):
            if self.buckets[free]:
                return free
        return 0

    def ever_hosts(self, per):
        """Learners of this shape the schedulable cluster could hold if it were empty."""
        key = (per.gpus, per.cpus, per.memory_bytes)
        if key not in self._ever_hosts:
            # By kind of node, not node by node: a queue whose jobs are each of a shape of their own
            # would otherwise cost a scan of the cluster per job.
            self._ever_hosts[key] = sum(count * learners_hosted(gpus, cpus, memory, per)
                                        for (gpus, cpus, memory), count in self._node_kinds().items())
        return self._ever_hosts[key]

    def _node_kinds(self):
        """{(GPUs, CPUs, memory) of a schedulable node: how many such nodes}; a cluster has few kinds."""
        if self._kinds is None:
            self._kinds = {}
            for state in self.nodes.values():
                if state.schedulable:
                    kind = (state.total_gpus, state.total_cpus, state.total_memory)
                    self._kinds[kind] = self._kinds.get(kind, 0) + 1
        return self._kinds

    def _find(self, per, packing):
        gpus = per.gpus
        if gpus > self.max_gpus:
            return None
        free_counts = range(gpus, self.max_gpus + 1) if packing else range(self.max_gpus, gpus - 1, -1)
        cpus, memory = per.cpus - CPU_EPSILON, per.memory_bytes
        for free in free_counts:
            for state in self.buckets[free]:
                if state.cpus >= cpus and state.memory >= memory:
                    return state
        return None

    # --- changing --------------------------------------------------------------------------------
    def _take(self, state, per):
        before = len(state.gpu_ids)
        taken, state.gpu_ids = tuple(state.gpu_ids[:per.gpus]), state.gpu_ids[per.gpus:]
        state.cpus -= per.cpus
        state.memory -= per.memory_bytes
        self._count_free(-per.gpus, -per.cpus, -per.memory_bytes)
        del self.buckets[before][state]
        self.buckets[len(state.gpu_ids)][state] = None
        return Placement(state.name, taken)

    def _give_back(self, placement, per):
        state = self.nodes[placement.node]
        before = len(state.gpu_ids)
        state.gpu_ids = sorted(state.gpu_ids + list(placement.gpu_ids))
        state.cpus += per.cpus
        state.memory += per.memory_bytes
        self._count_free(per.gpus, per.cpus, per.memory_bytes)
        del self.buckets[before][state]
        self.buckets[len(state.gpu_ids)][state] = None

    def give_back(self, placement, per):
        """Free what a trial placement took (see core's consolidation)."""
        self._give_back(placement, per)
        self.version += 1

    def _count_free(self, gpus, cpus, memory):
        total = self.free_total
        total[0] += gpus
        total[1] += cpus
        total[2] += memory

    def fits_in_total(self, per, learners):
        """Would the job fit if free capacity were not split across nodes (Kueue's quota view)?"""
        total = self.free_total
        return (per.gpus * learners <= total[0] and per.cpus * learners <= total[1] + CPU_EPSILON
                and per.memory_bytes * learners <= total[2])

    def place_learner(self, per, packing):
        state = self._find(per, packing)
        if state is None:
            return None
        self.version += 1
        return self._take(state, per)

    def place_gang(self, per, learners, packing):
        """All learners or none; packing puts each on the fullest node that fits."""
        shape = (per.gpus, per.cpus, per.memory_bytes, learners)
        if self._no_fit.get(shape) == self.version:
            return None
        placements = []
        for _ in range(learners):
            state = self._find(per, packing)
            if state is None:
                for taken in placements:
                    self._give_back(taken, per)  # exactly as before: the version stands
                self._no_fit[shape] = self.version
                return None
            placements.append(self._take(state, per))
        self.version += 1
        return placements

    def reserve(self, state):
        if state.reserved or not state.schedulable:
            return
        del self.buckets[len(state.gpu_ids)][state]
        self.version += 1
        state.reserved = True
        self.reserved_free_gpus += len(state.gpu_ids)

    def unreserve(self, state):
        if state.reserved:
            state.reserved = False
            self.reserved_free_gpus -= len(state.gpu_ids)
            self.buckets[len(state.gpu_ids)][state] = None
            self.version += 1

    def reserve_closest(self, per, learners):
        """Hold the nodes likely to fit a blocked job soonest, so that later (smaller) jobs backfill
        only the rest of the cluster and never delay it. Run times are heavy-tailed, so a job that has
        run long is likely to run much longer: prefer nodes whose oldest job started most recently
        (empty nodes first), then nodes with more free GPUs. CPU-only jobs prefer nodes with fewer
        free GPUs, not to keep GPUs idle for them."""
        candidates = [state for state in self.available()
                      if learners_hosted(state.total_gpus, state.total_cpus, state.total_memory, per)]
        gpu_sign = -1 if per.gpus else 1
        candidates.sort(key=lambda s: (s.oldest_start is not None, -(s.oldest_start or 0.0),
                                       gpu_sign * len(s.gpu_ids)))
        chosen, hosted = [], 0
        for state in candidates:
            chosen.append(state)
            hosted += learners_hosted(state.total_gpus, state.total_cpus, state.total_memory, per)
            if hosted >= learners:
                break
        for state in chosen:
            self.reserve(state)
        return chosen

    # --- explaining ------------------------------------------------------------------------------
    def why_not(self, per, learners):
        """Why a job that did not fit does not fit, in the terms a user can act on."""
        shape = (per.gpus, per.cpus, per.memory_bytes, learners)
        cached = self._why_not.get(shape)
        if cached is None or cached[0] != self.version:
            cached = self._why_not[shape] = (self.version, self._explain(per, learners))
        return cached[1]

    def _explain(self, per, learners):
        if self.ever_hosts(per) < learners:
            biggest = max((gpus for gpus, _, _ in self._node_kinds()), default=0)
            return (f"needs {learners_of(learners, per.gpus)} with {cpus_text(per.cpus)} and {gib(per.memory_bytes)} "
                    f"per learner; the cluster can never hold it (largest node has {gpus_text(biggest)})")
        gpus = per.gpus
        largest = self.largest_block()
        if gpus and largest < gpus:
            where = "on one node" if learners == 1 else "each on one node"
            reason = f"needs {learners_of(learners, gpus)} {where}; largest free block is {largest}"
        elif gpus and learners > 1:
            fit = sum(len(self.buckets[free]) * (free // gpus) for free in range(gpus, self.max_gpus + 1))
            if fit < learners:
                reason = f"needs {learners_of(learners, gpus)}; free GPUs fit only {fit} of them"
            else:
                reason = (f"needs {learners} learners each with {gpus_text(gpus)}, {cpus_text(per.cpus)} and "
                          f"{gib(per.memory_bytes)} on one node; not enough nodes have that much free")
        else:
            with_gpus = f" with {gpus_text(gpus)} free" if gpus else ""
            reason = (f"needs {cpus_text(per.cpus)} and {gib(per.memory_bytes)} memory on one node{with_gpus}"
                      f"{' per learner' if learners > 1 else ''}; no node has that much free")
        if self.reserved_free_gpus:
            held = gpus_text(self.reserved_free_gpus)
            reason += f" ({held} more {'is' if self.reserved_free_gpus == 1 else 'are'} held free for jobs ahead of it)"
        return reason


class Tally:
    """How many learners of one job would fit if some resources were freed (stopping jobs, would-be
    victims). Kept incrementally so that trying victims one by one costs only their own nodes."""

    def __init__(self, free, per, learners):
        self.free, self.per, self.learners = free, per, learners
        self.extra = {}  # NodeState -> [gpus, cpus, memory] that would be freed there
        self.count = sum(learners_hosted(len(s.gpu_ids), s.cpus, s.memory, per) for s in free.with_free_gpus(per.gpus))

    def _hosted(self, state):
        gpus, cpus, memory = self.extra.get(state, (0, 0.0, 0))
        return learners_hosted(len(state.gpu_ids) + gpus, state.cpus + cpus, state.memory + memory, self.per)

    def change(self, workload, sign):
        per = workload.per_learner
        for placement in workload.placement:
            state = self.free.nodes.get(placement.node)
            if state is None or state.reserved or not state.schedulable:
                continue  # freeing it would not help this job
            before = self._hosted(state)
            extra = self.extra.setdefault(state, [0, 0.0, 0])
            extra[0] += sign * len(placement.gpu_ids)
            extra[1] += sign * per.cpus
            extra[2] += sign * per.memory_bytes
            self.count += self._hosted(state) - before

    def fits(self):
        return self.count >= self.learners

    def plan(self):
        """The nodes this job would use once the resources are freed, and the GPUs it waits for there."""
        chosen, hosted, freed_gpus = [], 0, 0
        touched = sorted(self.extra, key=self._hosted, reverse=True)
        for state in touched + [s for s in self.free.available() if s not in self.extra]:
            can_host = self._hosted(state)
            if can_host <= 0:
                continue
            chosen.append(state)
            hosted += can_host
            freed_gpus += self.extra.get(state, (0,))[0]
            if hosted >= self.learners:
                break
        return chosen, freed_gpus
