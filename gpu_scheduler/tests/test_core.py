"""One scheduling cycle, policy by policy, on small hand-made clusters."""
import dataclasses

import pytest

from gpu_scheduler import Policy, SchedulingInputError, reasons, schedule
from gpu_scheduler.reasons import GIB
from tests.support.scheduler_builders import gpus_in_use, job, node, nodes, running, snapshot, tenant

FULL = Policy.full()
HOUR = 3600.0


def admitted(decisions):
    return sorted(decisions.admitted)


# --- order: FIFO within a priority, priorities first --------------------------------------------
@pytest.mark.parametrize("queue, expected", [
    ([job("a", gpus=4), job("b", gpus=4), job("c", gpus=4)], ["a", "b"]),
    ([job("a", gpus=8), job("b", gpus=8, priority="high")], ["b"]),
    ([job("a", gpus=8, priority="low"), job("b", gpus=8)], ["b"]),
    ([job("a", gpus=8, order=5), job("b", gpus=8, order=3)], ["b"]),
])
def test_it_admits_by_priority_then_submission_order(queue, expected):
    assert admitted(schedule(snapshot([node()]), queue)) == expected


# --- gang ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cluster, busy, expected", [
    (nodes(2), [running("r1", ("n1", range(4))), running("r2", ("n2", range(4)))], ["g"]),
    (nodes(2), [running("r1", ("n1", range(4))), running("r2", ("n2", range(6)))], []),
    (nodes(1), [], ["g"]),  # both learners on one node
])
def test_it_places_all_learners_or_none(cluster, busy, expected):
    decisions = schedule(snapshot(cluster, *busy), [job("g", learners=2, gpus=4)])
    assert admitted(decisions) == expected
    for placements in decisions.admitted.values():
        assert len(placements) == 2 and all(len(p.gpu_ids) == 4 for p in placements)


def test_it_assigns_free_distinct_gpu_ids():
    snap = snapshot([node(gpus=4)], running("r", ("n1", (0, 2))))
    decisions = schedule(snap, [job("a", gpus=1), job("b", gpus=1)])
    ids = sorted(p.gpu_ids for placements in decisions.admitted.values() for p in placements)
    assert ids == [(1,), (3,)]


# --- placement ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, expected_node", [(FULL, "n1"), (Policy.kueue_like(), "n2")])
def test_packing_fills_the_fullest_node_and_spread_the_emptiest(policy, expected_node):
    snap = snapshot(nodes(2), running("r", ("n1", range(4))))
    decisions = schedule(snap, [job("a", gpus=1)], policy)
    assert decisions.admitted["a"][0].node == expected_node


def test_packing_keeps_a_whole_node_for_a_big_job():
    snap = snapshot(nodes(2), running("r", ("n1", range(4))))
    queue = [job("small", gpus=2, order=1), job("big", gpus=8, order=2)]
    assert admitted(schedule(snap, queue, FULL)) == ["big", "small"]
    assert admitted(schedule(snap, queue, Policy.kueue_like())) == ["small"]


def test_cordoned_nodes_get_no_new_work():
    cluster = [node("n1", schedulable=False), node("n2", gpus=2)]
    decisions = schedule(snapshot(cluster), [job("a", gpus=2), job("b", gpus=1)])
    assert decisions.admitted["a"][0].node == "n2"
    assert "b" in decisions.waiting


# --- backfill and reservations ------------------------------------------------------------------------
def test_small_jobs_backfill_behind_a_job_that_does_not_fit():
    snap = snapshot([node()], running("r", ("n1", range(4))))
    decisions = schedule(snap, [job("big", gpus=8), job("small", gpus=2)])
    assert admitted(decisions) == ["small"]
    assert decisions.waiting["big"] == "waiting: 1st in tenant queue; needs 8 GPUs on one node; largest free block is 4"


def test_strict_fifo_without_backfill_holds_everyone_behind_the_head():
    snap = snapshot([node()], running("r", ("n1", range(4))))
    decisions = schedule(snap, [job("big", gpus=8), job("small", gpus=2)], dataclasses.replace(FULL, backfill=False))
    assert admitted(decisions) == []
    assert decisions.waiting["small"] == "waiting: 2nd in tenant queue; behind job big (strict FIFO)"


