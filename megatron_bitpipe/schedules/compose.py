"""Building blocks shared by the schedule generators.

* :func:`one_f_one_b` — "warm-up forwards, one-forward-one-backward, cool-down
  backwards" over a per-rank forward order and backward order (megatron-core's 1F1B and
  interleaved schedules);
* :func:`lockstep_order` — the per-rank order of a round-based timetable, in which every
  micro-batch advances one stage per round (the bidirectional schedules);
* :func:`with_eager_syncs` — each chunk's ``SYNC`` right after the chunk's last backward
  (or weight-gradient action of a split backward),
  which is where its gradient all-reduce can start.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .actions import Action, ActionType, SchedulePlan, make_plan
from .errors import PP_FLAG
from .placement import Placement

ChunkMicrobatch = Tuple[int, int]


def one_f_one_b(
    forwards: Sequence[ChunkMicrobatch], backwards: Sequence[ChunkMicrobatch], warmup: int
) -> List[Action]:
    """``warmup`` forwards, then alternate forward/backward, then the remaining backwards.

    Args:
        forwards: (chunk, micro-batch) in the order the rank runs forwards.
        backwards: (chunk, micro-batch) in the order the rank runs backwards; empty for a
            forward-only plan.
        warmup: forwards before the first backward, clipped to ``[0, len(forwards)]``.
    """
    warmup = max(0, min(warmup, len(forwards)))
    actions = [Action(ActionType.FORWARD, c, m) for c, m in forwards[:warmup]]
    steady = forwards[warmup:]
    for i, (c, m) in enumerate(steady):
        actions.append(Action(ActionType.FORWARD, c, m))
        if i < len(backwards):
            actions.append(Action(ActionType.BACKWARD, *backwards[i]))
    actions.extend(Action(ActionType.BACKWARD, c, m) for c, m in backwards[len(steady):])
    return actions


def with_eager_syncs(actions: Sequence[Action]) -> List[Action]:
    """Insert ``SYNC(c)`` directly after the last backward (``B`` or ``W``) of each chunk ``c``
    (the action holding it: an overlapped pair whose backward half it is)."""
    last_backward = {p.chunk: i for i, a in enumerate(actions) for p in a.parts if p.type.ends_backward}
    out: List[Action] = []
    for i, action in enumerate(actions):
        out.append(action)
        out.extend(Action(ActionType.SYNC, p.chunk) for p in action.parts
                   if p.type.ends_backward and last_backward[p.chunk] == i)
    return out


def bidirectional_injection_rounds(num_ranks: int, per_direction: int, chunks_per_rank: int) -> List[int]:
    """Rounds in which the micro-batches of one direction enter a bidirectional schedule.

    Micro-batches come in groups of ``D / 2``; the members of a group enter two rounds
    apart and a new group starts every ``chunks_per_rank * D / 2`` rounds, which is the
    number of forwards each rank runs per group. Both directions use the same rounds.
    """
    group = num_ranks // 2
    period = chunks_per_rank * group
    return [period * (i // group) + 2 * (i % group) for i in range(per_direction)]


def lockstep_order(
    placement: Placement,
    microbatch_pipeline: Sequence[int],
    entry_round: Sequence[int],
    forward_only: bool = False,
) -> List[List[Action]]:
    """Per-rank action lists of a round-based (lock-step) timetable.

    Micro-batch ``m`` enters its pipeline in round ``entry_round[m]``; its forward of
    stage ``s`` belongs to round ``entry_round[m] + s`` and its backward of stage ``s`` to
    round ``entry_round[m] + 2 S - 2 - s`` (``S`` stages per pipeline), so the loss stage
    runs forward and backward in the same round. Every rank runs its actions in round
    order, forward before backward within a round. The timetable only fixes the order:
    ranks do not wait for round boundaries.
    """
    last = 2 * placement.num_stages - 2
    timed: List[List[Tuple[int, int, Action]]] = [[] for _ in range(placement.num_ranks)]
    for pipeline, locations in enumerate(placement.stages):
        for stage, loc in enumerate(locations):
            for m, p in enumerate(microbatch_pipeline):
                if p != pipeline:
                    continue
                timed[loc.rank].append((entry_round[m] + stage, 0, Action(ActionType.FORWARD, loc.chunk, m)))
                if not forward_only:
                    timed[loc.rank].append((entry_round[m] + last - stage, 1, Action(ActionType.BACKWARD, loc.chunk, m)))
    return [[action for _, _, action in sorted(events, key=lambda e: e[:2])] for events in timed]


def bidirectional_problems(schedule: str, num_ranks: int, num_microbatches: Optional[int], source: str) -> List[str]:
    """Rules of the two-replica schedules, one message per broken rule (``source`` names where
    the number of micro-batches comes from, e.g. ``--num-microbatches``)."""
    if num_ranks < 2 or num_ranks % 2:
        return [f"{PP_FLAG} must be even and >= 2 for {schedule} (got {num_ranks})"]
    problems = []
    if num_microbatches is not None:
        if num_microbatches % 2:
            problems.append(
                f"{source} = {num_microbatches}: {schedule} splits the micro-batches between two pipelines "
                "and needs an even number of micro-batches"
            )
        if num_microbatches < num_ranks:
            problems.append(f"{source} = {num_microbatches}: {schedule} needs at least {PP_FLAG}={num_ranks} micro-batches")
    return problems


def smallest_bidirectional_microbatches(num_ranks: int) -> int:
    """The smallest N a two-replica schedule accepts: even and at least ``D``."""
    return num_ranks + num_ranks % 2


def bidirectional_plan(name: str, placement: Placement, num_microbatches: int, forward_only: bool) -> SchedulePlan:
    """Plan for a two-replica placement: the first half of the micro-batches takes pipeline 0,
    the second half pipeline 1, both entering in :func:`bidirectional_injection_rounds`."""
    per_direction = num_microbatches // 2
    rounds = bidirectional_injection_rounds(placement.num_ranks, per_direction, placement.chunks_per_rank)
    microbatch_pipeline = [0] * per_direction + [1] * per_direction
    entry_round = rounds + rounds
    actions = lockstep_order(placement, microbatch_pipeline, entry_round, forward_only)
    if not forward_only:
        actions = [with_eager_syncs(a) for a in actions]
    return make_plan(name, placement, num_microbatches, microbatch_pipeline, actions)
