"""Looped interleaved 1F1B, as megatron-core's interleaved schedule runs it.

One pipeline of ``v * D`` stages; stage ``s`` on rank ``s % D``, chunk ``s // D``.
Micro-batches are taken in groups of ``D`` (megatron-core's default
``microbatch_group_size_per_vp_stage``): each chunk runs a whole group before the next
chunk does, so ``N`` must be a multiple of ``D`` (megatron-core rejects a remainder). Rank ``r`` runs
``2 (D - r - 1) + (v - 1) D`` warm-up forwards. Bubble at ``t_B = 2 t_F`` and ``N`` a
multiple of ``D``: ``(D - 1) / (v N + D - 1)``.
"""

from __future__ import annotations

from typing import List, Tuple

from .actions import SchedulePlan, make_plan
from .compose import one_f_one_b, with_eager_syncs
from .errors import MICROBATCH_FLAG, PP_FLAG, VP_FLAG, require
from .placement import looped


def schedule_table(num_microbatches: int, chunks: int, group_size: int) -> List[Tuple[int, int]]:
    """Forward order as (chunk, micro-batch): whole groups per chunk, ascending chunks."""
    return [
        (c, m)
        for start in range(0, num_microbatches, group_size)
        for c in range(chunks)
        for m in range(start, min(start + group_size, num_microbatches))
    ]


def generate(
    num_ranks: int, num_microbatches: int, virtual_size: int = 2, forward_only: bool = False
) -> SchedulePlan:
    """Interleaved plan with ``virtual_size`` chunks per rank."""
    require(num_ranks >= 1, PP_FLAG, f"must be >= 1 (got {num_ranks})")
    require(virtual_size >= 1, VP_FLAG, f"must be >= 1 (got {virtual_size})")
    require(
        num_microbatches >= num_ranks and num_microbatches % num_ranks == 0,
        MICROBATCH_FLAG,
        f"interleaved needs a positive multiple of {PP_FLAG}={num_ranks} (got {num_microbatches})",
    )
    placement = looped(num_ranks, virtual_size)
    forwards = schedule_table(num_microbatches, virtual_size, num_ranks)
    backwards = [(virtual_size - 1 - c, m) for c, m in forwards]
    actions = []
    for rank in range(num_ranks):
        if forward_only:
            actions.append(one_f_one_b(forwards, [], len(forwards)))
            continue
        warmup = 2 * (num_ranks - rank - 1) + (virtual_size - 1) * num_ranks
        actions.append(with_eager_syncs(one_f_one_b(forwards, backwards, warmup)))
    return make_plan("interleaved", placement, num_microbatches, [0] * num_microbatches, actions,
                     virtual_size=virtual_size)
