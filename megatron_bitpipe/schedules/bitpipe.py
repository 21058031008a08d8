"""BitPipe: bidirectional, interleaved, V-shaped pipeline schedule (Wu et al., 2024).

Placement (:func:`~.placement.bidirectional_v`): two weight replicas, each a V of
``2D`` stages; pipeline A enters at rank 0, pipeline B at rank ``D-1``; every rank holds
four chunks of ``L / 2D`` layers. Micro-batches ``0 .. N/2-1`` take pipeline A and
``N/2 .. N-1`` pipeline B; the gradients of the two replicas are summed, so one step
equals training one model on all ``N`` micro-batches.

Ordering rule (:func:`~.compose.lockstep_order`): the ``i``-th micro-batch of each
direction enters in round ``tau_i = 2D * (i // (D/2)) + 2 * (i % (D/2))`` — groups of
``D/2`` micro-batches two rounds apart, one group every ``2D`` rounds. Its forward of
stage ``s`` belongs to round ``tau_i + s`` and its backward of stage ``s`` to round
``tau_i + 4D - 2 - s``; each rank runs its actions in round order, forward before
backward.

Why this works:

* at ``N = D`` (one group) the order is exactly the published BitPipe ordering —
  warm-up forwards, 1F1B pairs, cool-down backwards; bubble ``(D-2) / (3N+D-2)`` at
  ``t_B = 2 t_F``;
* once groups overlap, every rank runs exactly one forward and one backward per round:
  mod ``2D`` the rounds of the four chunks' forwards on rank ``r`` are
  ``{r + 2j}``, ``{D + r + 2j}`` (same parity, disjoint) and ``{-1 - r + 2j}``,
  ``{D - 1 - r + 2j}`` (other parity, disjoint) for ``j < D/2``, and likewise for the
  backwards. The steady state has no bubble, so the absolute bubble stays at
  ``(D-2) t_F`` for every ``N`` that is a multiple of ``D``: ``(D-2) / (3N+D-2)``, e.g.
  5.9% at ``D=8, N=32`` where the published concatenation of units reaches 13.5%;
* peak in-flight activations: ``D`` Ma on the middle ranks, ``3D/4 + 1/2`` Ma on the
  edge ranks — no more than 1F1B's ``D`` Ma.

``N`` must be even and at least ``D``. When ``N/2`` is not a multiple of ``D/2`` the last
group is partial and the bubble is that of Chimera at the same ``N``.

With a split backward (:func:`with_split_backward`) the order is planned for the cost
model: with free messages the lock-step order with its ``W``'s placed reaches the
placement's bound; with a message time the latency-aware list schedule
(:mod:`.list_scheduling`) usually wins, and the faster of the two under the given costs
is returned — never above ``D`` Ma of activations per rank.
"""

from __future__ import annotations

from typing import List, Optional

from .actions import SchedulePlan
from .compose import bidirectional_plan, bidirectional_problems, smallest_bidirectional_microbatches
from .generator import PLAN_RUNNER, ScheduleGenerator
from .list_scheduling import latency_aware_split
from .placement import bidirectional_v
from .costs import CostModel


placement = bidirectional_v


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """Even ``D >= 2``; ``N`` even (half per replica) and at least ``D``."""
    return bidirectional_problems("bitpipe", num_ranks, num_microbatches, source)


smallest_num_microbatches = smallest_bidirectional_microbatches


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """BitPipe plan for ``num_ranks`` (even) ranks and ``num_microbatches`` (even, >= D);
    the arguments must satisfy :func:`problems`."""
    return bidirectional_plan("bitpipe", bidirectional_v(num_ranks), num_microbatches, forward_only)


def with_split_backward(plan: SchedulePlan, costs: Optional[CostModel] = None) -> SchedulePlan:
    """BitPipe ``plan`` (whole backwards, compute-only) with a split backward, ordered for
    ``costs``.

    At most ``D`` Ma per rank (1F1B's peak, the unsplit plan's); the list schedule's
    first group of ``D/2`` micro-batches per direction enters without release times.
    """
    num_ranks = plan.num_ranks
    return latency_aware_split(plan, costs or CostModel(), num_ranks, (num_ranks // 2,))


GENERATOR = ScheduleGenerator(
    name="bitpipe",
    summary="BitPipe: two V-shaped pipelines in opposite directions, interleaved (two weight replicas)",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    split_backward=with_split_backward,
    runner=PLAN_RUNNER,
)
