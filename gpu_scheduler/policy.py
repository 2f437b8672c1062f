"""The switches of a scheduling cycle, and the three named policies the bench compares.

- `fifo_spread()`: FfDL's default, i.e. Kubernetes' own scheduler: learners (pods) are placed one by
  one in priority-then-submission order, each on the node with the most free GPUs; no quotas, no gang,
  no preemption. A distributed job can end up partly placed, holding GPUs it cannot use.
- `kueue_like()`: Kueue's defaults: whole-job (gang) admission against per-tenant quotas with
  borrowing, reclaim and within-tenant priority preemption, BestEffortFIFO ordering (a job that does
  not fit is skipped, nothing is reserved for it), placement left to a spreading node scheduler.
  Like Kueue, it preempts only when the free capacity in total is short (quota is not
  placement-aware); a job that fits in total but not on any node just waits.
- `full()`: Trainyard's policy: the above plus packing placement, fair share between tenants by
  weighted dominant resource share, and backfill with aging reservations: jobs that do not fit are
  skipped (smaller ones behind them run), but once a blocked job has waited `reserve_after_s`, the
  nodes likeliest to fit it soon are held for it (nothing new starts there) until it starts; and
  preemption that is placement-aware (a job blocked by fragmentation may preempt too), plus
  consolidation: small jobs are moved (halted, restarted elsewhere at once) to give a waiting
  single-learner job a whole node; and service levels: inside a priority, jobs that have had little
  GPU time go before (and may halt) jobs that have had a lot.
"""
from dataclasses import dataclass

PLACEMENTS = ("pack", "spread")


@dataclass(frozen=True)
class Policy:
    placement: str = "pack"  # "pack": fullest node that fits (keeps whole nodes free); "spread": emptiest
    gang: bool = True  # all learners of a job or none; False = pod by pod (FfDL baseline only)
    backfill: bool = True  # later jobs may run while an earlier one waits for capacity; False = strict FIFO
    reservations: int = 1  # blocked jobs per cycle that get the nodes likeliest to fit them soon held for them
    reserve_after_s: float = 4 * 3600.0  # ...once they have waited this long (Snapshot.now - Workload.queued_at)
    fair_share: bool = True  # order tenants by weighted dominant resource share beyond their quota
    # With fair share: a pool tenant within its fair share may halt jobs of its own priority of a pool
    # tenant above its own (Kueue's fairSharing preemption), once they have run this long per attempt.
    fair_share_preemption: bool = True
    fair_share_min_run_s: float = 0.0
    quotas: bool = True  # enforce per-tenant quotas; False = one shared pool
    borrowing: bool = True  # tenants with can_borrow may exceed their quota on idle capacity
    preemption: bool = True  # halt lower-priority / borrowing / soft-over-budget work through its checkpoint
    preempt_for_placement: bool = True  # also preempt when capacity is free in total but split across nodes
    consolidate: bool = True  # move small jobs (halt + restart elsewhere) to give a waiting big job a whole node
    move_after_s: float = 600.0  # ...only jobs that have run this long (Snapshot.now - Workload.started)
    move_max_share: float = 0.5  # ...moving at most this share of the waiting job's GPUs
    # Service levels (Tiresias' discretised least-attained-service): within one priority, a job that
    # has had less GPU time goes first, and may halt a job of the same priority that has had more
    # once that one has run `service_min_run_s` in its current attempt. Run times are heavy-tailed
    # and unknown in advance; the GPU time a job has already had is the best predictor of how long
    # it still needs, so this approximates shortest-job-first without asking users for estimates.
    service_levels: tuple = (4 * 3600.0,)  # GPU-seconds of service at which a job moves down a level; () = off
    service_min_run_s: float = 1800.0  # a demoted job runs at least this long per attempt before such a halt
    promote_after_s: float = 8 * 3600.0  # a demoted job queued this long goes back to the top level (no starvation)
    preemption_checks: int = 32  # blocked jobs per cycle that may look for victims (bounds the cycle's cost)
    victim_scan: int = 256  # candidate victims tried per blocked job (bounds the cycle's cost)
    name: str = "full"

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"policy: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if list(self.service_levels) != sorted(self.service_levels) or any(t <= 0 for t in self.service_levels):
            raise ValueError("policy: service_levels must be increasing positive GPU-second thresholds")
        if self.reservations < 0 or self.preemption_checks < 0:
            raise ValueError("policy: reservations and preemption_checks must be >= 0")
        if not self.gang and (self.quotas or self.preemption or self.reservations):
            # Pod-by-pod placement exists only to model the FfDL baseline; quotas and preemption are
            # decisions about whole jobs and are not defined for a partly placed one.
            raise ValueError("policy: gang=False (pod-by-pod) supports neither quotas, preemption nor reservations")

    @property
    def packing(self):
        return self.placement == "pack"

    @classmethod
    def fifo_spread(cls):
        return cls(placement="spread", gang=False, reservations=0, fair_share=False, fair_share_preemption=False,
                   quotas=False, borrowing=False, preemption=False, consolidate=False, service_levels=(),
                   name="fifo_spread")

    @classmethod
    def kueue_like(cls):
        return cls(placement="spread", reservations=0, fair_share=False, fair_share_preemption=False,
                   preempt_for_placement=False, consolidate=False, service_levels=(), name="kueue_like")

    @classmethod
    def full(cls):
        return cls()
