"""Split backward: run every ``B`` as ``I`` + ``W`` and put the ``W``'s into the bubbles.

A backward does two things: the input gradient, which the previous stage is waiting for,
and the weight gradients, which nothing but the optimizer step waits for. Splitting them
(``I`` and ``W``, zero-bubble style) shortens the chain of dependent work through the
pipeline — only ``I`` is on it — and the ``W``'s become free work that fills the gaps a
rank would otherwise spend waiting.

:func:`split_backward` turns any training plan into one with a split backward, keeping
the order of its forwards and input gradients, and places each ``W`` on the same rank
after its ``I``:

* **into a gap** — where the cost model predicts the rank would wait for its next input
  at least as long as the ``W`` takes (so the ``W`` delays nothing), oldest ``W`` first;
* **before a forward that would exceed the activation limit** — a micro-batch's
  activations count until its ``W`` (:mod:`.simulate`), so pending ``W``'s are run
  first when the next forward would raise the rank's count above ``activation_limit``;
  by default the unsplit plan's own peak, so splitting never costs activation memory
  (for BitPipe: ``D`` Ma, 1F1B's peak);
* **at the end** otherwise, each chunk's ``SYNC`` right after its last ``W``.

Where a rank waits depends on when its inputs arrive, which depends on where the other
ranks put their ``W``'s. The placement therefore starts from the arrival times of the plan
without any ``W`` (each rank's earliest possible timeline), simulates the result, and
repeats with the simulated arrival times; it keeps the fastest plan found. The result
depends on the cost model's *ratios* (``t_forward : t_backward : t_weight``, and ``t_input`` when
given, and the message time), not on its unit.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from .actions import Action, ActionType, SchedulePlan, make_plan
from .compose import with_eager_syncs
from .errors import PlanError
from .costs import CostModel
from .simulate import SimulationResult, simulate

__all__ = ["SPLIT_BACKWARD_SUFFIX", "split_backward", "timed_split_backward"]

#: what a split plan's name adds to its schedule's (``bitpipe+split-backward``): the one spelling
#: of the variant, as in ``--split-backward``
SPLIT_BACKWARD_SUFFIX = "+split-backward"

#: Placement rounds: each re-places every W against the previous round's simulated arrivals.
ROUNDS = 4
_EPS = 1e-9

Arrivals = Dict[Tuple[int, Action], float]  # (rank, F or I action) -> time its input arrives


def split_backward(
    plan: SchedulePlan, costs: Optional[CostModel] = None, activation_limit: Optional[float] = None
) -> SchedulePlan:
    """``plan`` with every ``B(c, m)`` run as ``I(c, m)`` followed later by ``W(c, m)``.

    Args:
        plan: a training plan with whole backwards (``B``); its communication actions, if
            it was lowered, are dropped (lower the result again, :func:`~.lower.lower`).
        costs: the cost model the ``W``'s are placed for (default :class:`CostModel`,
            ``t_weight`` half of ``t_backward``): ``I`` takes its ``input_time``, ``W`` its
            ``weight_time``.
        activation_limit: most in-flight activations (Ma) a rank may hold, counting a
            micro-batch until its ``W``; default the unsplit plan's peak over all ranks.
            The forwards keep their order, so a rank whose own plan holds more before its
            first backward keeps that peak (its ``W``'s then run as early as possible).

    Returns:
        A compute-only plan named with :data:`SPLIT_BACKWARD_SUFFIX` (``bitpipe+split-backward``),
        the same forwards and input gradients in the same order per rank.
    """
    return timed_split_backward(plan, costs, activation_limit)[0]


def timed_split_backward(
    plan: SchedulePlan, costs: Optional[CostModel] = None, activation_limit: Optional[float] = None
) -> Tuple[SchedulePlan, SimulationResult]:
    """:func:`split_backward` and its simulation under ``costs`` (the one it was chosen by:
    callers that compare it need not simulate it again)."""
    plan = plan.compute_only()
    if not any(a.type is ActionType.BACKWARD for _, a in plan):
        raise PlanError(f"plan '{plan.name}' has no whole backward (B) to split")
    costs = costs or CostModel()
    limit = max(simulate(plan, costs).peak_activations) if activation_limit is None else activation_limit
    ordered = [
        [Action(ActionType.BACKWARD_INPUT, a.chunk, a.microbatch) if a.type is ActionType.BACKWARD else a
         for a in actions if a.type is not ActionType.SYNC]
        for actions in plan.actions
    ]
    arrivals = _arrivals(simulate(_with_actions(plan, ordered), costs))
    split_costs = costs.as_split()  # the W's are placed at the split plan's action times
    best: Optional[Tuple[float, SchedulePlan, SimulationResult]] = None
    for _ in range(ROUNDS):
        candidate = _with_actions(plan, [
            with_eager_syncs(_place_weight_grads(plan, rank, ordered[rank], arrivals, split_costs, limit))
            for rank in range(plan.num_ranks)
        ])
        result = simulate(candidate, costs)
        if best is None or result.makespan < best[0] - _EPS:
            best = (result.makespan, candidate, result)
        arrivals = _arrivals(result)
    return best[1], best[2]


def _place_weight_grads(
    plan: SchedulePlan,
    rank: int,
    ordered: Sequence[Action],
    arrivals: Arrivals,
    costs: CostModel,
    limit: float,
) -> List[Action]:
    """One rank's forwards and input gradients with its ``W``'s placed (see module doc)."""
    weight = plan.placement.stage_weight
    w_time = costs.weight_time * weight
    clock, in_flight = 0.0, 0.0
    pending: Deque[Action] = deque()
    out: List[Action] = []

    def run_oldest_weight_grad() -> None:
        nonlocal clock, in_flight
        out.append(pending.popleft())
        clock += w_time
        in_flight -= weight

    for action in ordered:
        if action.type is ActionType.FORWARD:
            while pending and in_flight + weight > limit + _EPS:
                run_oldest_weight_grad()
        ready = arrivals.get((rank, action), 0.0)
        while pending and clock + w_time <= ready + _EPS:
            run_oldest_weight_grad()
        out.append(action)
        clock = max(clock, ready) + costs.compute_time(action, weight)
        if action.type is ActionType.FORWARD:
            in_flight += weight
        else:
            pending.append(Action(ActionType.BACKWARD_WEIGHT, action.chunk, action.microbatch))
    while pending:
        run_oldest_weight_grad()
    return out


def _arrivals(result: SimulationResult) -> Arrivals:
    """When each forward's / input gradient's input reached its rank in a simulated step."""
    return {(e.rank, e.action): e.ready for e in result.events if e.action.type is not ActionType.BACKWARD_WEIGHT}


def _with_actions(plan: SchedulePlan, actions: Sequence[Sequence[Action]]) -> SchedulePlan:
    return make_plan(f"{plan.name}{SPLIT_BACKWARD_SUFFIX}", plan.placement, plan.num_microbatches, plan.microbatch_pipeline, actions)
