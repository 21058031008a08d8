"""DualPipe (DeepSeek-V3 technical report, 2024): two replicas, forward and backward overlapped.

Placement (:func:`~.placement.bidirectional`, Chimera's): two weight replicas of ``D``
stages; chunk 0 of rank ``r`` is stage ``r`` of the down pipeline, chunk 1 is stage
``D-1-r`` of the up pipeline. Micro-batches ``0 .. N/2-1`` go down, ``N/2 .. N-1`` up.

Ordering rule. Rank ``r`` works in terms of its *half rank* ``h = min(r, D-1-r)`` and
two phases: phase 0 is the chunk whose pipeline enters at the rank's own end (the down
pipeline on the upper half of the ranks, ``r < D/2``; the up pipeline on the lower half),
phase 1 the other. With ``u = D/2`` and ``n = N/2`` micro-batches per direction, in eight
steps:

1. ``2(u-h-1)`` forwards of phase 0;
2. ``h+1`` times: forward of phase 0, forward of phase 1;
3. ``u-h-1`` times: input gradient of phase 1, the oldest weight gradient, forward of
   phase 1 (zero-bubble style);
4. ``n-D+h+1`` times: forward of phase 0 overlapped with backward of phase 1, then forward of
   phase 1 overlapped with backward of phase 0 — the main step; on the middle ranks
   (``h = u-1``) the first of these pairs runs as a forward, then a backward, not overlapped;
5. ``u-h-1`` times: backward of phase 1, then forward of phase 1 overlapped with backward of
   phase 0;
6. ``h+1`` times: backward of phase 1, backward of phase 0 — from the middle of this step
   on (phase 1 first on odd ``h``, phase 0 first on even ``h``) as input gradients only,
   their weight gradients queued;
7. ``u-h-1`` times: the oldest queued weight gradient, an input gradient of phase 0;
8. the ``h+1`` weight gradients still queued.

Every micro-batch's backward is therefore either whole (``B``) or split (``I`` then a
later ``W``, oldest first). An overlapped pair is one ``OVERLAP_F_B`` action
(:func:`~.actions.overlapped`) whose backward half is always whole: both halves' inputs are
received, both computed, then both outputs sent, as DeepSeek's ``_forward_backward_chunk``
does (the simulator's rule for it: :mod:`.simulate`). Needs ``N >= 2D``, even; 2x weights;
peak activations ``D + 1`` Ma on the middle ranks.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from .actions import Action, ActionType, SchedulePlan, make_plan, overlapped
from .compose import with_eager_syncs
from .errors import PP_FLAG
from .generator import PLAN_RUNNER, ScheduleGenerator
from .placement import bidirectional

F, B, I, W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


class PhaseOrder:
    """Appends one rank's actions phase by phase, numbering each chunk's micro-batches.

    ``chunk_of_phase[p]`` is the local chunk of phase ``p``; ``microbatches[c]`` the
    micro-batches chunk ``c`` sees, in order. Forwards and backwards of a chunk take its
    micro-batches in that order; split backwards queue their weight gradients (oldest
    first). Shared by DualPipe and DualPipeV.
    """

    def __init__(self, chunk_of_phase: Tuple[int, int], microbatches: Dict[int, List[int]]) -> None:
        self.chunk_of_phase = chunk_of_phase
        self.microbatches = microbatches
        self.forwards = {c: 0 for c in microbatches}
        self.backwards = {c: 0 for c in microbatches}
        self.weight_grads: Deque[Action] = deque()
        self.actions: List[Action] = []

    def forward(self, phase: int) -> None:
        chunk = self.chunk_of_phase[phase]
        self.actions.append(Action(F, chunk, self.microbatches[chunk][self.forwards[chunk]]))
        self.forwards[chunk] += 1

    def backward(self, phase: int, split: bool = False) -> None:
        chunk = self.chunk_of_phase[phase]
        microbatch = self.microbatches[chunk][self.backwards[chunk]]
        self.backwards[chunk] += 1
        self.actions.append(Action(I if split else B, chunk, microbatch))
        if split:
            self.weight_grads.append(Action(W, chunk, microbatch))

    def overlapped(self, forward_phase: int, backward_phase: int) -> None:
        """A forward of ``forward_phase`` overlapped with a whole backward of ``backward_phase``."""
        self.forward(forward_phase)
        self.backward(backward_phase)
        backward = self.actions.pop()
        self.actions.append(overlapped(self.actions.pop(), backward))

    def weight_grad(self) -> None:
        self.actions.append(self.weight_grads.popleft())

    def drain(self, half_rank: int, steps_before: int) -> None:
        """Steps 6-8 of DualPipe (see the module docstring), ``steps_before`` = ``u-h-1``."""
        split = False
        step_6 = half_rank + 1
        for i in range(step_6):
            if i == step_6 // 2 and half_rank % 2 == 1:
                split = True
            self.backward(1, split)
            if i == step_6 // 2 and half_rank % 2 == 0:
                split = True
            self.backward(0, split)
        for _ in range(steps_before):
            self.weight_grad()
            self.backward(0, split=True)
        while self.weight_grads:
            self.weight_grad()


def overlapped_rank_order(order: PhaseOrder, half_rank: int, half_ranks: int, per_direction: int) -> List[Action]:
    """Steps 1-8 for one rank: ``half_ranks`` = ``u``, ``per_direction`` = micro-batches per
    phase. The middle ranks (``h = u-1``) run the first pair of step 4 without overlap, as the
    published order does (to shorten their bubble)."""
    h, u = half_rank, half_ranks
    for _ in range(2 * (u - h - 1)):
        order.forward(0)
    for _ in range(h + 1):
        order.forward(0)
        order.forward(1)
    for _ in range(u - h - 1):
        order.backward(1, split=True)
        order.weight_grad()
        order.forward(1)
    for i in range(per_direction - 2 * u + h + 1):
        if i == 0 and h == u - 1:
            order.forward(0)
            order.backward(1)
        else:
            order.overlapped(0, 1)
        order.overlapped(1, 0)
    for _ in range(u - h - 1):
        order.backward(1)
        order.overlapped(1, 0)
    order.drain(h, u - h - 1)
    return order.actions


placement = bidirectional


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """Even ``D >= 2``; ``N`` even and at least ``2D``."""
    if num_ranks < 2 or num_ranks % 2:
        return [f"{PP_FLAG} must be even and >= 2 for dualpipe (got {num_ranks})"]
    if num_microbatches is not None and (num_microbatches % 2 or num_microbatches < 2 * num_ranks):
        return [f"{source} = {num_microbatches}: dualpipe needs an even number of micro-batches, "
                f"at least 2 x {PP_FLAG} = {2 * num_ranks}"]
    return []


def smallest_num_microbatches(num_ranks: int) -> int:
    return 2 * num_ranks


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """DualPipe plan for ``num_ranks`` (even) ranks and ``num_microbatches`` (even, >= 2D); the
    arguments must satisfy :func:`problems`."""
    per_direction = num_microbatches // 2
    microbatches = {0: list(range(per_direction)), 1: list(range(per_direction, num_microbatches))}
    microbatch_pipeline = [0] * per_direction + [1] * per_direction
    actions = []
    for rank in range(num_ranks):
        lower_half = rank >= num_ranks // 2
        if forward_only:
            actions.append([Action(F, c, m) for c in (0, 1) for m in microbatches[c]])
            continue
        order = PhaseOrder((1, 0) if lower_half else (0, 1), microbatches)
        half_rank = min(rank, num_ranks - 1 - rank)
        actions.append(with_eager_syncs(overlapped_rank_order(order, half_rank, num_ranks // 2, per_direction)))
    return make_plan("dualpipe", bidirectional(num_ranks), num_microbatches, microbatch_pipeline, actions)


GENERATOR = ScheduleGenerator(
    name="dualpipe",
    summary="DualPipe: two pipelines in opposite directions, forward and backward overlapped",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    always_split=True,
    runner=PLAN_RUNNER,
)
