"""1F1B (PipeDream-Flush / DAPPLE), as megatron-core's non-interleaved schedule runs it.

One pipeline of ``D`` stages, one chunk per rank. Rank ``r`` runs ``D - r - 1`` warm-up
forwards (all of them when ``N`` is smaller), then alternates one forward and one backward,
then drains the remaining backwards. Bubble at ``t_B = 2 t_F``: ``(D - 1) / (N + D - 1)``.
"""

from __future__ import annotations

from typing import List, Optional

from .actions import SchedulePlan, make_plan
from .compose import one_f_one_b, with_eager_syncs
from .generator import MEGATRON_RUNNER, ScheduleGenerator
from .placement import Placement, looped




def placement(num_ranks: int) -> Placement:
    """Stage ``s`` on rank ``s``."""
    return looped(num_ranks)


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """Any ``N >= 1``: with fewer micro-batches than ranks the warm-up is shorter (as megatron-core)."""
    if num_microbatches is not None and num_microbatches < 1:
        return [f"{source} = {num_microbatches}: 1f1b needs at least one micro-batch"]
    return []


def smallest_num_microbatches(num_ranks: int) -> int:
    return 1


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """1F1B plan for ``num_ranks`` stages and ``num_microbatches`` micro-batches; the arguments
    must satisfy :func:`problems`."""
    order = [(0, m) for m in range(num_microbatches)]
    actions = []
    for rank in range(num_ranks):
        if forward_only:
            actions.append(one_f_one_b(order, [], len(order)))
        else:
            actions.append(with_eager_syncs(one_f_one_b(order, order, num_ranks - rank - 1)))
    return make_plan("1f1b", looped(num_ranks), num_microbatches, [0] * num_microbatches, actions)


GENERATOR = ScheduleGenerator(
    name="1f1b",
    summary="1F1B: one pipeline, one chunk per rank (megatron-core's non-interleaved schedule)",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    runner=MEGATRON_RUNNER,
)
