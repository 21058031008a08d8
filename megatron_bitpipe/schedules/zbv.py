"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", V schedule): one replica on a V.

Placement (:func:`~.placement.v_shape`): one pipeline of ``2D`` stages of ``L/2D``
layers; chunk 0 of rank ``r`` is stage ``r`` (going down), chunk 1 is stage ``2D-1-r``
(coming back), so rank 0 holds the first and the last stage. All ``N`` micro-batches
take the V. Every backward is split (``I`` then ``W``); peak activations ``D`` Ma, 1F1B's.

The paper's order (built for ``t_F = t_I = t_W``), for rank ``r`` and ``n = max(N, 2D-1)``
micro-batches (below ``2D-1`` the missing ones are simply left out):

1. ``2(D-r)-1`` forwards of chunk 0; ``r`` times a forward of chunk 1, one of chunk 0;
2. ``D-r`` times ``F``, ``I``, ``W`` of chunk 1;
3. steady state: a forward of chunk 0 (while any is left), ``I`` and ``W`` of chunk 0,
   then ``F``, ``I``, ``W`` of chunk 1 — until chunk 1 has caught up;
4. cool-down: ``r`` times ``I`` of chunk 0 and of chunk 1, ``D-r`` times ``I`` of chunk 0
   and the oldest ``W`` of chunk 0; then the remaining ``W``'s, chunk 1's first.

Its authors schedule ZB-V for other costs with a cost-aware greedy. Here the second
candidate is the latency-aware list schedule (:mod:`.list_scheduling`) of the V's
lock-step order (a micro-batch enters every two rounds and moves one stage per round);
:func:`generate` returns whichever of the two is faster under the given costs. With free
messages (``t_B = 2 t_F``, ``t_W = t_F``) the latency-aware schedule reaches the V's bound
``3N + (D-1) t_F/2`` for every ``N``, the paper's order from ``N >= 2D-1`` on (below, it takes
longer: 15.0 against 13.5 ``t_F`` at ``D = N = 4``, 31.0 against 27.5 at ``D = N = 8``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from .actions import Action, ActionType, SchedulePlan, make_plan
from .compose import lockstep_order, with_eager_syncs
from .errors import PP_FLAG
from .generator import PLAN_RUNNER, ScheduleGenerator
from .list_scheduling import timed_latency_aware_split
from .placement import v_shape
from .costs import CostModel
from .simulate import simulate

F, I, W = ActionType.FORWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


def paper_rank_order(rank: int, num_ranks: int, num_microbatches: int) -> List[Action]:
    """The paper's ZB-V order for ``rank`` (module docstring), without the ``SYNC``'s."""
    n = max(num_microbatches, 2 * num_ranks - 1)
    actions: List[Action] = []
    counts = {(kind, chunk): 0 for kind in (F, I, W) for chunk in (0, 1)}

    def add(kind: ActionType, chunk: int) -> None:
        microbatch = counts[kind, chunk]
        counts[kind, chunk] += 1
        actions.append(Action(kind, chunk, microbatch))

    for _ in range(2 * (num_ranks - rank) - 1):
        add(F, 0)
    for _ in range(rank):
        add(F, 1)
        add(F, 0)
    for _ in range(num_ranks - rank):
        add(F, 1)
        add(I, 1)
        add(W, 1)
    while counts[F, 1] < counts[F, 0] or counts[F, 0] < n:
        if counts[F, 0] < n:
            add(F, 0)
        for chunk in (0, 1):
            if chunk == 1:
                add(F, 1)
            add(I, chunk)
            add(W, chunk)
    for _ in range(rank):
        add(I, 0)
        add(I, 1)
    for _ in range(num_ranks - rank):
        add(I, 0)
        add(W, 0)
    for chunk in (1, 0):
        while counts[W, chunk] < counts[I, chunk]:
            add(W, chunk)
    return [a for a in actions if a.microbatch < num_microbatches]


def paper_plan(num_ranks: int, num_microbatches: int) -> SchedulePlan:
    """The paper's order on every rank (module docstring), with its ``SYNC``'s: one of the two
    candidates of :func:`generate`."""
    return make_plan(
        "zbv", v_shape(num_ranks), num_microbatches, [0] * num_microbatches,
        [with_eager_syncs(paper_rank_order(r, num_ranks, num_microbatches)) for r in range(num_ranks)],
    )


def lockstep_plan(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """The V's lock-step order with whole backwards: micro-batch ``i`` enters in round ``2i``."""
    placement = v_shape(num_ranks)
    routing = [0] * num_microbatches
    actions = lockstep_order(placement, routing, [2 * i for i in range(num_microbatches)], forward_only)
    if not forward_only:
        actions = [with_eager_syncs(a) for a in actions]
    return make_plan("zbv", placement, num_microbatches, routing, actions)


placement = v_shape


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """``N >= D``."""
    if num_microbatches is not None and num_microbatches < num_ranks:
        return [f"{source} = {num_microbatches}: zbv needs at least {PP_FLAG}={num_ranks} micro-batches"]
    return []


def smallest_num_microbatches(num_ranks: int) -> int:
    return num_ranks


def generate(
    num_ranks: int, num_microbatches: int, forward_only: bool = False, costs: Optional[CostModel] = None
) -> SchedulePlan:
    """ZB-V plan for ``num_ranks`` ranks and ``num_microbatches`` (>= D), ordered for ``costs``;
    the arguments must satisfy :func:`problems`."""
    if forward_only:
        return lockstep_plan(num_ranks, num_microbatches, forward_only=True)
    costs = costs or CostModel()
    paper = paper_plan(num_ranks, num_microbatches)
    scheduled, makespan = timed_latency_aware_split(lockstep_plan(num_ranks, num_microbatches), costs, num_ranks,
                                                    (num_ranks // 2, num_ranks))
    scheduled = dataclasses.replace(scheduled, name="zbv")
    if makespan < simulate(paper, costs).makespan:
        return scheduled
    return paper


GENERATOR = ScheduleGenerator(
    name="zbv",
    summary="ZB-V: one V-shaped pipeline, split backward, order planned for the costs",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    takes_costs=True,
    always_split=True,
    runner=PLAN_RUNNER,
)