@pytest.mark.parametrize("waited, small_goes_to", [(5 * HOUR, "n2"), (60.0, "n1")])
def test_a_long_waiting_job_gets_the_nodes_likeliest_to_free_held_for_it(waited, small_goes_to):
    now = 100 * HOUR
    snap = snapshot(nodes(2), running("young", ("n1", range(4)), started=now - 100, preemptible=False),
                    running("old", ("n2", range(2)), started=now - 10 * HOUR, preemptible=False), now=now)
    decisions = schedule(snap, [job("big", gpus=8, queued_at=now - waited), job("small", gpus=1)])
    assert decisions.admitted["small"][0].node == small_goes_to
    assert ("held for it" in decisions.waiting["big"]) == (waited > FULL.reserve_after_s)


# --- tenants' limits -------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, queue, reason", [
    (tenant("t1", 8), [job("a")], "tenant GPU quota 8/8 in use"),
    (tenant("t1", 20), [job("a", gpus=24)],
     "needs 24 GPUs, more than the tenant GPU quota of 20; it cannot start unless the tenant may borrow"),
    (tenant("t1", max_jobs=1), [job("a")], "tenant concurrent jobs 1/1"),
    (tenant("t1", max_gpus_per_user=8), [job("a")], "user GPU cap 8/8 in use"),
    (tenant("t1", budget="hard_exceeded", budget_reason="GPU-hours budget 1.0/1.0 h used this month"), [job("a")],
     "GPU-hours budget 1.0/1.0 h used this month"),
])
def test_a_tenants_limits_keep_its_jobs_waiting_with_the_reason(policy, queue, reason):
    snap = snapshot(nodes(2), running("r", ("n1", range(8))), tenants=[policy])
    decisions = schedule(snap, queue)
    assert decisions.admitted == {}
    assert decisions.waiting["a"] == f"waiting: 1st in tenant queue; {reason}"


@pytest.mark.parametrize("dimension, value, said", [
    ("gpus", 1, "1 GPU"), ("gpus", 3, "3 GPUs"), ("cpus", 1, "1 CPU"), ("cpus", 0.5, "0.5 CPU"),
    ("cpus", 2.5, "2.5 CPUs"), ("memory_bytes", 3 * GIB, "3.0 GiB of memory"),
])
def test_an_amount_over_quota_is_said_in_the_right_number(dimension, value, said):
    assert reasons.exceeds_quota(dimension, value, 0).startswith(f"needs {said}, more than the tenant ")


def test_a_tenant_may_borrow_idle_capacity_beyond_its_quota():
    snap = snapshot(nodes(2), running("r", ("n1", range(8))), tenants=[tenant("t1", 8, can_borrow=True)])
    assert admitted(schedule(snap, [job("a")])) == ["a"]
    assert admitted(schedule(snap, [job("a")], dataclasses.replace(FULL, borrowing=False))) == []


def test_other_users_are_not_held_by_one_users_cap():
    snap = snapshot(nodes(2), running("r", ("n1", range(8))), tenants=[tenant("t1", max_gpus_per_user=8)])
    decisions = schedule(snap, [job("a"), job("b", user="u2")])
    assert admitted(decisions) == ["b"]


def test_a_quota_blocked_job_holds_its_tenants_later_jobs():
    snap = snapshot(nodes(2), running("r", ("n1", range(6))), tenants=[tenant("t1", 8)])
    decisions = schedule(snap, [job("a", gpus=4), job("b", gpus=1)])
    assert admitted(decisions) == []
    assert decisions.waiting["b"] == "waiting: 2nd in tenant queue; tenant GPU quota 6/8 in use"
    assert decisions.position == {"a": 1, "b": 2}


def test_without_quotas_every_tenant_shares_one_pool():
    snap = snapshot(nodes(2), running("r", ("n1", range(8))), tenants=[tenant("t1", 8)])
    assert admitted(schedule(snap, [job("a")], dataclasses.replace(FULL, quotas=False))) == ["a"]


