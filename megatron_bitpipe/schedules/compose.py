"""Building blocks shared by the schedule generators.

Most schedules are "warm-up forwards, then one-forward-one-backward, then cool-down
backwards" over a per-rank forward order and backward order; :func:`one_f_one_b`
builds that sequence. :func:`with_eager_syncs` places each chunk's ``SYNC`` right after
the chunk's last backward, which is where its gradient all-reduce can start.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from .actions import Action, ActionType

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
    """Insert ``SYNC(c)`` directly after the last backward of each chunk ``c``."""
    last_backward = {a.chunk: i for i, a in enumerate(actions) if a.type is ActionType.BACKWARD}
    out: List[Action] = []
    for i, action in enumerate(actions):
        out.append(action)
        if action.type is ActionType.BACKWARD and last_backward[action.chunk] == i:
            out.append(Action(ActionType.SYNC, action.chunk))
    return out
