"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with a split backward.

Placement (:func:`~.placement.looped`, one chunk per rank): stage ``r`` on rank ``r``.
Every backward runs as an input gradient ``I`` and a weight gradient ``W``
(:mod:`.actions`); only the ``I``'s are on the chain through the pipeline.

Ordering rule (the paper's handcrafted schedule with 1F1B's memory): rank ``r``

* runs 1F1B's ``D - r - 1`` warm-up forwards;
* then, for every remaining forward, ``F`` followed by the ``I`` of its oldest
  micro-batch without an input gradient, and then that of the oldest ``W`` — except that
  rank ``r`` keeps ``r`` weight gradients pending: the ``W`` is only run while more
  than ``r`` are waiting;
* the cool-down ``I``'s follow the same rule, and the ``r`` held-back ``W``'s run last,
  where 1F1B's cool-down would have waited for gradients.

At ``t_F = t_I = t_W`` the bubble is ``(D-1)(t_F + t_I - t_W)`` — a third of 1F1B's — and
the peak activations stay at 1F1B's ``D`` Ma (a micro-batch counts until its ``W``).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional

from .actions import Action, ActionType, SchedulePlan, make_plan
from .compose import with_eager_syncs
from .errors import PP_FLAG
from .generator import PLAN_RUNNER, ScheduleGenerator
from .placement import Placement, looped

F, I, W = ActionType.FORWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT


def rank_order(rank: int, num_ranks: int, num_microbatches: int) -> List[Action]:
    """Rank ``rank``'s actions (one chunk, index 0), without the ``SYNC``."""
    warmup = min(num_ranks - rank - 1, num_microbatches)
    actions = [Action(F, 0, m) for m in range(warmup)]
    pending: Deque[int] = deque()
    next_input_grad = 0

    def input_grad_then_weight_grad() -> None:
        nonlocal next_input_grad
        actions.append(Action(I, 0, next_input_grad))
        pending.append(next_input_grad)
        next_input_grad += 1
        if len(pending) > rank:
            actions.append(Action(W, 0, pending.popleft()))

    for m in range(warmup, num_microbatches):
        actions.append(Action(F, 0, m))
        input_grad_then_weight_grad()
    while next_input_grad < num_microbatches:
        input_grad_then_weight_grad()
    actions.extend(Action(W, 0, m) for m in pending)
    return actions


def placement(num_ranks: int) -> Placement:
    """Stage ``s`` on rank ``s``."""
    return looped(num_ranks)


def problems(num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """``N >= D``."""
    if num_microbatches is not None and num_microbatches < num_ranks:
        return [f"{source} = {num_microbatches}: zb-h1 needs at least {PP_FLAG}={num_ranks} micro-batches"]
    return []


def smallest_num_microbatches(num_ranks: int) -> int:
    return num_ranks


def generate(num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
    """ZB-H1 plan for ``num_ranks`` stages and ``num_microbatches`` (>= D) micro-batches; the
    arguments must satisfy :func:`problems`."""
    if forward_only:
        actions = [[Action(F, 0, m) for m in range(num_microbatches)] for _ in range(num_ranks)]
    else:
        actions = [with_eager_syncs(rank_order(r, num_ranks, num_microbatches)) for r in range(num_ranks)]
    return make_plan("zb-h1", looped(num_ranks), num_microbatches, [0] * num_microbatches, actions)


GENERATOR = ScheduleGenerator(
    name="zb-h1",
    summary="ZB-H1: 1F1B with a split backward, W in the bubbles (1F1B memory)",
    place=placement,
    problems=problems,
    smallest_num_microbatches=smallest_num_microbatches,
    generate=generate,
    always_split=True,
    runner=PLAN_RUNNER,
)