# --- fair share -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_t2, policy, expected", [
    (1.0, FULL, ["a"]),  # t1 uses 4 of 16 GPUs, t2 uses 6: t1 has the lower share
    (2.0, FULL, ["b"]),  # t2's weight halves its share: 6/16/2 < 4/16
    (1.0, dataclasses.replace(FULL, fair_share=False), ["a"]),
    (2.0, dataclasses.replace(FULL, fair_share=False), ["a"]),  # plain submission order
])
def test_fair_share_serves_the_tenant_with_the_lowest_weighted_dominant_share(weight_t2, policy, expected):
    snap = snapshot(nodes(2), running("r1", ("n1", range(4)), tenant="t1"),
                    running("r2", ("n2", range(6)), tenant="t2"),
                    tenants=[tenant("t1"), tenant("t2", weight=weight_t2)])
    decisions = schedule(snap, [job("a", gpus=4, tenant="t1"), job("b", gpus=4, tenant="t2")], policy)
    assert admitted(decisions) == expected


@pytest.mark.parametrize("recent, policy, expected", [
    ({"t2": 3600.0}, FULL, ["a"]),  # t2 has had an hour of the node: t1's job goes first
    ({}, FULL, ["b"]),  # no service on either side: submission order
    ({"t1": 3600.0, "t2": 7200.0}, FULL, ["a"]),
    ({"t2": 3600.0}, dataclasses.replace(FULL, fair_share=False), ["b"]),
])
def test_among_equal_jobs_the_tenant_with_the_least_recent_service_goes_first(recent, policy, expected):
    # Tenant t2's backlog was submitted first; the node is free and both tenants hold nothing now.
    tenants = [tenant(name, recent_gpu_s=8 * seconds, recent_cpu_s=64 * seconds) for name, seconds in recent.items()]
    queue = [job("b", gpus=8, tenant="t2", order=0), job("b2", gpus=8, tenant="t2", order=1),
             job("a", gpus=8, tenant="t1", order=2)]
    assert admitted(schedule(snapshot([node()], tenants=tenants), queue, policy)) == expected


def test_recent_service_breaks_ties_only_behind_priority():
    tenants = [tenant("t2", recent_gpu_s=8 * HOUR)]
    queue = [job("b", gpus=8, tenant="t2", priority="high"), job("a", gpus=8, tenant="t1", order=1)]
    assert admitted(schedule(snapshot([node()], tenants=tenants), queue)) == ["b"]


@pytest.mark.parametrize("weight_t2, expected", [(1.0, ["a"]), (4.0, ["b"])])
def test_cpu_only_service_counts_and_a_weight_divides_it(weight_t2, expected):
    # No GPUs: service is CPU-seconds over the cluster's CPUs. t2 had the whole node for 10 minutes,
    # t1 half of it for 10 minutes: with weight 4, t2's counts a quarter, less than t1's.
    cpu_node = node(gpus=0, cpus=8.0)
    tenants = [tenant("t1", recent_cpu_s=4 * 600.0), tenant("t2", recent_cpu_s=8 * 600.0, weight=weight_t2)]
    queue = [job("b", gpus=0, cpus=8.0, tenant="t2"), job("a", gpus=0, cpus=8.0, tenant="t1", order=1)]
    assert admitted(schedule(snapshot([cpu_node], tenants=tenants), queue)) == expected


def test_jobs_within_their_quota_go_before_borrowing_ones():
    snap = snapshot(nodes(2), running("r1", ("n1", range(8)), tenant="t1"),
                    tenants=[tenant("t1", 8, can_borrow=True), tenant("t2", 8, can_borrow=True)])
    decisions = schedule(snap, [job("a", gpus=8, tenant="t1"), job("b", gpus=8, tenant="t2")])
    assert admitted(decisions) == ["b"]


# --- budgets ------------------------------------------------------------------------------------------------
def test_a_soft_over_budget_tenant_runs_only_on_capacity_nobody_else_wants():
    snap = snapshot([node(gpus=2)], tenants=[tenant("t1", budget="soft_exceeded")])
    decisions = schedule(snap, [job("a", gpus=2, tenant="t1"), job("b", gpus=2, tenant="t2")])
    assert admitted(decisions) == ["b"]
    assert admitted(schedule(snap, [job("a", gpus=2, tenant="t1")])) == ["a"]


