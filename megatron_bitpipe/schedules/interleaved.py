"""Looped interleaved 1F1B, as megatron-core's interleaved schedule runs it.

One pipeline of ``v * D`` stages; stage ``s`` on rank ``s % D``, chunk ``s // D``.
Micro-batches are taken in groups of ``D`` (megatron-core's default
``microbatch_group_size_per_vp_stage``): each chunk runs a whole group before the next
chunk does, so ``N`` must be a multiple of ``D`` (megatron-core rejects a remainder). Rank ``r`` runs
``2 (D - r - 1) + (v - 1) D`` warm-up forwards. Bubble at ``t_B = 2 t_F`` and ``N`` a
multiple of ``D``: ``(D - 1) / (v N + D - 1)``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .actions import SchedulePlan, make_plan
from .compose import one_f_one_b, with_eager_syncs
from .errors import PP_FLAG
from .generator import MEGATRON_RUNNER, ScheduleGenerator
from .placement import looped


def schedule_table(num_microbatches: int, chunks: int, group_size: int) -> List[Tuple[int, int]]:
    """Forward order as (chunk, micro-batch): whole groups per chunk, ascending chunks."""
    return [
        (c, m)
        for start in range(0, num_microbatches, group_size)
        for c in range(chunks)
        for m in range(start, min(start + group_size, num_microbatches))
    ]


#: stage ``s`` on rank ``s % D``, chunk ``s // D`` (``placement(D, virtual_size)``)
placement = looped


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """``N`` a positive multiple of ``D`` (whole groups, as megatron-core requires)."""
    if num_microbatches is not None and (num_microbatches < num_ranks or num_microbatches % num_ranks):
        return [f"{source} = {num_microbatches}: interleaved needs a positive multiple of {PP_FLAG} {num_ranks}"]
    return []


def smallest_num_microbatches(num_ranks: int) -> int:
    return num_ranks


def generate(
    num_ranks: int, num_microbatches: int, virtual_size: int = 2, forward_only: bool = False
) -> SchedulePlan:
    """Interleaved plan with ``virtual_size`` chunks per rank; the arguments must satisfy
    :func:`problems` (``virtual_size >= 1``)."""
    forwards = schedule_table(num_microbatches, virtual_size, num_ranks)
    backwards = [(virtual_size - 1 - c, m) for c, m in forwards]
    actions = []
    for rank in range(num_ranks):
        if forward_only:
            actions.append(one_f_one_b(forwards, [], len(forwards)))
            continue
        warmup = 2 * (num_ranks - rank - 1) + (virtual_size - 1) * num_ranks
        actions.append(with_eager_syncs(one_f_one_b(forwards, backwards, warmup)))
    return make_plan("interleaved", looped(num_ranks, virtual_size), num_microbatches, [0] * num_microbatches, actions)


GENERATOR = ScheduleGenerator(
    name="interleaved",
    summary="looped interleaved 1F1B, v chunks per rank (megatron-core's interleaved schedule)",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    takes_virtual_size=True,
    runner=MEGATRON_RUNNER,
)
