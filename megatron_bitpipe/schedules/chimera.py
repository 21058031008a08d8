"""Chimera (Li & Hoefler, 2021): two straight pipelines in opposite directions.

Placement (:func:`~.placement.bidirectional`): two weight replicas of ``D`` stages;
chunk 0 of rank ``d`` is stage ``d`` of the down pipeline, chunk 1 is stage ``D-1-d``
of the up pipeline. Micro-batches ``0 .. N/2-1`` go down, ``N/2 .. N-1`` go up.

Ordering: the same round-based timetable as BitPipe (see :mod:`.bitpipe`), with groups
of ``D/2`` micro-batches two rounds apart and one group every ``D`` rounds; in steady
state each rank runs one forward and one backward per round. Bubble: Chimera's published
``(D-2) / (2N+D-2)`` when ``t_B = t_F``; ``2(D-2) / (3N+2(D-2))`` at ``t_B = 2 t_F``
(which is optimal for this placement at ``N = D``). Peak activations ``D`` Ma.
"""

from __future__ import annotations

from typing import List, Optional

from .actions import SchedulePlan
from .compose import bidirectional_plan, bidirectional_problems, smallest_bidirectional_microbatches
from .generator import PLAN_RUNNER, ScheduleGenerator
from .placement import bidirectional


placement = bidirectional


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """Even ``D >= 2``; ``N`` even (half per replica) and at least ``D``."""
    return bidirectional_problems("chimera", num_ranks, num_microbatches, source)


smallest_num_microbatches = smallest_bidirectional_microbatches


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """Chimera plan for ``num_ranks`` (even) ranks and ``num_microbatches`` (even, >= D);
    the arguments must satisfy :func:`problems`."""
    return bidirectional_plan("chimera", bidirectional(num_ranks), num_microbatches, forward_only)


GENERATOR = ScheduleGenerator(
    name="chimera",
    summary="Chimera: two straight pipelines in opposite directions (two weight replicas)",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    runner=PLAN_RUNNER,
)