def test_a_soft_over_budget_tenants_jobs_are_preempted_by_anyone():
    snap = snapshot([node()], running("s", ("n1", range(8)), tenant="t1", priority="high"),
                    tenants=[tenant("t1", budget="soft_exceeded")])
    decisions = schedule(snap, [job("a", gpus=8, tenant="t2", priority="low")])
    # the victim's tenant reads why, but not which job of which other tenant took the room
    assert decisions.preempt == {"s": "preempted: tenant t1 is over its soft budget and a job of another tenant "
                                      "needs the capacity"}


# --- preemption ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim, expected", [
    ({"priority": "low"}, {"x": "preempted for higher-priority job h"}),
    ({"priority": "high"}, {}),
    ({"priority": "low", "preemptible": False}, {}),
    # Shared pool, another tenant: h would give t1 the whole cluster, more than its fair half
    # (test_across_tenants_a_job_halts_work_only_up_to_its_tenants_fair_share has the cases that may).
    ({"priority": "low", "tenant": "t2"}, {}),
])
def test_a_higher_priority_job_halts_lower_priority_work(victim, expected):
    snap = snapshot([node()], running("x", ("n1", range(8)), **victim))
    decisions = schedule(snap, [job("h", gpus=8, priority="high")])
    assert decisions.preempt == expected
    assert decisions.admitted == {}  # never admitted in the cycle that preempts
    if expected:
        assert decisions.waiting["h"] == "waiting: 1st in tenant queue; for 8 GPUs being freed by preemption"


def test_a_private_job_is_not_named_in_the_reasons_its_colleagues_read():
    """The victim's reason is read by whoever sees the victim; a private job is seen by its owner and
    those it is shared with only."""
    snap = snapshot([node()], running("x", ("n1", range(8)), priority="low"))
    decisions = schedule(snap, [job("secret-h", gpus=8, priority="high", private=True)])
    assert decisions.preempt == {"x": "preempted for a private higher-priority job of this tenant"}


# Fair share (an equal part of the cluster among the tenants with running or queued work): a job of
# another pool tenant is halted only while the preempting tenant stays within its share with the new
# job, and only from a tenant above its own.
FAIR_CASES = {
    # t1 asks for half of the 8 GPUs; t2 holds all of them
    "within its half": ([running("x", ("n1", range(8)), tenant="t2", priority="low")], [], 4,
                        {"x": "preempted for a higher-priority job of another tenant"}),
    "beyond its half": ([running("x", ("n1", range(8)), tenant="t2", priority="low")], [], 8, {}),
    # t1 holds half already: a tenant at its share halts only its own lower-priority work
    "at its share": ([running("mine", ("n1", range(4)), tenant="t1", priority="normal"),
                      running("x", ("n1", range(4, 8)), tenant="t2", priority="low")], [], 4,
                     {"mine": "preempted for higher-priority job h"}),
    # three tenants with demand (t3 only queued): each is owed a third, and 4 of 8 GPUs is more
    "a third each": ([running("x", ("n1", range(8)), tenant="t2", priority="low")],
                     [job("q", gpus=8, tenant="t3")], 4, {}),
    # t2 holds a quarter (under its third): its lower-priority job stays; t3 holds three quarters
    "victims above theirs": ([running("x", ("n1", range(2)), tenant="t2", priority="low"),
                              running("y", ("n1", range(2, 8)), tenant="t3", gpus=6)],
                             [], 2, {"y": "preempted for a higher-priority job of another tenant"}),
}


@pytest.mark.parametrize("case", FAIR_CASES)
def test_across_tenants_a_job_halts_work_only_up_to_its_tenants_fair_share(case):
    busy, others, gpus, expected = FAIR_CASES[case]
    decisions = schedule(snapshot([node()], *busy), [job("h", gpus=gpus, priority="high"), *others])
    assert decisions.preempt == expected


