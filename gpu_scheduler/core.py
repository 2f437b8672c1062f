"""One scheduling cycle over a snapshot, shaped like Kueue's:

1. heads of queues: every tenant's queue, ordered by priority, service level, then submission order;
2. snapshot: free capacity per node (running and stopping jobs subtracted), usage per tenant and user;
3. nominate: the next job is the best head across tenants (see `_order_key`);
4. admit: check the tenant's limits, then place all learners at once (gang) or none (an elastic job
   whose start size does not fit: the most learners that fit, at least its minimum);
5. a job that does not fit may wait for resources being freed, pick preemption victims, have small
   jobs moved off a node (consolidation), or, once it has waited long, get the nodes likeliest to
   fit it soon held for it; smaller jobs behind it backfill the rest of the cluster;
6. requeue: every job not admitted gets a reason that starts with its position in its tenant queue.

Cross-tenant rules (also in gpu_scheduler/README.md):
- Priority orders jobs inside a tenant, and across tenants only in the shared pool (tenants without a
  quota, or every tenant when quotas are off). Between tenants the order is: jobs that fit in their
  tenant's guaranteed quota first, then borrowing / shared-pool jobs by the tenant's weighted dominant
  share beyond its quota (fair share), then soft-over-budget tenants last. Ties (the same share and
  rank) go to the tenant with the least recent attained service (TenantPolicy.recent_gpu_s /
  recent_cpu_s, in cluster-seconds), then to submission order: a tenant's long backlog cannot take
  every slot that frees while another tenant waits.
- A job may halt (preempt) running work that is: (a) of a soft-over-budget tenant; (b) of another
  tenant borrowing beyond its quota, when the job fits inside its own tenant's quota (reclaim);
  (c) of lower priority in the same tenant, or in the shared pool when the job's tenant is in it too
  and, with fair share on, the job keeps its tenant within its fair share (an equal weighted part of
  the cluster among the tenants with running or queued work, by dominant resource) while the
  victim's tenant is above its own: a tenant at or over its fair share halts only its own work;
  (d) with fair-share preemption, of the same priority in the shared pool under the same two
  conditions (the job keeps its tenant within its fair share, the victim's tenant is above its own),
  so one tenant's backlog holding the whole cluster cannot make another wait for its jobs to end.
  Victims are the fewest, lowest-priority, most recently started ones; the job itself waits until they
  have stopped, and the nodes it will use are held for it meanwhile.
- Consolidation moves (halts, to restart at once elsewhere) small single-learner jobs of no higher
  priority, of any tenant: it takes no capacity away from their tenant, only the work since their
  last checkpoint.

Pure: no Django, no I/O. The caller applies the decisions (admits, halts) and calls again.
"""
import bisect
import heapq
import itertools
from collections.abc import Sequence

from gpu_scheduler.model import CPU_EPSILON, PRIORITY_RANK, Decisions, SchedulingInputError, Snapshot, Workload
from gpu_scheduler.placement import FreeMap, Tally
from gpu_scheduler.policy import Policy
from gpu_scheduler.reasons import exceeds_quota, gpus_text, job_seen_by, learners_of, position_prefix, quota_in_use

__all__ = ["schedule"]

DIMENSIONS = ("gpus", "cpus", "memory_bytes")


def schedule(snapshot: Snapshot, queued: Sequence[Workload] = (), policy: Policy = Policy.full()) -> Decisions:
    if not policy.gang:
        return _PodByPodCycle(snapshot, queued, policy).run()
    return _Cycle(snapshot, queued, policy).run()


