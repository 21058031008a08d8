"""Communication implied by a plan: which tensor each action receives and sends.

This is the data flow that the lowering pass (:mod:`.lower`) writes into a plan as ``SEND``
and ``RECV`` actions, and that the validator, the simulator and the runtime resolve those
actions with (:func:`transfer_of`). Nothing here is written per schedule. A forward of
stage ``s`` receives the activation of stage ``s-1`` and sends its output to stage ``s+1``;
a backward receives the gradient from stage ``s+1`` and sends the input gradient to stage
``s-1``. Where the neighbouring stage lives on the same rank (the turn of a V) the hand-over
is local and no message is sent. In a split backward the input-gradient action ``I``
communicates exactly as ``B`` does and the weight-gradient action ``W`` not at all;
transfers name their producer and consumer by :attr:`~.actions.Action.comm_key` (``B`` for
both forms).

Messages travel on *channels*. A channel is identified by (payload, pipeline, source
rank, destination rank); within a channel messages must be received in the order they
are sent (this is what NCCL and gloo give within one process group between one pair of
ranks). The runtime sends each channel on the process group :func:`channel_group_key` names
— one per (payload, pipeline, direction, parity of the link's lower rank) — so no two
channels share a group between the same pair of ranks, and within one group a rank only
sends to one neighbour or only receives from one (the NCCL model, :mod:`.nccl`, checks a plan
against exactly this mapping).
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

    def _action(self, on_activation: ActionType, on_gradient: ActionType, end: StageLocation) -> Action:
        """The action of this message's kind (``on_activation`` or ``on_gradient``) on ``end``'s chunk."""
        kind = on_activation if self.payload is Payload.ACTIVATION else on_gradient
        return Action(kind, end.chunk, self.microbatch)

    @property
    def send(self) -> Action:
        """The ``SEND_F`` / ``SEND_B`` action that sends this message, on rank ``src.rank``."""
        return self._action(ActionType.SEND_ACTIVATION, ActionType.SEND_GRADIENT, self.src)

    @property
    def receive(self) -> Action:
        """The ``RECV_F`` / ``RECV_B`` action that posts this message's receive, on rank ``dst.rank``."""
        return self._action(ActionType.RECV_ACTIVATION, ActionType.RECV_GRADIENT, self.dst)

    @property
    def producer(self) -> Action:
        """The producing action's :attr:`~.actions.Action.comm_key`."""
        return self._action(ActionType.FORWARD, ActionType.BACKWARD, self.src)

    @property
    def consumer(self) -> Action:
        """The consuming action's :attr:`~.actions.Action.comm_key`."""
        return self._action(ActionType.FORWARD, ActionType.BACKWARD, self.dst)


ChannelGroupKey = Tuple[Payload, int, int, int]


def channel_group_key(transfer: Transfer) -> ChannelGroupKey:
    """(payload, pipeline, direction, parity of the link's lower rank): the process group the
    runtime sends ``transfer`` on. Links ``r -> r+1`` and ``r+1 -> r+2`` differ in parity, so
    in one group a rank talks to at most one peer, in one direction."""
    return (transfer.payload, transfer.pipeline, transfer.direction, min(transfer.src.rank, transfer.dst.rank) % 2)


def _neighbour(placement: Placement, rank: int, chunk: int, step: int) -> Optional[Tuple[int, StageLocation]]:
    links = placement.links(rank, chunk)
    location = links.previous if step < 0 else links.next
    return None if location is None else (links.pipeline, location)


def received_by(placement: Placement, rank: int, action: Action) -> Optional[Transfer]:
    """The transfer ``action`` on ``rank`` consumes, or None (first-stage F, last-stage B, W, SYNC,
    communication actions)."""
    if not action.type.moves_data:
        return None
    forward = action.type is ActionType.FORWARD
    found = _neighbour(placement, rank, action.chunk, -1 if forward else +1)
    if found is None:
        return None
    pipeline, src = found
    payload = Payload.ACTIVATION if forward else Payload.GRADIENT
    return Transfer(payload, pipeline, action.microbatch, src, StageLocation(rank, action.chunk))


def sent_by(placement: Placement, rank: int, action: Action) -> Optional[Transfer]:
    """The transfer ``action`` on ``rank`` produces, or None (last-stage F, first-stage B, W, SYNC,
    communication actions)."""
    if not action.type.moves_data:
        return None
    forward = action.type is ActionType.FORWARD
    found = _neighbour(placement, rank, action.chunk, +1 if forward else -1)
    if found is None:
        return None
    pipeline, dst = found
    payload = Payload.ACTIVATION if forward else Payload.GRADIENT
    return Transfer(payload, pipeline, action.microbatch, StageLocation(rank, action.chunk), dst)


def receive_action(placement: Placement, rank: int, action: Action) -> Optional[Action]:
    """The ``RECV_F`` / ``RECV_B`` that posts the receive of ``action``'s input, or None if the
    input comes from no other rank (a first stage's data, the loss, a local hand-over, ``W``)."""
    if not action.type.moves_data:
        return None
    links = placement.links(rank, action.chunk)
    forward = action.type is ActionType.FORWARD
    source = links.previous if forward else links.next
    if source is None or source.rank == rank:
        return None
    return Action(ActionType.RECV_ACTIVATION if forward else ActionType.RECV_GRADIENT, action.chunk, action.microbatch)


def send_action(placement: Placement, rank: int, action: Action) -> Optional[Action]:
    """The ``SEND_F`` / ``SEND_B`` that sends ``action``'s output, or None if it goes to no
    other rank (the loss stage, a first stage's input gradient, a local hand-over, ``W``)."""
    if not action.type.moves_data:
        return None
    links = placement.links(rank, action.chunk)
    forward = action.type is ActionType.FORWARD
    target = links.next if forward else links.previous
    if target is None or target.rank == rank:
        return None
    return Action(ActionType.SEND_ACTIVATION if forward else ActionType.SEND_GRADIENT, action.chunk, action.microbatch)


def transfer_of(placement: Placement, rank: int, action: Action) -> Transfer:
    """The message a communication action on ``rank`` sends or receives.

    ``SEND_F(c, m)`` sends what ``F(c, m)`` produces, ``RECV_F(c, m)`` receives what it
    consumes, and ``SEND_B`` / ``RECV_B`` likewise for ``B(c, m)`` or ``I(c, m)``. Raises
    ValueError for an action that is not a communication action or has no message to move
    (a first or last stage's end, or a local hand-over).
    """
    if not action.type.is_communication:
        raise ValueError(f"{action} is not a communication action")
    find = sent_by if action.type.is_send else received_by
    transfer = find(placement, rank, action.compute_key)
    if transfer is None or transfer.is_local:
        why = "the hand-over is local" if transfer is not None else "it is a pipeline's end"
        raise ValueError(f"rank {rank}: {action} has no message to move ({why})")
    return transfer