# Fair-share preemption: at the same priority too, a tenant within its share (with the job) halts work of
# a pool tenant above its own, so one tenant's backlog holding the cluster cannot keep another waiting.
def test_a_tenant_below_its_share_halts_a_same_priority_job_of_a_tenant_holding_the_cluster():
    snap = snapshot([node()], running("x", ("n1", range(8)), tenant="t2"))
    decisions = schedule(snap, [job("a", gpus=1), job("q", gpus=8, tenant="t2")])
    assert decisions.preempt == {"x": "preempted: tenant t2 holds more than its fair share of the cluster, and "
                                      "a job of another tenant needs the room (fair share)"}


@pytest.mark.parametrize("policy, busy", [
    (dataclasses.replace(FULL, fair_share_preemption=False), ("n1", range(8))),
    (dataclasses.replace(FULL, fair_share=False), ("n1", range(8))),
    (Policy.kueue_like(), ("n1", range(8))),
    (dataclasses.replace(FULL, fair_share_min_run_s=600.0), ("n1", range(8))),  # x started at 0, now 60
])
def test_fair_share_preemption_can_be_turned_off_and_spares_jobs_that_just_started(policy, busy):
    snap = snapshot([node()], running("x", busy, tenant="t2"), now=60.0)
    assert schedule(snap, [job("a", gpus=1)], policy).preempt == {}


def test_a_tenant_at_its_share_does_not_halt_same_priority_work_of_another():
    snap = snapshot([node()], running("mine", ("n1", range(4)), tenant="t1"),
                    running("x", ("n1", range(4, 8)), tenant="t2"))
    assert schedule(snap, [job("a", gpus=1)]).preempt == {}


def test_only_tenants_above_their_share_lose_same_priority_work():
    # three tenants with demand, a third each: t2 holds a quarter (its job stays), t3 three quarters
    snap = snapshot([node()], running("x", ("n1", range(2)), tenant="t2"),
                    running("y", ("n1", range(2, 8)), tenant="t3", gpus=6))
    assert list(schedule(snap, [job("a", gpus=2, tenant="t1")]).preempt) == ["y"]


def test_without_fair_share_priority_alone_rules_the_shared_pool():
    snap = snapshot([node()], running("mine", ("n1", range(4)), tenant="t1", priority="normal"),
                    running("x", ("n1", range(4, 8)), tenant="t2", priority="low"))
    decisions = schedule(snap, [job("h", gpus=4, priority="high")], dataclasses.replace(FULL, fair_share=False))
    assert list(decisions.preempt) == ["x"]  # the lowest priority, whoever's it is


def test_priority_does_not_cross_a_tenant_with_a_quota():
    snap = snapshot([node()], running("x", ("n1", range(8)), tenant="t2", priority="low"),
                    tenants=[tenant("t2", 8)])
    assert schedule(snap, [job("h", gpus=8, priority="high")]).preempt == {}


@pytest.mark.parametrize("queued_priority, stopping, preempted, reason", [
    ("high", False, ["l3"], "for its tenant's lower-ranked work being halted (tenant GPU quota 4/4 in use)"),
    ("high", True, [], "for its tenant's lower-ranked work being halted (tenant GPU quota 4/4 in use)"),
    ("low", False, [], "tenant GPU quota 4/4 in use"),
])
def test_a_job_held_by_its_tenants_quota_halts_that_tenants_lower_priority_work(queued_priority, stopping,
                                                                                preempted, reason):
    # Kueue's withinClusterQueue preemption: the node has room, the tenant's quota does not.
    busy = [running(f"l{i}", ("n1", (i,)), priority="low", started=float(i), stopping=stopping and i == 3)
            for i in range(4)]
    snap = snapshot([node()], *busy, tenants=[tenant("t1", 4)])
    decisions = schedule(snap, [job("h", gpus=1, priority=queued_priority),
                                 job("later", gpus=1, priority="low", order=1)])
    assert sorted(decisions.preempt) == preempted
    assert decisions.waiting["h"] == f"waiting: 1st in tenant queue; {reason}"
    assert decisions.waiting["later"].endswith("tenant GPU quota 4/4 in use")  # behind it, not around it