class _TenantState:
    """A tenant's usage during one cycle (running + stopping + admitted so far)."""
    __slots__ = ("policy", "used", "nominal", "jobs", "user_gpus", "blocked", "blocked_users", "capacity",
                 "recent_service")

    def __init__(self, policy, quotas_on, capacity):
        self.policy = policy
        self.used = [0, 0.0, 0]
        quota = policy.quota if quotas_on else None
        self.nominal = None if quota is None else (quota.gpus, quota.cpus, quota.memory_bytes)
        self.jobs = 0
        self.user_gpus = {}
        self.blocked = None  # a tenant-wide limit hit earlier in this cycle: later jobs wait behind it
        self.blocked_users = {}
        self.capacity = capacity
        # Attained service in cluster-seconds: each resource-second weighted by the inverse of the
        # cluster's total of that resource (a GPU-second on 16 GPUs counts 1/16, a CPU-second on 64
        # CPUs 1/64), so GPU and CPU-only work add up on one scale and a dimension the cluster lacks
        # counts nothing; divided by the tenant's weight, like its share.
        service = 0.0
        for attained, total in ((policy.recent_gpu_s, capacity[0]), (policy.recent_cpu_s, capacity[1])):
            if total > 0:
                service += attained / total
        self.recent_service = service / policy.weight

    def add(self, workload, learners):
        per = workload.per_learner
        self.used[0] += per.gpus * learners
        self.used[1] += per.cpus * learners
        self.used[2] += per.memory_bytes * learners
        self.user_gpus[workload.user] = self.user_gpus.get(workload.user, 0) + per.gpus * learners

    def within_quota(self, per, learners):
        if self.nominal is None:
            return False
        used, nominal = self.used, self.nominal
        return (used[0] + per.gpus * learners <= nominal[0]
                and used[1] + per.cpus * learners <= nominal[1] + CPU_EPSILON
                and used[2] + per.memory_bytes * learners <= nominal[2])

    def borrowing_in(self, per, used=None):
        """Uses (`used`, else its usage now) more than its quota in a dimension this job needs (no quota: all)."""
        nominal, used = self.nominal or (0, 0.0, 0), self.used if used is None else used
        needs = (per.gpus, per.cpus, per.memory_bytes)
        return any(need and u > quota + CPU_EPSILON for need, u, quota in zip(needs, used, nominal))

    def dominant_share(self, extra=(0, 0.0, 0)):
        """The largest fraction of any cluster resource the tenant holds (with `extra` added)."""
        return max((
            (used + more) / total for used, more, total in zip(self.used, extra, self.capacity) if total > 0),
            default=0.0)

    def share(self):
        """Weighted dominant share of the cluster used beyond the tenant's quota (Kueue's DRS)."""
        nominal = self.nominal or (0, 0.0, 0)
        share = 0.0
        for used, quota, total in zip(self.used, nominal, self.capacity):
            if total > 0 and used > quota:
                share = max(share, (used - quota) / total)
        return share / self.policy.weight


