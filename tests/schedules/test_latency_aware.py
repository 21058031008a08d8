"""BitPipe's split backward ordered for the cost model: ahead of every peer with message costs.

The acceptance grid: D in {4, 8, 16}, N in {D, 2D, 4D}, t_p2p in {0, 0.05, 0.1, 0.2} t_F
(t_B = 2 t_F, W half of it). BitPipe with a split backward must not be slower than any
peer's plan — ZB-H1, ZB-V, DualPipe, DualPipeV, interleaved and Chimera with a split
backward — at no more than D Ma of activations per rank, and never below the lower bound
of its placement under that memory limit.
"""

from __future__ import annotations

import pytest

from megatron_bitpipe.schedules import CostModel, PlanError, generate, simulate, validate_plan
from megatron_bitpipe.schedules.actions import make_plan
from megatron_bitpipe.schedules.compose import with_eager_syncs
from megatron_bitpipe.schedules.list_scheduling import latency_aware_split, list_schedule
from megatron_bitpipe.schedules.split_backward import split_backward

GRID = [(D, k * D) for D in (4, 8, 16) for k in (1, 2, 4)]
PEERS = [("zb-h1", False), ("zbv", False), ("dualpipe", False), ("dualpipev", False),
         ("interleaved", True), ("chimera", True)]


def memory_bound(D: int, N: int, p2p: float) -> float:
    """Lower bound on BitPipe's placement with at most D Ma per rank (t_F = 1, t_B = 2).

    Every rank works 3N. Rank r's first input arrives after min(r, D-1-r) hops of
    (t_F/2 + p2p); before its first input gradient it can only run forwards, at most 2D
    of them (D Ma, half a Ma each), i.e. D time units; and its first input gradient comes
    no earlier than the first micro-batch's whole forward chain (2D stages: D, plus 2D-2
    messages) and min(r, D-1-r) input-gradient hops after it. The middle ranks bind.
    """
    ramp = (D // 2 - 1) * (0.5 + p2p)
    return 3 * N + ramp + (2 * D - 2) * p2p


@pytest.mark.parametrize("p2p", [0.0, 0.05, 0.1, 0.2])
def test_bitpipe_split_is_no_slower_than_any_peer(p2p):
    costs = CostModel(t_p2p=p2p)
    for D, N in GRID:
        plan = generate("bitpipe", D, N, split_backward=True, costs=costs)
        validate_plan(plan)
        ours = simulate(plan, costs)
        assert max(ours.peak_activations) <= D
        assert ours.makespan >= memory_bound(D, N, p2p) - 1e-9
        for schedule, split in PEERS:
            if schedule.startswith("dualpipe") and N < 2 * D:
                continue
            peer = simulate(generate(schedule, D, N, split_backward=split, costs=costs), costs).makespan
            assert ours.makespan <= peer + 1e-9, (D, N, p2p, schedule, ours.makespan, peer)


def test_free_messages_reach_the_placement_bound():
    for D, N in GRID:
        assert simulate(generate("bitpipe", D, N, split_backward=True)).makespan == pytest.approx(memory_bound(D, N, 0.0))


def test_latency_aware_order_beats_the_lock_step_order_with_message_costs():
    costs = CostModel(t_p2p=0.1)
    lock_step = simulate(split_backward(generate("bitpipe", 8, 16), costs), costs).makespan
    ours = simulate(generate("bitpipe", 8, 16, split_backward=True, costs=costs), costs).makespan
    assert lock_step == pytest.approx(52.9) and ours == pytest.approx(51.7)  # DualPipe: 56.3


def test_free_messages_keep_the_lock_step_plan():
    plan = generate("bitpipe", 8, 16).compute_only()
    assert latency_aware_split(plan, CostModel(), 8, (4,)).actions == split_backward(plan, CostModel(), 8).actions


def test_list_schedule_respects_the_activation_limit_or_says_it_stalls():
    lock_step = generate("bitpipe", 4, 8).compute_only()
    placement, routing = lock_step.placement, lock_step.microbatch_pipeline
    costs = CostModel(t_p2p=0.1)

    def lock_step_position(rank, key):  # key: (F or I, pipeline, stage, index in the pipeline)
        kind, pipeline, stage, index = key
        chunk = placement.location(pipeline, stage).chunk
        kinds = ("F",) if kind.value == "F" else ("B",)
        return next(i for i, a in enumerate(lock_step.actions[rank])
                    if a.type.value in kinds and a.chunk == chunk and a.microbatch == 4 * pipeline + index)

    orders = list_schedule(placement, routing, costs, 5.0, lock_step_position, lambda key: 0.0)
    plan = make_plan("bitpipe+split", placement, 8, routing, [with_eager_syncs(o) for o in orders])
    validate_plan(plan)
    assert max(simulate(plan, costs).peak_activations) == 5.0
    # Without release times every rank fills up with forwards that cannot all reach the loss:
    # the planner says so (the generator then keeps the lock-step plan).
    with pytest.raises(PlanError, match="stalled on ranks"):
        list_schedule(placement, routing, costs, 4.0, lock_step_position, lambda key: 0.0)