def test_it_picks_the_fewest_most_recently_started_victims():
    busy = [running(f"l{i}", ("n1", (i,)), priority="low", started=float(i)) for i in range(8)]
    decisions = schedule(snapshot([node()], *busy), [job("h", gpus=2, priority="high")])
    assert sorted(decisions.preempt) == ["l6", "l7"]


def test_it_picks_the_lowest_priority_victims_before_recent_ones():
    snap = snapshot([node()], running("low", ("n1", range(4)), priority="low", started=0.0),
                    running("normal", ("n1", range(4, 8)), started=10.0))
    decisions = schedule(snap, [job("h", gpus=4, priority="high")])
    assert list(decisions.preempt) == ["low"]


def test_it_waits_for_stopping_work_instead_of_picking_more_victims():
    snap = snapshot([node()], running("x", ("n1", range(8)), priority="low", stopping=True),
                    running("y", ("n2", range(8)), priority="low"))
    decisions = schedule(snap, [job("h", gpus=8, priority="high")])
    assert decisions.preempt == {}
    assert decisions.waiting["h"] == "waiting: 1st in tenant queue; for 8 GPUs being freed by preemption"


def test_a_tenant_within_its_quota_reclaims_borrowed_capacity():
    quotas = [tenant("t1", 8, can_borrow=True), tenant("t2", 8, can_borrow=True)]
    snap = snapshot(nodes(2), running("old", ("n1", range(8)), tenant="t2", started=1.0),
                    running("new", ("n2", range(8)), tenant="t2", started=2.0), tenants=quotas)
    decisions = schedule(snap, [job("a", gpus=8, tenant="t1")])
    assert decisions.preempt == {"new": "reclaimed: another tenant needs its guaranteed quota back"}


def test_a_borrowing_job_reclaims_nothing():
    quotas = [tenant("t1", 8, can_borrow=True), tenant("t2", 8, can_borrow=True)]
    snap = snapshot(nodes(3), running("mine", ("n1", range(8)), tenant="t1"),
                    running("b1", ("n2", range(8)), tenant="t2"), running("b2", ("n3", range(8)), tenant="t2"),
                    tenants=quotas)
    decisions = schedule(snap, [job("a", gpus=8, tenant="t1")])
    assert decisions.preempt == {}
    assert decisions.waiting["a"].startswith("waiting: 1st in tenant queue; needs 8 GPUs on one node")


def test_kueue_like_preempts_only_when_capacity_is_short_in_total():
    snap = snapshot(nodes(2), running("x", ("n1", range(4)), priority="low"),
                    running("y", ("n2", range(4)), priority="low"))
    queue = [job("h", gpus=8, priority="high")]
    assert schedule(snap, queue, Policy.kueue_like()).preempt == {}  # 8 GPUs are free, split in two
    assert len(schedule(snap, queue, FULL).preempt) == 1


# --- consolidation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("small_ran_for, n2_used, policy, moved", [
    (HOUR, 6, FULL, True),
    (60.0, 6, FULL, False),  # just started: not moved
    (HOUR, 8, FULL, False),  # it could not restart anywhere
    (HOUR, 6, Policy.kueue_like(), False),
])
def test_a_small_job_is_moved_to_give_a_waiting_big_job_a_whole_node(small_ran_for, n2_used, policy, moved):
    now = 10 * HOUR
    snap = snapshot(nodes(2), running("small", ("n1", (0,)), started=now - small_ran_for),
                    running("pinned", ("n2", range(n2_used)), preemptible=False), now=now)
    decisions = schedule(snap, [job("big", gpus=8)], policy)
    assert decisions.admitted == {}
    if moved:
        assert decisions.preempt == {"small": "moved: halted through its checkpoint to make room for job big; "
                                              "restarts at once on free GPUs elsewhere"}
        assert decisions.waiting["big"] == "waiting: 1st in tenant queue; for 1 GPU being freed by moving smaller jobs"
    else:
        assert decisions.preempt == {}


