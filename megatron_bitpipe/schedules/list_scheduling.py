"""Latency-aware split backward: a plan's order re-planned by list scheduling under its costs.

A lock-step plan (:func:`~.compose.lockstep_order`) moves every micro-batch one stage per
round. With free messages that is optimal for BitPipe and the V (its ``W``'s placed by
:func:`~.split_backward.split_backward`). With a message time ``t_p2p`` every hop where a
rank waits for exactly the message it needs next costs ``t_p2p``, and in the warm-up and
the cool-down almost every hop is such a hop.

:func:`list_schedule` plans the step by simulating it while it is being planned: whenever
a rank is free it chooses among the actions whose inputs have arrived *by then* — the next
forward and the next input gradient of each of its chunks, micro-batches in their
pipeline's order so every channel stays FIFO:

1. the ready forward or input gradient that comes first in the rank's *skeleton* order
   (the lock-step plan's), a forward only once its release time has passed and only if
   the rank stays within the activation limit (a micro-batch counts from its ``F`` to
   its ``W``, as in :mod:`.simulate`);
2. otherwise its oldest pending weight gradient ``W`` — or, when gradient all-reduces
   cost time, the ``W`` of the chunk with the least work left, so that chunks complete
   one after another and each chunk's ``SYNC`` (right after its last ``W``) starts its
   all-reduce while the rank still computes;
3. otherwise it waits for the next message.

So a rank never waits for one message while another input is ready, and the ``W``'s fill
every wait. Everything a rank knows at time ``t`` is known to the planner (actions are
planned in time order, and every action takes time). The plan keeps only the order;
:func:`~.simulate.simulate` times it (a forward held back by its release time may then
start earlier than planned), and that simulated makespan is what the candidates are
compared by.

Release times keep the steady state's memory: the forwards of micro-batches after the
first ``free`` of each pipeline start no earlier than in the lock-step plan with its
``W``'s placed. The first ``free`` are not held back, so the warm-up fills with the
forwards that hide the messages (free = one group, whose memory the limit allows).

:func:`latency_aware_split` returns the faster of the two plans (lock-step with ``W``'s
placed, and list scheduled) under the given costs; both keep the activation limit. The
choice depends on the cost model's ratios, not its unit.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .actions import Action, ActionType, SchedulePlan, make_plan
from .compose import with_eager_syncs
from .errors import PlanError
from .placement import Placement
from .costs import CostModel
from .simulate import simulate
from .split_backward import timed_split_backward

__all__ = ["latency_aware_split", "list_schedule", "timed_latency_aware_split"]

F, B, I, W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
_EPS = 1e-9
_NEVER = float("inf")

Key = Tuple[ActionType, int, int, int]  # (F or I, pipeline, stage, index in the pipeline's order)


class _Slot:
    """One chunk of one rank: its stage, the micro-batches it sees and how far it got."""

    __slots__ = ("chunk", "pipeline", "stage", "microbatches", "forwards", "input_grads")

    def __init__(self, chunk: int, pipeline: int, stage: int, microbatches: Sequence[int]) -> None:
        self.chunk, self.pipeline, self.stage, self.microbatches = chunk, pipeline, stage, microbatches
        self.forwards = 0  # forwards planned so far (index into microbatches)
        self.input_grads = 0


def list_schedule(
    placement: Placement,
    microbatch_pipeline: Sequence[int],
    costs: CostModel,
    activation_limit: float,
    priority: Callable[[int, Key], float],
    release: Callable[[Key], float],
    finish_chunks: bool = False,
) -> List[List[Action]]:
    """Per-rank ``F``/``I``/``W`` orders (no ``SYNC``); see the module docstring.

    Args:
        placement, microbatch_pipeline: where stages live and which pipeline each
            micro-batch takes.
        costs: what is planned for (compute times and the message time).
        activation_limit: most activations (Ma) a rank may hold.
        priority: ``priority(rank, key)``, lower first, for ``key`` an ``F`` or ``I``.
        release: earliest start of a forward ``key``.
        finish_chunks: pick ``W``'s to complete chunks early (step 2) instead of oldest first.

    Raises:
        PlanError: when every rank waits and work is left (the limit is too low for
            the release times).
    """
    num_ranks, num_stages, weight = placement.num_ranks, placement.num_stages, placement.stage_weight
    split = costs.as_split()  # the orders are split plans': F while deferring
    duration = {kind: split.compute_time(Action(kind, 0, 0), weight) for kind in (F, I, W)}
    message = costs.message_time
    routed = {p: [m for m, q in enumerate(microbatch_pipeline) if q == p] for p in range(placement.num_pipelines)}
    slots: List[List[_Slot]] = [[] for _ in range(num_ranks)]
    for p, locations in enumerate(placement.stages):
        for s, loc in enumerate(locations):
            slots[loc.rank].append(_Slot(loc.chunk, p, s, routed[p]))
    hop = {  # (pipeline, stage, stage it receives from) -> message time (0 for a V turn)
        (p, s, t): 0.0 if locations[s].rank == locations[t].rank else message
        for p, locations in enumerate(placement.stages)
        for s in range(num_stages)
        for t in (s - 1, s + 1)
        if 0 <= t < num_stages
    }
    finished: Dict[Key, float] = {}

    def ready_time(slot: _Slot, kind: ActionType) -> Optional[float]:
        """When the slot's next ``kind`` action has its inputs; None while unknown or done."""
        p, s = slot.pipeline, slot.stage
        if kind is F:
            k = slot.forwards
            if k == len(slot.microbatches):
                return None
            at = release((F, p, s, k))
            if s > 0:
                end = finished.get((F, p, s - 1, k))
                if end is None:
                    return None
                at = max(at, end + hop[p, s, s - 1])
            return at
        k = slot.input_grads
        if k == slot.forwards:
            return None
        at = finished[F, p, s, k]
        if s < num_stages - 1:
            end = finished.get((I, p, s + 1, k))
            if end is None:
                return None
            at = max(at, end + hop[p, s, s + 1])
        return at

    orders: List[List[Action]] = [[] for _ in range(num_ranks)]
    pending: List[Deque[Tuple[_Slot, int]]] = [deque() for _ in range(num_ranks)]
    held = [0.0] * num_ranks
    free_at = [0.0] * num_ranks
    remaining = [2 * sum(len(slot.microbatches) for slot in row) for row in slots]  # F's and I's
    wake = [0.0] * num_ranks  # the time of each rank's live queue entry
    queue = [(0.0, r) for r in range(num_ranks)]

    def notify(rank: int, time: float) -> None:
        time = max(time, free_at[rank])
        if time < wake[rank] - _EPS:
            wake[rank] = time
            heapq.heappush(queue, (time, rank))

    def run(rank: int, start: float, slot: _Slot, kind: ActionType, index: int) -> None:
        end = start + duration[kind]
        orders[rank].append(Action(kind, slot.chunk, slot.microbatches[index]))
        free_at[rank] = end
        wake[rank] = _NEVER
        notify(rank, end)
        if kind is W:
            held[rank] -= weight
            return
        remaining[rank] -= 1
        finished[kind, slot.pipeline, slot.stage, index] = end
        if kind is F:
            held[rank] += weight
            slot.forwards += 1
            neighbour = slot.stage + 1
        else:
            slot.input_grads += 1
            pending[rank].append((slot, index))
            neighbour = slot.stage - 1
        if 0 <= neighbour < num_stages:
            consumer = placement.location(slot.pipeline, neighbour).rank
            notify(consumer, end + hop[slot.pipeline, neighbour, slot.stage])

    while queue:
        time, rank = heapq.heappop(queue)
        if time != wake[rank]:
            continue
        wake[rank] = _NEVER
        best, upcoming = None, _NEVER
        room = held[rank] + weight <= activation_limit + _EPS
        for slot in slots[rank]:
            for kind in (F, I):
                at = ready_time(slot, kind)
                if at is None or (kind is F and not room):
                    continue
                if at > time + _EPS:
                    upcoming = min(upcoming, at)
                    continue
                index = slot.forwards if kind is F else slot.input_grads
                rank_key = priority(rank, (kind, slot.pipeline, slot.stage, index))
                if best is None or rank_key < best[0]:
                    best = (rank_key, slot, kind, index)
        if best is not None:
            run(rank, time, *best[1:])
        elif pending[rank]:
            if finish_chunks:  # the W of the chunk closest to its last W, so its SYNC starts early
                own = {id(s): 2 * len(s.microbatches) - s.forwards - s.input_grads for s in slots[rank]}
                for slot, _ in pending[rank]:
                    own[id(slot)] += 1
                left = {  # a pipeline's later stages on this rank complete first (a tied head
                    id(s): sum(own[id(t)] for t in slots[rank]  # adds to the embedding's weight)
                               if t.pipeline == s.pipeline and t.stage >= s.stage)
                    for s in slots[rank]
                }
                chosen = min(range(len(pending[rank])), key=lambda i: (left[id(pending[rank][i][0])], i))
                slot, index = pending[rank][chosen]
                del pending[rank][chosen]
            else:
                slot, index = pending[rank].popleft()
            run(rank, time, slot, W, index)
        elif upcoming < _NEVER:
            notify(rank, upcoming)
    stuck = [r for r in range(num_ranks) if remaining[r]]
    if stuck:
        raise PlanError(f"list scheduling stalled on ranks {stuck} at an activation limit of {activation_limit:g} Ma")
    return orders


