"""1F1B (PipeDream-Flush / DAPPLE), as megatron-core's non-interleaved schedule runs it.

One pipeline of ``D`` stages, one chunk per rank. Rank ``r`` runs ``D - r - 1`` warm-up
forwards, then alternates one forward and one backward, then drains the remaining
backwards. Bubble at ``t_B = 2 t_F``: ``(D - 1) / (N + D - 1)``.
"""

from __future__ import annotations

from .actions import SchedulePlan, make_plan
from .compose import one_f_one_b, with_eager_syncs
from .errors import MICROBATCH_FLAG, PP_FLAG, require
from .placement import looped


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """1F1B plan for ``num_ranks`` stages and ``num_microbatches`` micro-batches."""
    require(num_ranks >= 1, PP_FLAG, f"must be >= 1 (got {num_ranks})")
    require(
        num_microbatches >= num_ranks,
        MICROBATCH_FLAG,
        f"1f1b needs at least {PP_FLAG}={num_ranks} micro-batches (got {num_microbatches})",
    )
    placement = looped(num_ranks)
    order = [(0, m) for m in range(num_microbatches)]
    actions = []
    for rank in range(num_ranks):
        if forward_only:
            actions.append(one_f_one_b(order, [], len(order)))
        else:
            actions.append(with_eager_syncs(one_f_one_b(order, order, num_ranks - rank - 1)))
    return make_plan("1f1b", placement, num_microbatches, [0] * num_microbatches, actions)
