"""DualPipeV: DualPipe cut in half onto a V of one replica (DeepSeek's DualPipe repository).

Placement (:func:`~.placement.v_shape`): one pipeline of ``2D`` stages; chunk 0 of rank
``r`` is stage ``r`` (going down), chunk 1 is stage ``2D-1-r`` (coming back), so rank 0
holds the first and the last stage. All ``N`` micro-batches take the V.

Ordering rule: DualPipe's eight steps (:mod:`.dualpipe`) with the V's chunks as the two
phases — phase 0 is chunk 0, phase 1 chunk 1 — the rank ``r`` in place of the half rank,
``D`` in place of ``D/2`` and all ``N`` micro-batches in place of one direction's:
``2(D-r-1)`` forwards of chunk 0; ``r+1`` pairs of forwards; ``D-r-1`` times ``I``,
``W``, ``F`` of chunk 1; ``N-2D+r+1`` times two overlapped forward/backward pairs
(``OVERLAP_F_B``; the last rank, which plays the middle ranks' part, runs its first pair as a
forward, then a backward); then the drain, half of it with split backwards. Needs ``N >= 2D``; 1x weights; peak
activations ``D + 1/2`` Ma (``2D + 1`` chunk activations of ``L/2D`` layers).
"""

from __future__ import annotations

from typing import List, Optional

from .actions import Action, ActionType, SchedulePlan, make_plan
from .compose import with_eager_syncs
from .dualpipe import PhaseOrder, overlapped_rank_order
from .errors import PP_FLAG
from .generator import PLAN_RUNNER, ScheduleGenerator
from .placement import v_shape

placement = v_shape


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """``N >= 2D``."""
    if num_microbatches is not None and num_microbatches < 2 * num_ranks:
        return [f"{source} = {num_microbatches}: dualpipev needs at least 2 x {PP_FLAG} = {2 * num_ranks} micro-batches"]
    return []


def smallest_num_microbatches(num_ranks: int) -> int:
    return 2 * num_ranks


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """DualPipeV plan for ``num_ranks`` ranks and ``num_microbatches`` (>= 2D) micro-batches;
    the arguments must satisfy :func:`problems`."""
    microbatches = {0: list(range(num_microbatches)), 1: list(range(num_microbatches))}
    actions = []
    for rank in range(num_ranks):
        if forward_only:
            actions.append([Action(ActionType.FORWARD, c, m) for m in range(num_microbatches) for c in (0, 1)])
            continue
        order = PhaseOrder((0, 1), microbatches)
        actions.append(with_eager_syncs(overlapped_rank_order(order, rank, num_ranks, num_microbatches)))
    return make_plan("dualpipev", v_shape(num_ranks), num_microbatches, [0] * num_microbatches, actions)


GENERATOR = ScheduleGenerator(
    name="dualpipev",
    summary="DualPipeV: DualPipe folded onto one V-shaped pipeline",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    always_split=True,
    runner=PLAN_RUNNER,
)
