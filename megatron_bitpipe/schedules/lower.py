"""Lowering: write a plan's communication into it as ``SEND`` and ``RECV`` actions.

Generators write compute actions only; which tensors cross ranks follows from the
placement (:mod:`.comm`). :func:`lower` turns every such message into two actions, so that
the validator checks, the simulator times and the runtime executes exactly what the plan
says:

* ``SEND_F(c, m)`` / ``SEND_B(c, m)`` on the producing rank, directly after its producer
  (``F(c, m)``, or ``B(c, m)`` / ``I(c, m)``). Sends are asynchronous: the rank goes on at
  once, and the message arrives one message time after it is issued;
* ``RECV_F(c, m)`` / ``RECV_B(c, m)`` on the consuming rank, before its consumer. A
  ``RECV`` posts the receive and costs nothing; the consumer waits for the message.

Where a receive is posted is the *receive-posting policy*, ``receive_lookahead``:

* ``0`` (the default): directly before its consumer, after the previous action and that
  action's sends. This is the moment the previous action has been issued, so on a GPU the
  receive is in flight while the previous action's kernels run — what megatron-core's
  ``overlap_p2p_comm`` does;
* ``k > 0``: before the ``k``-th action (compute or ``SYNC``) preceding the consumer, or at
  the start of the rank's list; several receives posted at one place keep their
  consumers' order.

Posting earlier never changes when a message arrives (a receive costs nothing and a
message is delivered whether or not its receive is posted yet), only how long the
receive buffer lives. Receives of one channel are always posted in their consumers'
order, so the validator's FIFO check sees the generator's order.

An overlapped pair ``OVERLAP_F_B`` (forward and backward halves) is one consumer and one
producer: its forward half's receive and then its backward half's are posted before it (the
same place for both), and after it the forward half's send, then the backward half's — the
order DualPipe issues them in (both inputs received, both halves computed, both outputs sent).

V-turn hand-overs between two chunks of one rank stay implicit: they move no message.
The compute actions keep their order: ``lower(plan).compute_only() == plan.compute_only()``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Dict, List, Optional

from .actions import Action, SchedulePlan
from .comm import receive_action, send_action

__all__ = ["lower"]


def lower(plan: SchedulePlan, receive_lookahead: int = 0) -> SchedulePlan:
    """``plan`` with a ``SEND`` and a ``RECV`` action for every message between ranks.

    Communication actions already in ``plan`` are replaced, so lowering a lowered plan
    with another ``receive_lookahead`` re-places its receives. Raises ValueError for a
    negative ``receive_lookahead``.
    """
    if receive_lookahead < 0:
        raise ValueError(f"--receive-lookahead must be >= 0 (got {receive_lookahead})")
    compute = plan.compute_only()
    return replace(
        compute,
        actions=tuple(_lower_rank(compute, rank, receive_lookahead) for rank in range(compute.num_ranks)),
    )


def _lower_rank(plan: SchedulePlan, rank: int, receive_lookahead: int) -> tuple:
    placement = plan.placement
    actions = plan.actions[rank]
    # Which RECV / SEND type (or none) an action gets depends on its type and chunk alone.
    receive_types: Dict[tuple, object] = {}
    send_types: Dict[tuple, object] = {}

    def message(found: Dict[tuple, object], make, part: Action) -> Optional[Action]:
        key = (part.type, part.chunk)
        if key not in found:
            template = make(placement, rank, part)
            found[key] = None if template is None else template.type
        kind = found[key]
        return None if kind is None else Action(kind, part.chunk, part.microbatch)

    receives_before: Dict[int, List[Action]] = defaultdict(list)
    for index, action in enumerate(actions):
        for part in action.parts:
            receive = message(receive_types, receive_action, part)
            if receive is not None:
                receives_before[max(0, index - receive_lookahead)].append(receive)
    lowered: List[Action] = []
    for index, action in enumerate(actions):
        lowered.extend(receives_before[index])
        lowered.append(action)
        for part in action.parts:
            send = message(send_types, send_action, part)
            if send is not None:
                lowered.append(send)
    return tuple(lowered)
