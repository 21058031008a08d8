"""Communication implied by a plan: which tensor each action receives and sends.

Nothing here is written per schedule. A forward of stage ``s`` receives the activation
of stage ``s-1`` and sends its output to stage ``s+1``; a backward receives the gradient
from stage ``s+1`` and sends the input gradient to stage ``s-1``. Where the neighbouring
stage lives on the same rank (the turn of a V) the hand-over is local and no message is
sent. In a split backward the input-gradient action ``I`` communicates exactly as ``B``
does and the weight-gradient action ``W`` not at all; transfers name their producer and
consumer by :attr:`~.actions.Action.comm_key` (``B`` for both forms).

Messages travel on *channels*. A channel is identified by (payload, pipeline, source
rank, destination rank); within a channel messages must be received in the order they
are sent (this is what NCCL and gloo give within one process group between one pair of
ranks). The runtime uses one process group per (payload, pipeline, direction) so that no
two channels between the same pair of ranks share a group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

from .actions import Action, ActionType
from .placement import Placement, StageLocation


class Payload(str, enum.Enum):
    ACTIVATION = "activation"
    GRADIENT = "gradient"


@dataclass(frozen=True)
class Transfer:
    """One tensor handed from a producing action to a consuming action.

    Attributes:
        payload: activation (forward) or gradient (backward).
        pipeline: the pipeline (replica) of the micro-batch.
        microbatch: global micro-batch index.
        src: slot of the producing action.
        dst: slot of the consuming action.
    """

    payload: Payload
    pipeline: int
    microbatch: int
    src: StageLocation
    dst: StageLocation

    @property
    def is_local(self) -> bool:
        """True for the V-turn hand-over between two chunks of one rank."""
        return self.src.rank == self.dst.rank

    @property
    def channel(self) -> Tuple[Payload, int, int, int]:
        """(payload, pipeline, src rank, dst rank): the FIFO stream the message travels on."""
        return (self.payload, self.pipeline, self.src.rank, self.dst.rank)

    @property
    def direction(self) -> int:
        """+1 towards higher ranks, -1 towards lower ranks (0 for local hand-overs)."""
        return (self.dst.rank > self.src.rank) - (self.dst.rank < self.src.rank)

    @property
    def producer(self) -> Action:
        """The producing action's :attr:`~.actions.Action.comm_key`."""
        kind = ActionType.FORWARD if self.payload is Payload.ACTIVATION else ActionType.BACKWARD
        return Action(kind, self.src.chunk, self.microbatch)

    @property
    def consumer(self) -> Action:
        """The consuming action's :attr:`~.actions.Action.comm_key`."""
        kind = ActionType.FORWARD if self.payload is Payload.ACTIVATION else ActionType.BACKWARD
        return Action(kind, self.dst.chunk, self.microbatch)


def _neighbour(placement: Placement, rank: int, chunk: int, step: int) -> Optional[Tuple[int, StageLocation]]:
    role = placement.role(rank, chunk)
    stage = role.stage + step
    if not 0 <= stage < placement.num_stages:
        return None
    return role.pipeline, placement.location(role.pipeline, stage)


def received_by(placement: Placement, rank: int, action: Action) -> Optional[Transfer]:
    """The transfer ``action`` on ``rank`` consumes, or None (first-stage F, last-stage B, W, SYNC)."""
    if action.type in (ActionType.SYNC, ActionType.BACKWARD_WEIGHT):
        return None
    forward = action.type is ActionType.FORWARD
    found = _neighbour(placement, rank, action.chunk, -1 if forward else +1)
    if found is None:
        return None
    pipeline, src = found
    payload = Payload.ACTIVATION if forward else Payload.GRADIENT
    return Transfer(payload, pipeline, action.microbatch, src, StageLocation(rank, action.chunk))


def sent_by(placement: Placement, rank: int, action: Action) -> Optional[Transfer]:
    """The transfer ``action`` on ``rank`` produces, or None (last-stage F, first-stage B, W, SYNC)."""
    if action.type in (ActionType.SYNC, ActionType.BACKWARD_WEIGHT):
        return None
    forward = action.type is ActionType.FORWARD
    found = _neighbour(placement, rank, action.chunk, +1 if forward else -1)
    if found is None:
        return None
    pipeline, dst = found
    payload = Payload.ACTIVATION if forward else Payload.GRADIENT
    return Transfer(payload, pipeline, action.microbatch, StageLocation(rank, action.chunk), dst)