class _Cycle:
    def __init__(self, snapshot, queued, policy):
        self.snapshot, self.policy = snapshot, policy
        self.free = FreeMap(snapshot.nodes, snapshot.running)
        capacity = [0, 0.0, 0]
        for node in snapshot.nodes:
            capacity[0] += node.gpus
            capacity[1] += node.cpus
            capacity[2] += node.memory_bytes
        self.capacity = capacity
        self.tenants = {}
        self.ranks = {}  # job_id -> (priority rank, service level), see _rank_all
        self.stopping = []
        running_ids = set()
        for workload in snapshot.running:
            running_ids.add(workload.job_id)
            state = self._tenant(workload.tenant)
            state.add(workload, len(workload.placement))
            state.jobs += 1
            if workload.stopping:
                self.stopping.append(workload)
        self.queues = self._tenant_queues(queued, running_ids)
        self.decisions = Decisions()
        self.reservations_left = policy.reservations
        self.checks_left = policy.preemption_checks if policy.preemption else 0
        self.claimed = set()  # running jobs picked as victims in this cycle
        self.head_of_line = None  # strict FIFO (backfill off): the job everything else waits behind
        self._victims_by_tenant = None
        self.failed_searches = {}
        self._movable = None
        self._weights = None  # the tenants' weights summed, once every tenant with demand is known

    def _tenant(self, name):
        state = self.tenants.get(name)
        if state is None:
            state = self.tenants[name] = _TenantState(self.snapshot.tenant(name), self.policy.quotas, self.capacity)
        return state

    def _tenant_queues(self, queued, running_ids):
        queues = {}
        for workload in queued:
            if workload.placement:
                raise SchedulingInputError(f"job {workload.job_id}: a queued workload must have no placement")
            if workload.job_id in running_ids:
                raise SchedulingInputError(f"job {workload.job_id} is both queued and running")
            queues.setdefault(workload.tenant, []).append(workload)
        self._rank_all(queued)
        ranks = self.ranks
        for name, queue in queues.items():
            queue.sort(key=lambda w: (ranks[w.job_id], w.order, w.job_id))
            self._tenant(name)
        return queues

    # --- 3. nominate and order -------------------------------------------------------------------
    def _order_key(self, state, workload):
        within = state.within_quota(workload.per_learner, workload.learners)
        soft = state.policy.budget == "soft_exceeded"
        fair = self.policy.fair_share
        share = state.share() if fair and not within else 0.0
        # Among jobs of equal rank, the tenant that has had the least recent service goes first:
        # submission order alone let a tenant's long backlog take every slot that came free.
        service = state.recent_service if fair else 0.0
        return (soft, not within, share, self.ranks[workload.job_id], service, workload.order, workload.job_id)

    def _rank_all(self, workloads):
        """Fill self.ranks: (priority rank, service level), smaller is served first and may halt
        larger; fixed for the cycle (one `now`)."""
        # One tight loop over every job: in a cycle with 10,000 queued jobs, a method call per job
        # is a measurable share of the cycle. Most jobs have had no service: level 0.
        ranks, first = self.ranks, (self.policy.service_levels or (float("inf"),))[0]
        for workload in workloads:
            level = 0 if workload.attained_gpu_s < first and not workload.placement else self._level(workload)
            ranks[workload.job_id] = (PRIORITY_RANK[workload.priority], level)

    def _level(self, workload):
        """0 until the job has had `service_levels[0]` GPU-seconds, 1 until the next threshold, ...
        A queued job that has waited `promote_after_s` is back at 0, so demoted jobs cannot starve."""
        thresholds = self.policy.service_levels
        if not thresholds:
            return 0
        now = self.snapshot.now
        if not workload.placement and workload.queued_at is not None \
                and now - workload.queued_at >= self.policy.promote_after_s:
            return 0
        return bisect.bisect_right(thresholds, workload.service_gpu_s(now))

    def run(self):
        heads = []
        for name, queue in self.queues.items():
            heapq.heappush(heads, (self._order_key(self.tenants[name], queue[0]), name, 0))
        while heads:
            _, name, index = heapq.heappop(heads)
            queue, state = self.queues[name], self.tenants[name]
            self.decisions.position[queue[index].job_id] = index + 1
            self._consider(queue[index], state, index + 1)
            if index + 1 < len(queue):
                heapq.heappush(heads, (self._order_key(state, queue[index + 1]), name, index + 1))
        return self.decisions

    # --- 4. admit --------------------------------------------------------------------------------
    def _consider(self, workload, state, position):
        if self.head_of_line is not None:
            return self._wait(workload, position,
                              f"behind {job_seen_by(workload.tenant, self.head_of_line)} (strict FIFO)")
        if state.blocked is not None:
            return self._wait(workload, position, state.blocked)
        if workload.user in state.blocked_users:
            return self._wait(workload, position, state.blocked_users[workload.user])
        limit = self._limit(workload, state)
        if limit is not None:
            return self._wait(workload, position, limit)
        placements = self.free.place_gang(workload.per_learner, workload.learners, self.policy.packing)
        if placements is None:
            placements = self._place_smaller(workload)
        if placements is None:
            return self._blocked_by_capacity(workload, state, position)
        self.decisions.admitted[workload.job_id] = placements
        state.add(workload, len(placements))
        state.jobs += 1

    def _place_smaller(self, workload):
        """An elastic job whose start size does not fit starts with fewer learners, the most that fit
        and at least its minimum (it grows later, when GPUs are idle); None for a fixed job."""
        if not workload.min_learners:
            return None
        for learners in range(workload.learners - 1, workload.min_learners - 1, -1):
            placements = self.free.place_gang(workload.per_learner, learners, self.policy.packing)
            if placements is not None:
                return placements
        return None

    def _limit(self, workload, state):
        """Why the tenant's own limits keep this job waiting, or None. Tenant-wide limits also hold the
        tenant's later jobs (strict FIFO inside a tenant, so a big job is not starved by its small
        siblings); a job that can never fit the limit holds nobody."""
        policy, per, learners = state.policy, workload.per_learner, workload.learners
        if policy.budget == "hard_exceeded":
            state.blocked = policy.budget_reason or "tenant budget exhausted"
            return state.blocked
        if policy.max_jobs is not None and state.jobs >= policy.max_jobs:
            state.blocked = f"tenant concurrent jobs {state.jobs}/{policy.max_jobs}"
            return state.blocked
        gpus = per.gpus * learners
        cap = policy.max_gpus_per_user
        if cap is not None and gpus:
            if gpus > cap:
                return f"needs {gpus} GPUs, more than the per-user GPU cap of {cap}"
            used = state.user_gpus.get(workload.user, 0)
            if used + gpus > cap:
                state.blocked_users[workload.user] = f"user GPU cap {used}/{cap} in use"
                return state.blocked_users[workload.user]
        if state.nominal is None or state.within_quota(per, learners):
            return None
        if policy.can_borrow and self.policy.borrowing:
            return None
        needs = (gpus, per.cpus * learners, per.memory_bytes * learners)
        for dimension, need, used, quota in zip(DIMENSIONS, needs, state.used, state.nominal):
            if need > quota + CPU_EPSILON:
                return exceeds_quota(dimension, need, quota)
        for dimension, need, used, quota in zip(DIMENSIONS, needs, state.used, state.nominal):
            if used + need > quota + CPU_EPSILON:
                state.blocked = quota_in_use(dimension, used, quota)
                if self._preempt_within_quota(workload, state, needs):
                    return f"for its tenant's lower-ranked work being halted ({state.blocked})"
                return state.blocked
        return None

    def _wait(self, workload, position, reason):
        self.decisions.waiting[workload.job_id] = position_prefix(position) + reason

    # --- 5. a job that does not fit ----------------------------------------------------------------
    def _blocked_by_capacity(self, workload, state, position):
        per, learners = workload.per_learner, workload.learners
        if self.checks_left <= 0 and self.reservations_left <= 0 and self.policy.backfill:
            # Nothing left to try this cycle but saying why: the common case in a long queue.
            return self._wait(workload, position, self.free.why_not(per, learners))
        # The same search for the same kind of job (tenant, priority, shape) on an unchanged free map
        # finds nothing again: skip it, so the bounded checks go to different jobs.
        search = (workload.tenant, workload.priority, per.gpus, per.cpus, per.memory_bytes, learners)
        placement_aware = self.policy.preempt_for_placement or not self.free.fits_in_total(per, learners)
        if self.checks_left > 0 and placement_aware and self.failed_searches.get(search) != self.free.version \
                and self.free.ever_hosts(per) >= learners:
            self.checks_left -= 1
            self.failed_searches[search] = self.free.version
            tally = Tally(self.free, per, learners)
            for stopping in self.stopping:
                tally.change(stopping, +1)
            if tally.fits():
                return self._wait_for_freed(workload, position, tally)
            victims = self._pick_victims(workload, state, tally)
            if victims:
                for victim, reason in victims:
                    self._halt(victim, reason)
                return self._wait_for_freed(workload, position, tally)
            if self.policy.consolidate and self._consolidate(workload, position):
                return None
        if not self.policy.backfill:
            self.head_of_line = workload
        reason = self.free.why_not(per, learners)
        soft = state.policy.budget == "soft_exceeded"
        if self.reservations_left > 0 and not soft and self._waited_long(workload) \
                and self.free.ever_hosts(per) >= learners:
            if self.free.reserve_closest(per, learners):
                self.reservations_left -= 1
                reason += "; the nodes closest to fitting are held for it"
        self._wait(workload, position, reason)

    # --- consolidation ----------------------------------------------------------------------------------
    def _consolidate(self, workload, position):
        """Packing still leaves holes as jobs end: an 8-GPU job can wait while a node has 7 free GPUs
        and one small job. If small single-learner jobs (no higher priority than this one, running
        for at least `move_after_s`, at most `move_max_share` of this job's GPUs in all) can start again right now
        elsewhere, halt them through their checkpoint so that this job gets the node; they lose only
        the work since their last checkpoint, and the GPUs stop idling. Single-learner jobs only."""
        per = workload.per_learner
        if workload.learners != 1 or per.gpus < 2 or not self.free.fits_in_total(per, 1):
            return False
        best = None
        for node in list(self.free.with_free_gpus((per.gpus + 1) // 2)):
            movers = self._movers(node, workload)
            if movers and (best is None or movers[0] < best[0]):
                best = (movers[0], node, movers[1])
        if best is None:
            return False
        _, node, victims = best
        self.free.reserve(node)
        if not self._can_restart_elsewhere(victims):
            self.free.unreserve(node)
            return False
        for victim in victims:
            self._halt(victim, f"moved: halted through its checkpoint to make room for "
                               f"{job_seen_by(victim.tenant, workload)}; restarts at once on free GPUs elsewhere")
        moved = sum(v.per_learner.gpus for v in victims)
        self._wait(workload, position, f"for {gpus_text(moved)} being freed by moving smaller jobs")
        return True

    def _movers(self, node, workload):
        """The fewest GPUs to move off this node for the job to fit there: (gpus moved, victims) or None."""
        per, rank = workload.per_learner, PRIORITY_RANK[workload.priority]
        by_node = self._single_learner_jobs()
        candidates = sorted((v for v in by_node.get(node.name, ())
                             if v.job_id not in self.claimed and PRIORITY_RANK[v.priority] >= rank
                             and self.snapshot.now - v.started >= self.policy.move_after_s),
                            key=lambda v: (v.per_learner.gpus, -v.started))
        freed, cpus, memory, victims = len(node.gpu_ids), node.cpus, node.memory, []
        for victim in candidates:
            if freed >= per.gpus and cpus + CPU_EPSILON >= per.cpus and memory >= per.memory_bytes:
                break
            victims.append(victim)
            freed += victim.per_learner.gpus
            cpus += victim.per_learner.cpus
            memory += victim.per_learner.memory_bytes
        fits = freed >= per.gpus and cpus + CPU_EPSILON >= per.cpus and memory >= per.memory_bytes
        moved = sum(v.per_learner.gpus for v in victims)
        if not victims or not fits or moved > self.policy.move_max_share * per.gpus:
            return None
        return (moved, len(victims)), victims

    def _single_learner_jobs(self):
        if self._movable is None:
            self._movable = {}
            for running in self.snapshot.running:
                if running.learners == 1 and len(running.placement) == 1 and running.preemptible \
                        and not running.stopping:
                    self._movable.setdefault(running.placement[0].node, []).append(running)
        return self._movable

    def _can_restart_elsewhere(self, victims):
        """Try placing the victims on the free capacity left (the node is already held); undo it."""
        placed, ok = [], True
        for victim in victims:
            placements = self.free.place_gang(victim.per_learner, 1, packing=True)
            if placements is None:
                ok = False
                break
            placed.append((victim, placements))
        for victim, placements in placed:
            for placement in placements:
                self.free.give_back(placement, victim.per_learner)
        return ok

    def _waited_long(self, workload):
        """Reservations go only to jobs that have waited `reserve_after_s`: most blocked jobs find room
        through normal churn soon, and holding nodes idle for them would cost more than it saves."""
        if workload.queued_at is None:
            return self.policy.reserve_after_s <= 0
        return self.snapshot.now - workload.queued_at >= self.policy.reserve_after_s

    def _preempt_within_quota(self, workload, state, needs):
        """A job held by its own tenant's quota may halt that tenant's work ranked below it (lower
        priority, or the same priority at a lower service level), like Kueue's withinClusterQueue
        preemption: the fewest such jobs that bring it inside the quota and give it room on the
        nodes. True if victims are picked or already stopping; the job then waits for them, with the
        nodes it will use held for it. Later jobs of the tenant stay behind it (the quota is full)."""
        if not self.policy.preemption or self.checks_left <= 0:
            return False
        self.checks_left -= 1
        used = list(state.used)
        tally = Tally(self.free, workload.per_learner, workload.learners)

        def take(victim, sign=+1):
            _release(used, victim, sign)
            tally.change(victim, sign)

        def fits():
            return tally.fits() and all(u + n <= q + CPU_EPSILON for u, n, q in zip(used, needs, state.nominal))

        for stopping in self.stopping:
            if stopping.tenant == workload.tenant:
                take(stopping)
            else:
                tally.change(stopping, +1)
        chosen = []
        if not fits():
            own = self._victim_lists().get(workload.tenant, [])
            scanned = itertools.islice(self._outranked(own, workload.tenant, self.ranks[workload.job_id]),
                                       self.policy.victim_scan)
            candidates = ((victim, kind) for _, victim, kind, _ in scanned if victim.job_id not in self.claimed)
            chosen = _fewest(candidates, lambda item: take(item[0]), lambda item: take(item[0], -1), fits)
            if not chosen:
                return False
        for victim, kind in chosen:
            self._halt(victim, self._preempt_reason(kind, workload, victim))
        self._hold_for(tally)
        return True

    def _halt(self, victim, reason):
        self.decisions.preempt[victim.job_id] = reason
        self.claimed.add(victim.job_id)
        self.stopping.append(victim)

    def _hold_for(self, tally):
        """Hold the nodes a job will use once the resources it waits for are freed; returns those GPUs."""
        nodes, freed_gpus = tally.plan()
        for node in nodes:
            self.free.reserve(node)
        return freed_gpus

    def _wait_for_freed(self, workload, position, tally):
        freed_gpus = self._hold_for(tally)
        what = gpus_text(freed_gpus) if freed_gpus else "resources"
        self._wait(workload, position, f"for {what} being freed by preemption")

    # --- preemption --------------------------------------------------------------------------------
    def _pick_victims(self, workload, state, tally):
        """Greedy over candidates in preference order until the job fits, then drop any victim the
        job turns out not to need (fewest victims). At most `victim_scan` candidates are tried, which
        bounds a cycle's cost when no set of victims would do."""
        usage = {}  # tenant -> its usage without the victims taken so far (reclaim stops once it is within quota)

        def take(item, sign=+1):
            victim = item[0]
            tally.change(victim, sign)
            _release(usage.setdefault(victim.tenant, list(self.tenants[victim.tenant].used)), victim, sign)

        candidates = itertools.islice(self._candidates(workload, state, usage), self.policy.victim_scan)
        return _fewest(candidates, take, lambda item: take(item, -1), tally.fits)

    def _victim_lists(self):
        """Per tenant, the running jobs that could be halted, by preference: lowest priority, then most
        recently started."""
        if self._victims_by_tenant is None:
            by_tenant = {}
            for running in self.snapshot.running:
                if running.preemptible and not running.stopping and len(running.placement) == running.learners:
                    by_tenant.setdefault(running.tenant, []).append(running)
            ranks = self.ranks
            self._victims_by_tenant = {}
            for name, victims in by_tenant.items():
                self._rank_all(victims)
                victims.sort(key=lambda v: _victim_key(v, ranks[v.job_id]))
                self._victims_by_tenant[name] = [(ranks[v.job_id], v) for v in victims]
        return self._victims_by_tenant

    def _candidates(self, workload, state, usage):
        """Running jobs this one may halt, best victims first (soft-over-budget tenants' jobs, then
        lowest priority, then most recently started):
        (a) any job of a soft-over-budget tenant (unless this job's tenant is over its soft budget too);
        (b) reclaim: any job of another tenant borrowing beyond its quota, if this job fits in its own;
        (c) lower-priority jobs of the same tenant, or of the shared pool when this job is in it; with
            service levels, also jobs of the same priority at a lower level that have run
            `service_min_run_s` in their current attempt. With fair share on, another pool tenant's
            job only while this job keeps its tenant within its fair share and that tenant is above
            its own (see _fair_share): a tenant at its share halts only its own work."""
        soft_job = state.policy.budget == "soft_exceeded"
        reclaiming = state.nominal is not None and state.within_quota(workload.per_learner, workload.learners)
        from_pool = state.nominal is None and self._within_fair_share(state, workload)
        rank = self.ranks[workload.job_id]
        streams = []
        for name, by_preference in self._victim_lists().items():
            other = self.tenants[name]
            mine = name == workload.tenant
            if not soft_job and not mine and other.policy.budget == "soft_exceeded":
                streams.append(_ranked(0, by_preference, "soft", name))
                continue
            if reclaiming and not mine and other.borrowing_in(workload.per_learner):
                streams.append(_ranked(1, by_preference, "reclaim", name))
                continue
            pool = from_pool and other.nominal is None and self._above_fair_share(other)
            if mine or pool:
                streams.append(self._outranked(by_preference, name, rank))
            if pool and not mine and self.policy.fair_share and self.policy.fair_share_preemption:
                streams.append(self._over_fair_share(by_preference, name, rank))
        seen = set()
        for _, victim, kind, name in heapq.merge(*streams, key=lambda item: item[0]):
            if victim.job_id in self.claimed or victim.job_id == workload.job_id or victim.job_id in seen:
                continue
            seen.add(victim.job_id)
            if kind == "reclaim" and not self.tenants[name].borrowing_in(workload.per_learner, usage.get(name)):
                continue
            yield victim, self._preempt_reason(kind, workload, victim)

    def _within_fair_share(self, state, workload):
        """The tenant, with this job added, holds no more than its fair share of any resource (always
        true with fair share off: the shared pool is then ordered by priority alone)."""
        if not self.policy.fair_share:
            return True
        total = workload.total
        return state.dominant_share((total.gpus, total.cpus, total.memory_bytes)) <= \
            self._fair_share(state) + CPU_EPSILON

    def _above_fair_share(self, state):
        return not self.policy.fair_share or state.dominant_share() > self._fair_share(state) + CPU_EPSILON

    def _fair_share(self, state):
        """The tenant's fair share: an equal, weighted part of the cluster among the tenants with demand
        (running or queued work in this snapshot), as a fraction of each resource."""
        if self._weights is None:
            self._weights = sum(other.policy.weight for other in self.tenants.values())
        return state.policy.weight / self._weights

    def _preempt_reason(self, kind, workload, victim):
        """Shown to the victim's tenant: names the job that needs the room only if it is theirs too."""
        needing = job_seen_by(victim.tenant, workload)
        if kind == "soft":
            return f"preempted: tenant {victim.tenant} is over its soft budget and {needing} needs the capacity"
        if kind == "reclaim":
            return "reclaimed: another tenant needs its guaranteed quota back"
        if kind == "fair":
            return (f"preempted: tenant {victim.tenant} holds more than its fair share of the cluster, and "
                    f"{needing} needs the room (fair share)")
        if kind == "service":
            return (f"preempted: it has had {victim.service_gpu_s(self.snapshot.now) / 3600:.1f} GPU-hours and "
                    f"{needing} of the same priority has had less (service levels)")
        return f"preempted for {job_seen_by(victim.tenant, workload, 'higher-priority ')}"

    def _over_fair_share(self, victims, name, rank):
        """Another pool tenant's victims of the job's own priority, as merge items after the
        outranked ones: its tenant is above its fair share while the job's stays within its own (the
        caller checked both), so the backlog of a tenant that holds the cluster cannot keep a tenant
        that holds little of it waiting for its jobs to end (Kueue's fair-sharing preemption). Only
        jobs that have run `fair_share_min_run_s` in their current attempt."""
        now, min_run = self.snapshot.now, self.policy.fair_share_min_run_s
        for victim_rank, victim in victims:
            if victim_rank[0] == rank[0] and now - victim.started >= min_run:
                yield _victim_key(victim, victim_rank, 2), victim, "fair", name

    def _outranked(self, victims, name, rank):
        """A tenant's victims (in preference order) that rank below a job of `rank` as merge items:
        lower priority, or the same priority at a lower service level after `service_min_run_s`."""
        now, min_run = self.snapshot.now, self.policy.service_min_run_s
        for victim_rank, victim in victims:
            if victim_rank <= rank:
                return
            if victim_rank[0] > rank[0]:
                yield _victim_key(victim, victim_rank, 1), victim, "priority", name
            elif now - victim.started >= min_run:
                yield _victim_key(victim, victim_rank, 1), victim, "service", name


def _fewest(candidates, take, give_back, fits):
    """Take candidates in order until `fits()`, then give back each one the job turns out not to need
    (fewest victims). Returns the ones kept, or [] (all given back) if even all of them do not fit."""
    chosen = []
    for item in candidates:
        take(item)
        chosen.append(item)
        if fits():
            break
    if not fits():
        for item in chosen:
            give_back(item)
        return []
    needed = [chosen[-1]]
    for item in reversed(chosen[:-1]):
        give_back(item)
        if not fits():
            take(item)
            needed.append(item)
    return needed


def _release(used, workload, sign=+1):
    """Take a placed workload's resources off a [gpus, cpus, memory] usage list (sign -1: add them back)."""
    placed, per = len(workload.placement), workload.per_learner
    used[0] -= sign * per.gpus * placed
    used[1] -= sign * per.cpus * placed
    used[2] -= sign * per.memory_bytes * placed


def _victim_key(victim, rank, kind_rank=0):
    """Victims by preference: lowest priority, then most GPU time had, then most recently started."""
    return (kind_rank, -rank[0], -rank[1], -victim.started, -victim.order, victim.job_id)


def _ranked(kind_rank, victims, kind, name):
    """A tenant's victims (already in preference order) as merge items."""
    for victim_rank, victim in victims:
        yield _victim_key(victim, victim_rank, kind_rank), victim, kind, name


class _PodByPodCycle:
    """FfDL's default (Kubernetes' own scheduler) for the baseline: every learner is a pod placed on
    its own, in priority-then-submission order; a distributed job can be partly placed and hold GPUs
    it cannot use. Running workloads with fewer placements than learners get their missing learners
    here; `admitted` then holds only the newly placed learners."""

    def __init__(self, snapshot, queued, policy):
        self.snapshot, self.policy = snapshot, policy
        self.free = FreeMap(snapshot.nodes, snapshot.running)
        self.decisions = Decisions()
        self.jobs, self.user_gpus = {}, {}
        for workload in snapshot.running:
            self.jobs[workload.tenant] = self.jobs.get(workload.tenant, 0) + 1
            key = (workload.tenant, workload.user)
            self.user_gpus[key] = self.user_gpus.get(key, 0) + workload.per_learner.gpus * len(workload.placement)
        partial = [w for w in snapshot.running if len(w.placement) < w.learners and not w.stopping]
        self.pending = sorted(list(queued) + partial, key=lambda w: (PRIORITY_RANK[w.priority], w.order, w.job_id))
        self.positions = {}
        per_tenant = {}
        for workload in sorted(queued, key=lambda w: (PRIORITY_RANK[w.priority], w.order, w.job_id)):
            per_tenant[workload.tenant] = per_tenant.get(workload.tenant, 0) + 1
            self.positions[workload.job_id] = per_tenant[workload.tenant]

    def run(self):
        for workload in self.pending:
            queued = not workload.placement
            position = self.positions.get(workload.job_id)
            if position is not None:
                self.decisions.position[workload.job_id] = position
            if queued:
                limit = self._limit(workload)
                if limit is not None:
                    self.decisions.waiting[workload.job_id] = position_prefix(position) + limit
                    continue
            placed = []
            for _ in range(workload.learners - len(workload.placement)):
                placement = self.free.place_learner(workload.per_learner, self.policy.packing)
                if placement is None:
                    break
                placed.append(placement)
            if placed:
                self.decisions.admitted[workload.job_id] = placed
                key = (workload.tenant, workload.user)
                self.user_gpus[key] = self.user_gpus.get(key, 0) + workload.per_learner.gpus * len(placed)
                if queued:
                    self.jobs[workload.tenant] = self.jobs.get(workload.tenant, 0) + 1
            elif queued:
                reason = self.free.why_not(workload.per_learner, 1) if workload.learners == 1 else \
                    f"none of its {learners_of(workload.learners, workload.per_learner.gpus)} fits yet"
                self.decisions.waiting[workload.job_id] = position_prefix(position) + reason
        return self.decisions

    def _limit(self, workload):
        policy = self.snapshot.tenant(workload.tenant)
        if policy.budget == "hard_exceeded":
            return policy.budget_reason or "tenant budget exhausted"
        jobs = self.jobs.get(workload.tenant, 0)
        if policy.max_jobs is not None and jobs >= policy.max_jobs:
            return f"tenant concurrent jobs {jobs}/{policy.max_jobs}"
        used = self.user_gpus.get((workload.tenant, workload.user), 0)
        gpus = workload.per_learner.gpus * workload.learners
        if policy.max_gpus_per_user is not None and gpus and used + gpus > policy.max_gpus_per_user:
            return f"user GPU cap {used}/{policy.max_gpus_per_user} in use"
        return None