# --- reasons and positions ------------------------------------------------------------------------------------
def test_every_queued_job_gets_its_position_in_its_tenant_queue():
    snap = snapshot([node()], running("r", ("n1", range(6)), tenant="t0", preemptible=False))
    queue = [job(f"j{i}", gpus=4, tenant="t1" if i % 2 else "t2") for i in range(5)]
    decisions = schedule(snap, queue)
    assert decisions.position == {"j0": 1, "j2": 2, "j4": 3, "j1": 1, "j3": 2}
    assert decisions.waiting["j4"].startswith("waiting: 3rd in tenant queue; needs 4 GPUs on one node")
    assert all(reason.startswith("waiting: ") for reason in decisions.waiting.values())


@pytest.mark.parametrize("queued, reason", [
    (job("a", learners=2, gpus=4), "needs 2 learners × 4 GPUs each on one node; largest free block is 2"),
    (job("a", gpus=16), "needs 16 GPUs with 64 CPUs and 256.0 GiB per learner; the cluster can never hold it "
                        "(largest node has 8 GPUs)"),
    (job("a", gpus=1, cpus=64), "needs 64 CPUs and 16.0 GiB memory on one node with 1 GPU free; "
                                "no node has that much free"),
    (job("a", gpus=0, cpus=1, memory_gib=512), "needs 1 CPU and 512.0 GiB memory on one node; "
                                           "no node has that much free"),
])
def test_it_says_what_a_job_needs_and_what_is_free(queued, reason):
    snap = snapshot([node()], running("r", ("n1", range(6)), cpus=1.0, preemptible=False))
    assert schedule(snap, [queued]).waiting["a"] == f"waiting: 1st in tenant queue; {reason}"


# --- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("busy, queue, message", [
    ([running("a", ("n1", (0,))), running("b", ("n1", (0,)))], [], "job b: GPU 0 on node n1"),
    ([running("a", ("n1", (9,)))], [], "job a: GPU 9 on node n1 is out of range"),
    ([], [running("a", ("n1", (0,)))], "job a: a queued workload must have no placement"),
    ([running("a", ("n1", (0,)))], [job("a")], "job a is both queued and running"),
])
def test_it_rejects_an_inconsistent_snapshot_naming_the_job(busy, queue, message):
    with pytest.raises(SchedulingInputError, match=message):
        schedule(snapshot([node()], *busy), queue)


# --- service levels (least attained service first, within a priority) -----------------------------------
LEVELS = dataclasses.replace(FULL, service_levels=(4 * HOUR,), service_min_run_s=HOUR, promote_after_s=8 * HOUR)


@pytest.mark.parametrize("policy, expected", [(LEVELS, ["fresh", "long"]), (Policy.kueue_like(), ["long", "fresh"])])
def test_a_job_that_has_had_less_gpu_time_goes_first(policy, expected):
    queue = [job("long", gpus=8, attained_gpu_s=5 * 8 * HOUR, queued_at=0.0, order=0),
             job("fresh", gpus=8, queued_at=0.0, order=1)]
    decisions = schedule(snapshot(nodes(1), now=HOUR), queue, policy)
    assert admitted(decisions) == [expected[0]]
    assert decisions.position == {expected[0]: 1, expected[1]: 2}


def test_a_demoted_job_that_waited_long_is_back_at_the_top_level():
    queue = [job("long", gpus=8, attained_gpu_s=5 * 8 * HOUR, queued_at=0.0, order=0),
             job("fresh", gpus=8, queued_at=7 * HOUR, order=1)]
    assert admitted(schedule(snapshot(nodes(1), now=8 * HOUR), queue, LEVELS)) == ["long"]


@pytest.mark.parametrize("victim, expected", [
    # 8 GPUs for 1 h = 8 GPU-hours, past the 4 GPU-hour level, and it has run the minimum hour
    ({"started": 0.0}, {"x": "preempted: it has had 8.0 GPU-hours and job f of the same priority has had less "
                              "(service levels)"}),
    ({"started": 0.5 * HOUR}, {}),  # has run only half an hour in this attempt
    ({"started": 0.0, "gpus": 2, "learners": 1}, {}),  # 2 GPU-hours: same level as the newcomer
    ({"started": 0.0, "priority": "high"}, {}),
    ({"started": 0.0, "tenant": "t2"}, {}),  # a tenant with a quota keeps its work (t1 is in the shared pool)
    ({"started": 0.0, "preemptible": False}, {}),
])
def test_a_fresh_job_halts_one_of_the_same_priority_that_has_had_much_more(victim, expected):
    gpus = victim.pop("gpus", 8)
    ids = range(gpus)
    snap = snapshot([node(gpus=gpus)], running("x", ("n1", ids), gpus=gpus, **victim),
                    tenants=[tenant("t2", 8)], now=HOUR)
    decisions = schedule(snap, [job("f", gpus=gpus, queued_at=HOUR)], LEVELS)
    assert decisions.preempt == expected


