"""Dependency-driven event simulation of a plan under a cost model.

Execution model (the same one the runtime implements):

* each rank runs its actions in plan order, one at a time;
* a forward starts when the rank is free and its input activation has arrived; a
  backward (``B``, or the input-gradient part ``I`` of a split backward) when the rank
  is free and the output gradient has arrived (the loss stage needs only its own
  forward, which the plan orders before it); a weight-gradient action ``W`` when the
  rank is free (its ``I`` ran earlier on the same rank);
* an overlapped pair ``OVERLAP_F_B`` (DualPipe's overlapped forward and backward chunks)
  starts when the rank is free and the inputs of *both* halves have arrived (the backward
  half's own forward ran earlier), and takes the sum of its halves' times, ``t_F + t_B``
  (``t_F + t_I`` with an ``I`` half): one device computes both, so the overlap saves no
  compute. What it overlaps is communication: both halves' receives are posted before the
  pair and both outputs are sent at its end, the forward half's first, as DualPipe's
  ``_forward_backward_chunk`` issues them — so the forward half's output leaves ``t_B`` later
  than after a lone ``F``, and the pair's messages travel while the next action computes.
  Activations: the forward half's are counted before the backward half's are released;
* communication is what the plan's ``SEND`` and ``RECV`` actions say (a compute-only
  plan is lowered first, :func:`~.lower.lower`): a ``SEND`` costs the rank nothing and
  never blocks it (it needs only its producer, earlier on the same rank); its message
  arrives ``message_time`` after the ``SEND`` is issued — directly after the producer
  ends, in a plan lowered by :func:`~.lower.lower`. A ``RECV`` only posts the receive
  and costs nothing; the consuming action waits for the message. A local V-turn
  hand-over costs nothing;
* ``SYNC(chunk)`` costs the rank no compute time: it *issues* an asynchronous
  all-reduce of that chunk's gradients among the chunk's replicas (mirror slots) and
  the data-parallel ranks. The all-reduce starts when every replica has issued it and
  the communication lane of each participant is free, and lasts
  :meth:`~.costs.CostModel.sync_time` (its bytes over the all-reduce bandwidth, for a group of
  replicas x data-parallel ranks, plus any fixed ``t_sync``).

The step ends when every rank has finished computing and every all-reduce has
completed. Bubble ratio is ``1 - busy / makespan`` averaged over ranks. Activations
are counted in units of ``Ma`` — one micro-batch's activations through ``L / D``
layers — so a forward of a stage adds ``stage_weight`` Ma until its backward. A split
backward keeps them counted until its ``W``: an upper bound (the deferred weight
gradients need the inputs and output gradients of the linear layers, not everything the
forward saved), and exactly what the emulated layers of the benchmark hold.

Stages cost what their :class:`~.stage_costs.StageCosts` say: by default equal stages of
``stage_weight`` device shares (:meth:`~.stage_costs.StageCosts.uniform`), or each stage its
own for a model of uneven stages (:meth:`~.stage_costs.StageCosts.for_model`), whose
activations are also counted in bytes: a forward's saved tensors until its ``B`` or ``I``, an
``I``'s kept inputs and output gradients until its ``W`` (``peak_activation_bytes``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

from .actions import Action, ActionType, SchedulePlan
from .comm import received_by
from .costs import CostModel
from .errors import PlanError
from .lower import lower
from .stage_costs import StageCosts


ENDS_BACKWARD = frozenset(kind for kind in ActionType if kind.ends_backward)


def same_rank_prerequisite(action: Action) -> Optional[Action]:
    """The action of the same rank that must have run before ``action``: the forward of a
    ``B`` or ``I``, the ``I`` of a ``W``, the producer of a ``SEND`` (``B`` standing for
    ``I``); None for ``F``, ``SYNC`` and ``RECV``."""
    if action.type.is_send:
        return action.compute_key
    if action.type.computes_input_grad:
        return Action(ActionType.FORWARD, action.chunk, action.microbatch)
    if action.type is ActionType.BACKWARD_WEIGHT:
        return Action(ActionType.BACKWARD_INPUT, action.chunk, action.microbatch)
    return None


class Event(NamedTuple):
    """One interval of the timeline: a compute action, or a gradient all-reduce (``SYNC``).

    ``ready`` is when the action could have started had the rank been free: its
    :func:`same_rank_prerequisite` done and its input message arrived (0 for ``SYNC``); for an
    overlapped pair (one event, ``pipeline`` its forward half's) the later of its halves'.
    """

    rank: int
    action: Action
    start: float
    end: float
    pipeline: int
    ready: float = 0.0


@dataclass
class SimulationResult:
    """What a simulated step looks like.

    Attributes:
        makespan: step time, from the first action to the last all-reduce.
        busy: per-rank compute time.
        bubble_ratio: mean over ranks of ``1 - busy / makespan``.
        peak_activations: per-rank maximum of in-flight activations, in Ma.
        stage_costs: what each stage of a pipeline cost.
        peak_activation_bytes: per-rank maximum of in-flight activation bytes (0 where the
            stage costs count no bytes).
        events: compute intervals, in start order per rank.
        sync_events: all-reduce intervals (one per participating rank).
    """

    plan: SchedulePlan
    costs: CostModel
    makespan: float
    busy: List[float]
    bubble_ratio: float
    peak_activations: List[float]
    stage_costs: StageCosts = field(repr=False)
    peak_activation_bytes: List[float]
    events: List[Event] = field(repr=False)
    sync_events: List[Event] = field(repr=False)

    def summary(self) -> dict:
        """JSON-ready summary (the CLI's ``--json`` object)."""
        plan = self.plan
        return {
            "schedule": plan.name,
            "pp": plan.num_ranks,
            "num_microbatches": plan.num_microbatches,
            "virtual_pipeline_size": plan.placement.chunks_per_rank // plan.placement.num_pipelines,
            "placement": plan.placement.name,
            "costs": asdict(self.costs),
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "busy": self.busy,
            "peak_activations": self.peak_activations,
            "valid": True,
        }


def simulate(
    plan: SchedulePlan, costs: Optional[CostModel] = None, stage_costs: Optional[StageCosts] = None
) -> SimulationResult:
    """Simulate one step of ``plan``; raise :class:`PlanError` on a deadlock.

    ``stage_costs`` gives each stage of a pipeline its own times and activations (default:
    equal stages, :meth:`~.stage_costs.StageCosts.uniform`, of ``costs``, or of
    :meth:`~.costs.CostModel.as_split` for a split-backward plan); ``costs`` the messages and
    all-reduces.

    A compute-only plan is lowered first (:func:`~.lower.lower`, default policy); the
    result's ``plan`` is the plan simulated. The plan is assumed valid (see
    :func:`~.validate.validate_plan`); a dependency that can never be satisfied is
    reported as a deadlock naming each blocked rank, its action and what it waits for.
    """
    costs = costs or CostModel()
    if not plan.has_communication:
        plan = lower(plan)
    placement = plan.placement
    stage_costs = stage_costs or StageCosts.uniform(costs.as_split() if plan.split_backward else costs, placement)
    if len(stage_costs.stages) != placement.num_stages:
        raise ValueError(f"{len(stage_costs.stages)} stage costs for the {placement.num_stages} stages of the {placement.name} placement")
    message_time = costs.message_time
    num_ranks = plan.num_ranks

    F, B, W = ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT
    I = ActionType.BACKWARD_INPUT
    slot_cost = [[stage_costs.stages[placement.role(r, c).stage] for c in range(placement.chunks_per_rank)] for r in range(num_ranks)]
    # Keys are (rank, type, chunk, micro-batch) tuples: ``F``/``B`` (``B`` for ``I`` too) of
    # finished compute actions, ``SEND_F``/``SEND_B`` of issued sends.
    finish: Dict[Tuple[int, ActionType, int, int], float] = {}  # -> end of a compute action
    arrival: Dict[Tuple[int, ActionType, int, int], float] = {}  # -> arrival of a send's message
    sources: Dict[Tuple[int, int, bool], Optional[Tuple[int, ActionType, int, bool]]] = {}
    pipeline_of = [[placement.role(r, c).pipeline for c in range(placement.chunks_per_rank)] for r in range(num_ranks)]
    clock = [0.0] * num_ranks
    cursor = [0] * num_ranks
    busy = [0.0] * num_ranks
    in_flight = [0.0] * num_ranks
    peak = [0.0] * num_ranks
    in_flight_bytes = [0.0] * num_ranks
    peak_bytes = [0.0] * num_ranks
    events: List[Event] = []
    sync_issue: Dict[Tuple[int, int], float] = {}

    def source(rank: int, chunk: int, forward: bool) -> Optional[Tuple[int, ActionType, int, bool]]:
        """(rank, producer or send type, chunk, local) of what a chunk's forward (or backward)
        receives: the producer on this rank for a V turn, else the other rank's send."""
        key = (rank, chunk, forward)
        if key not in sources:
            transfer = received_by(placement, rank, Action(F if forward else B, chunk, 0))
            if transfer is None:
                sources[key] = None
            elif transfer.is_local:
                sources[key] = (rank, transfer.producer.type, transfer.src.chunk, True)
            else:
                sources[key] = (transfer.src.rank, transfer.send.type, transfer.src.chunk, False)
        return sources[key]

    def input_ready(rank: int, action: Action) -> Optional[float]:
        """When the action's prerequisite on this rank is done and its input has arrived, or
        None if either has not run yet."""
        kind, chunk, microbatch = action.type, action.chunk, action.microbatch
        if kind is W:
            return finish.get((rank, B, chunk, microbatch))
        forward = kind is F
        own = 0.0 if forward else finish.get((rank, F, chunk, microbatch))
        if own is None:
            return None
        src = source(rank, chunk, forward)
        if src is None:
            return own
        src_rank, src_type, src_chunk, local = src
        produced = (finish if local else arrival).get((src_rank, src_type, src_chunk, microbatch))
        return None if produced is None else max(own, produced)

    progressed = True
    while progressed:
        progressed = False
        for rank in range(num_ranks):
            actions = plan.actions[rank]
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                if action.type is ActionType.SYNC:
                    sync_issue[(rank, action.chunk)] = clock[rank]
                elif action.type.is_send:
                    producer = action.compute_key
                    if (rank, producer.type, producer.chunk, producer.microbatch) not in finish:
                        break
                    arrival[(rank, action.type, action.chunk, action.microbatch)] = clock[rank] + message_time
                elif not action.type.is_receive:
                    readies = [input_ready(rank, part) for part in action.parts]
                    if None in readies:
                        break
                    ready = max(readies)
                    start = max(clock[rank], ready)
                    end = start + sum(slot_cost[rank][part.chunk].time(part.type) for part in action.parts)
                    for part in action.parts:  # an overlapped pair: both outputs at its end
                        kind = B if part.type is I else part.type
                        finish[(rank, kind, part.chunk, part.microbatch)] = end
                        stage = slot_cost[rank][part.chunk]
                        if part.type is F:
                            in_flight[rank] += stage.activation_shares
                            peak[rank] = max(peak[rank], in_flight[rank])
                        elif part.type in ENDS_BACKWARD:
                            in_flight[rank] -= stage.activation_shares
                        if part.type is F:
                            in_flight_bytes[rank] += stage.activation_bytes
                        elif part.type is B:
                            in_flight_bytes[rank] += -stage.activation_bytes
                        elif part.type is I:
                            in_flight_bytes[rank] += stage.weight_grad_bytes - stage.activation_bytes
                        else:  # W (the only other compute part)
                            in_flight_bytes[rank] += -stage.weight_grad_bytes
                        peak_bytes[rank] = max(peak_bytes[rank], in_flight_bytes[rank])
                    clock[rank] = end
                    busy[rank] += end - start
                    events.append(Event(rank, action, start, end, pipeline_of[rank][action.chunk], ready))
                cursor[rank] += 1
                progressed = True

    blocked = [r for r in range(num_ranks) if cursor[r] < len(plan.actions[r])]
    if blocked:
        raise PlanError(_deadlock_message(plan, blocked, cursor, finish, input_ready))

    sync_events = _schedule_syncs(plan, costs, stage_costs, sync_issue)
    end_of_step = max([max(clock)] + [e.end for e in sync_events])
    bubble = sum(1.0 - b / end_of_step for b in busy) / num_ranks if end_of_step > 0 else 0.0
    events.sort(key=lambda e: (e.rank, e.start))
    return SimulationResult(plan, costs, end_of_step, busy, bubble, peak, stage_costs, peak_bytes, events, sync_events)


def _schedule_syncs(
    plan: SchedulePlan, costs: CostModel, stage_costs: StageCosts, issued: Dict[Tuple[int, int], float]
) -> List[Event]:
    """Place every all-reduce: after all replicas issued it, serialised per rank's comm lane."""
    placement = plan.placement
    groups: Dict[Tuple, List[Tuple[int, int]]] = {}
    for rank, chunk in issued:
        members = tuple(sorted((loc.rank, loc.chunk) for loc in placement.mirror_slots(rank, chunk)))
        groups.setdefault(members, [])
    lane_free = [0.0] * plan.num_ranks
    events: List[Event] = []
    ordered = sorted(groups, key=lambda members: max(issued.get(m, 0.0) for m in members))
    for members in ordered:
        missing = [m for m in members if m not in issued]
        if missing:
            raise PlanError(f"SYNC of rank {members[0][0]} chunk {members[0][1]} never issued by replica(s) {missing}")
        stage = placement.role(*members[0]).stage
        duration = costs.sync_time(stage_costs.stages[stage].sync_weight, len(members) * stage_costs.context_parallel_size)
        start = max(max(issued[m] for m in members), max(lane_free[r] for r, _ in members))
        for rank, chunk in members:
            lane_free[rank] = start + duration
            pipeline = placement.role(rank, chunk).pipeline
            events.append(Event(rank, Action(ActionType.SYNC, chunk), start, start + duration, pipeline))
    return events


def _deadlock_message(plan: SchedulePlan, blocked: List[int], cursor: List[int], finish, input_ready) -> str:
    """One line per blocked rank: what its next action (each waiting half of a pair) waits for."""
    lines = [f"plan '{plan.name}' deadlocks (D={plan.num_ranks}, N={plan.num_microbatches}):"]
    waiting = [(rank, part) for rank in blocked for part in plan.actions[rank][cursor[rank]].parts
               if part.type.is_send or input_ready(rank, part) is None]
    for rank, action in waiting:
        before = same_rank_prerequisite(action)
        if before is not None and (rank, before.comm_key.type, before.chunk, before.microbatch) not in finish:
            lines.append(f"  rank {rank} at {action}: its {before} has not run")
            continue
        transfer = received_by(plan.placement, rank, action)
        producer = transfer.producer
        produced = (transfer.src.rank, producer.type, producer.chunk, producer.microbatch) in finish
        state = f"run but {transfer.send} not yet issued" if produced and not transfer.is_local else "not yet run"
        lines.append(
            f"  rank {rank} at {action}: waits for the {transfer.payload.value} of micro-batch "
            f"{action.microbatch} from rank {transfer.src.rank} ({transfer.producer}), {state}"
        )
    return "\n".join(lines)