def latency_aware_split(
    plan: SchedulePlan, costs: CostModel, activation_limit: float, free: Sequence[int]
) -> SchedulePlan:
    """``plan`` (whole backwards, lock-step) with a split backward, ordered for ``costs``.

    Returns the fastest, under ``costs``, of :func:`~.split_backward.split_backward` of
    ``plan`` and the plans :func:`list_schedule` builds with ``plan``'s per-rank order as
    priorities and, for the micro-batches after the first ``f`` of each pipeline (one
    plan for each ``f`` in ``free``), the forwards' start times of the former as release
    times (module docstring). All hold at most ``activation_limit`` Ma per rank; a tie
    keeps the earlier plan, the lock-step one first.
    """
    return timed_latency_aware_split(plan, costs, activation_limit, free)[0]


def timed_latency_aware_split(
    plan: SchedulePlan, costs: CostModel, activation_limit: float, free: Sequence[int]
) -> Tuple[SchedulePlan, float]:
    """:func:`latency_aware_split` and its simulated makespan under ``costs`` (what it was
    chosen by: callers that compare it need not simulate it again)."""
    plan = plan.compute_only()
    placed, timeline = timed_split_backward(plan, costs, activation_limit)
    placement = plan.placement
    index_in_pipeline = {m: plan.microbatches_of_pipeline(p).index(m) for m, p in enumerate(plan.microbatch_pipeline)}

    def key(rank: int, action: Action) -> Key:
        role = placement.role(rank, action.chunk)
        kind = F if action.type is F else I
        return (kind, role.pipeline, role.stage, index_in_pipeline[action.microbatch])

    position = [
        {key(rank, a): i for i, a in enumerate(actions) if a.type in (F, B)} for rank, actions in enumerate(plan.actions)
    ]
    start = {key(e.rank, e.action): e.start for e in timeline.events if e.action.type is F}
    syncs_cost = costs.sync_time(placement.stage_weight, placement.num_pipelines) > 0
    best, best_makespan = placed, timeline.makespan
    for first in dict.fromkeys(free):
        try:
            orders = list_schedule(
                placement, plan.microbatch_pipeline, costs, activation_limit,
                priority=lambda rank, k: position[rank][k],
                release=lambda k: start[k] if k[3] >= first else 0.0,
                finish_chunks=syncs_cost,
            )
        except PlanError:
            continue
        scheduled = make_plan(placed.name, placement, plan.num_microbatches, plan.microbatch_pipeline,
                              [with_eager_syncs(o) for o in orders])
        result = simulate(scheduled, costs)
        if result.makespan < best_makespan - _EPS and max(result.peak_activations) <= activation_limit + _EPS:
            best, best_makespan = scheduled, result.makespan
    return best, best_makespan