def test_service_levels_count_earlier_attempts_too():
    # 3 GPU-hours earlier + 2 GPUs for 1 h now = 5 GPU-hours: past the level
    snap = snapshot([node(gpus=2)], running("x", ("n1", (0, 1)), attained_gpu_s=3 * HOUR, started=0.0), now=HOUR)
    assert list(schedule(snap, [job("f", gpus=2)], LEVELS).preempt) == ["x"]


@pytest.mark.parametrize("levels", [(2 * HOUR, HOUR), (0.0,)])
def test_it_rejects_service_levels_that_are_not_increasing_positive(levels):
    with pytest.raises(ValueError, match="service_levels must be increasing positive"):
        dataclasses.replace(FULL, service_levels=levels)


@pytest.mark.parametrize("kwargs, message", [
    ({"priority": "urgent"}, "priority must be one of"),
    ({"learners": 0}, "learners must be an integer >= 1"),
    ({"gpus": 0, "cpus": 0, "memory_gib": 0}, "asks for nothing"),
    ({"gpus": -1}, "gpus must be a non-negative number"),
    ({"attained_gpu_s": -1.0}, "attained_gpu_s must be a number >= 0"),
])
def test_it_rejects_a_bad_workload_naming_the_field(kwargs, message):
    with pytest.raises(SchedulingInputError, match=message):
        job("a", **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"recent_gpu_s": -1.0}, "recent_gpu_s must be a number >= 0"),
    ({"recent_cpu_s": float("nan")}, "recent_cpu_s must be a number >= 0"),
])
def test_it_rejects_bad_recent_service_naming_the_field(kwargs, message):
    with pytest.raises(SchedulingInputError, match=message):
        tenant("t1", **kwargs)


# --- the FfDL baseline: pod by pod ------------------------------------------------------------------------------
def test_pod_by_pod_places_part_of_a_distributed_job_and_completes_it_later():
    policy = Policy.fifo_spread()
    decisions = schedule(snapshot(nodes(2), running("r", ("n2", range(8)))), [job("g", learners=2, gpus=8)], policy)
    assert [p.node for p in decisions.admitted["g"]] == ["n1"]  # one learner placed, one pending
    partial = running("g", ("n1", range(8)), learners=2, gpus=8)
    decisions = schedule(snapshot(nodes(2), partial), [], policy)
    assert [p.node for p in decisions.admitted["g"]] == ["n2"]


def test_admitted_work_never_exceeds_free_capacity():
    snap = snapshot(nodes(2), running("r", ("n1", range(5))), running("s", ("n2", range(7)), stopping=True))
    decisions = schedule(snap, [job(f"j{i}", gpus=1 + i % 3) for i in range(10)])
    for name, ids in gpus_in_use(decisions, snap).items():
        assert len(ids) == len(set(ids)) <= 8, name


# --- elastic jobs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("free, min_learners, expected", [
    (4, 1, 4), (3, 1, 3), (1, 1, 1), (1, 2, None), (2, 2, 2),
    (1, 0, None),  # a fixed job: all its learners or none
])
def test_an_elastic_job_starts_with_the_most_learners_that_fit_down_to_its_minimum(free, min_learners, expected):
    busy = [running("r", ("n1", range(8 - free)))] if free < 8 else []
    decisions = schedule(snapshot([node()], *busy), [job("e", learners=4, gpus=1, min_learners=min_learners)])
    placed = decisions.admitted.get("e")
    assert (len(placed) if placed else None) == expected
