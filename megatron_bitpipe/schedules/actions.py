"""The action vocabulary of a pipeline schedule and the plan that holds it.

A *plan* is pure data: for every pipeline rank, the ordered list of actions that rank
executes in one training step. *Compute* actions (``F``, ``B``, ``I``, ``W``, ``SYNC``, and
``OVERLAP_F_B``: a forward and a backward run as one overlapped pair) are what a generator
writes; which tensor each of them receives and sends follows from the plan's
:class:`~megatron_bitpipe.schedules.placement.Placement` (which rank and local chunk hold each
stage, see :mod:`megatron_bitpipe.schedules.comm`). *Communication*
actions (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) make that explicit: the lowering
pass (:mod:`megatron_bitpipe.schedules.lower`) writes one ``SEND`` on the producing rank
and one ``RECV`` on the consuming rank for every message between ranks, at the positions
where the runtime issues them. A plan without communication actions is *compute-only*;
:meth:`SchedulePlan.compute_only` gives that view of a lowered plan.

Invariants of a valid plan (checked by :func:`megatron_bitpipe.schedules.validate.validate_plan`):

* every rank runs exactly one ``F`` for each (chunk, micro-batch) pair that its chunks
  own and, in a training plan, either one ``B`` after it or a split backward: one ``I``
  after the ``F`` and one ``W`` after the ``I``;
* ``SYNC(chunk)`` appears once per chunk, after that chunk's last ``B`` or ``W``;
* an overlapped pair ``OVERLAP_F_B`` counts as its two *halves* (:attr:`Action.parts`), both
  at the pair's position: the rules above hold for the halves;
* a micro-batch runs on exactly one pipeline (``microbatch_pipeline``), so a chunk only
  sees the micro-batches of the pipeline it belongs to;
* in a lowered plan, every message between two ranks has one ``SEND`` after its producer
  and one ``RECV`` before its consumer, and each channel's receives are posted in the
  order of its sends.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence, Tuple

from .placement import Placement


class ActionType(str, enum.Enum):
    """What a rank does in one action.

    ``BACKWARD`` is the full backward (input and weight gradients). A *split* backward
    (zero-bubble style) runs the same work as two actions: ``BACKWARD_INPUT`` computes
    the input gradient — the part the previous stage waits for — and ``BACKWARD_WEIGHT``,
    later, the weight gradients of the same (chunk, micro-batch).

    The four communication types name the (chunk, micro-batch) of the compute action on
    the same rank whose tensor they move: ``SEND_F(c, m)`` sends the output of ``F(c, m)``
    to the next stage's rank, ``RECV_F(c, m)`` posts the receive of ``F(c, m)``'s input,
    ``SEND_B(c, m)`` sends the input gradient of ``B(c, m)`` (or ``I(c, m)``) to the
    previous stage's rank and ``RECV_B(c, m)`` posts the receive of its output gradient.
    A ``RECV`` only posts the receive; the compute action that consumes it waits for it.

    ``OVERLAP_F_B`` (torch.distributed.pipelining's name) is one action made of a forward and
    a backward (``B`` or ``I``) of other (chunk, micro-batch) pairs, run together as
    DualPipe's overlapped forward/backward chunks: both inputs are received first, then both
    halves compute, then both outputs are sent (see :func:`overlapped`). None of the
    properties below is true for it; its halves (:attr:`Action.parts`) carry them.
    """

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  #: input gradient only (sent upstream like ``B``'s)
    BACKWARD_WEIGHT = "W"  #: the deferred weight gradients of an earlier ``I``
    SYNC = "S"  #: start the asynchronous gradient all-reduce of one chunk
    SEND_ACTIVATION = "SEND_F"  #: send a forward's output to the next stage's rank
    RECV_ACTIVATION = "RECV_F"  #: post the receive of a forward's input
    SEND_GRADIENT = "SEND_B"  #: send a backward's input gradient to the previous stage's rank
    RECV_GRADIENT = "RECV_B"  #: post the receive of a backward's output gradient
    OVERLAP_F_B = "OVERLAP_F_B"  #: a forward and a backward run as one overlapped pair

    @property
    def computes_input_grad(self) -> bool:
        """True for the actions that produce the gradient sent to the previous stage."""
        return self in _COMPUTES_INPUT_GRAD

    @property
    def ends_backward(self) -> bool:
        """True for the actions after which a (chunk, micro-batch)'s gradients are complete."""
        return self in _ENDS_BACKWARD

    @property
    def moves_data(self) -> bool:
        """True for the compute actions that receive and send a tensor along the pipeline:
        ``F``, ``B`` and ``I``."""
        return self in _MOVES_DATA

    @property
    def is_communication(self) -> bool:
        """True for ``SEND_F``, ``RECV_F``, ``SEND_B`` and ``RECV_B``."""
        return self in _COMMUNICATION

    @property
    def is_send(self) -> bool:
        """True for ``SEND_F`` and ``SEND_B``."""
        return self in _SEND

    @property
    def is_receive(self) -> bool:
        """True for ``RECV_F`` and ``RECV_B`` (which post a receive)."""
        return self in _RECEIVE

    def __str__(self) -> str:
        return self.value


_COMPUTES_INPUT_GRAD = frozenset((ActionType.BACKWARD, ActionType.BACKWARD_INPUT))
_ENDS_BACKWARD = frozenset((ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT))
_MOVES_DATA = frozenset((ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT))
_SEND = frozenset((ActionType.SEND_ACTIVATION, ActionType.SEND_GRADIENT))
_RECEIVE = frozenset((ActionType.RECV_ACTIVATION, ActionType.RECV_GRADIENT))
_COMMUNICATION = _SEND | _RECEIVE
#: The compute action type a communication type belongs to (``B`` stands for ``I`` too).
_COMPUTE_OF = {
    ActionType.SEND_ACTIVATION: ActionType.FORWARD,
    ActionType.RECV_ACTIVATION: ActionType.FORWARD,
    ActionType.SEND_GRADIENT: ActionType.BACKWARD,
    ActionType.RECV_GRADIENT: ActionType.BACKWARD,
}
_TEXT = re.compile(r"^([A-Z_]+?)(\d+)(?:\.(\d+))?$")
_PAIR_SEPARATOR = "&"  #: ``F0.3&B1.1``: the forward and backward halves of an overlapped pair

F = ActionType.FORWARD
B = ActionType.BACKWARD
I = ActionType.BACKWARD_INPUT
W = ActionType.BACKWARD_WEIGHT
SYNC = ActionType.SYNC


@dataclass(frozen=True)
class Action:
    """One step of a rank's plan.

    Attributes:
        type: forward, backward (whole, or its input / weight part), gradient sync, or a
            send / receive of a forward's or backward's tensor.
        chunk: local model-chunk index on the rank (0-based).
        microbatch: global micro-batch index in ``[0, N)``; ``None`` for ``SYNC``.
        backward: ``OVERLAP_F_B`` only: the backward half (``B`` or ``I``); ``chunk`` and
            ``microbatch`` are then the forward half's. Build pairs with :func:`overlapped`.
    """

    type: ActionType
    chunk: int
    microbatch: Optional[int] = None
    backward: Optional["Action"] = None

    def __post_init__(self) -> None:
        if (self.type is SYNC) != (self.microbatch is None):
            raise ValueError(f"{self.type} action needs microbatch={'None' if self.type is SYNC else 'an int'}")
        pair = self.type is ActionType.OVERLAP_F_B
        if pair != (self.backward is not None):
            raise ValueError(f"{self.type} action {'needs' if pair else 'takes no'} backward half")
        if pair and not self.backward.type.computes_input_grad:
            raise ValueError(f"the backward half of an overlapped pair must be B or I, not {self.backward.type}")

    @property
    def parts(self) -> Tuple["Action", ...]:
        """The actions this one runs: ``(forward, backward)`` halves of an ``OVERLAP_F_B``,
        else ``(self,)``."""
        if self.backward is None:
            return (self,)
        return (Action(ActionType.FORWARD, self.chunk, self.microbatch), self.backward)

    @property
    def comm_key(self) -> "Action":
        """The action as its neighbouring stages see it: an ``I`` receives and sends what
        the whole ``B`` would, so both have the key ``B(chunk, micro-batch)``."""
        if self.type is ActionType.BACKWARD_INPUT:
            return Action(ActionType.BACKWARD, self.chunk, self.microbatch)
        return self

    @property
    def compute_key(self) -> "Action":
        """For a communication action, the :attr:`comm_key` of the compute action whose tensor it
        moves: ``SEND_F(c, m)`` and ``RECV_F(c, m)`` → ``F(c, m)``, ``SEND_B(c, m)`` and
        ``RECV_B(c, m)`` → ``B(c, m)`` (which stands for ``I(c, m)`` too)."""
        return Action(_COMPUTE_OF[self.type], self.chunk, self.microbatch)

    def __str__(self) -> str:
        if self.type is SYNC:
            return f"S{self.chunk}"
        if self.backward is not None:
            return _PAIR_SEPARATOR.join(str(part) for part in self.parts)
        return f"{self.type}{self.chunk}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"F1.3"`` → F(chunk 1, micro-batch 3), ``"W0.2"``, ``"S2"`` → SYNC(2),
        ``"RECV_B2.5"`` → RECV_B(chunk 2, micro-batch 5), ``"F0.3&B1.1"`` → the overlapped pair
        of F(0, 3) and B(1, 1). ValueError for other text."""
        if _PAIR_SEPARATOR in text:
            halves = text.split(_PAIR_SEPARATOR)
            if len(halves) != 2:
                raise ValueError(f"not an action: {text!r}")
            return overlapped(*(cls.parse(half) for half in halves))
        match = _TEXT.match(text)
        if match is None:
            raise ValueError(f"not an action: {text!r}")
        kind, chunk, microbatch = match.groups()
        return cls(ActionType(kind), int(chunk), None if microbatch is None else int(microbatch))


def overlapped(forward: Action, backward: Action) -> Action:
    """The ``OVERLAP_F_B`` action running ``forward`` (an ``F``) and ``backward`` (a ``B`` or
    ``I`` of another chunk or micro-batch) as one overlapped pair. ValueError otherwise."""
    if forward.type is not ActionType.FORWARD:
        raise ValueError(f"the forward half of an overlapped pair must be F, not {forward.type}")
    if (forward.chunk, forward.microbatch) == (backward.chunk, backward.microbatch):
        raise ValueError(f"{forward} and {backward} cannot overlap: a backward needs its own forward first")
    return Action(ActionType.OVERLAP_F_B, forward.chunk, forward.microbatch, backward)


@dataclass(frozen=True)
class SchedulePlan:
    """Per-rank ordered actions of one training step, plus where they run.

    Attributes:
        name: schedule name (``1f1b``, ``interleaved``, ``chimera``, ``bitpipe``; a split
            plan's adds ``+split-backward``).
        placement: stage → (rank, chunk) map of every pipeline.
        num_microbatches: N, micro-batches in the global batch of one step (per data
            parallel rank).
        microbatch_pipeline: ``microbatch_pipeline[m]`` is the pipeline (replica)
            that micro-batch ``m`` flows through.
        actions: ``actions[r]`` is rank ``r``'s ordered action list.
    """

    name: str
    placement: Placement
    num_microbatches: int
    microbatch_pipeline: Tuple[int, ...]
    actions: Tuple[Tuple[Action, ...], ...]

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def split_backward(self) -> bool:
        """Whether the backwards run split: input gradient ``I``, weight gradients ``W`` later."""
        return any(a.type is ActionType.BACKWARD_INPUT for _, a in self)

    def microbatches_of_pipeline(self, pipeline: int) -> Tuple[int, ...]:
        """Micro-batch indices routed through ``pipeline``, ascending."""
        return tuple(m for m, p in enumerate(self.microbatch_pipeline) if p == pipeline)

    def rank_actions(self, rank: int) -> Tuple[Action, ...]:
        return self.actions[rank]

    @property
    def has_communication(self) -> bool:
        """True if any rank's list holds a communication action (the plan was lowered)."""
        return any(a.type.is_communication for _, a in self)

    def compute_only(self) -> "SchedulePlan":
        """This plan without its communication actions: the order a generator writes."""
        return replace(self, actions=tuple(tuple(a for a in acts if not a.type.is_communication) for acts in self.actions))

    def __iter__(self) -> Iterator[Tuple[int, Action]]:
        """(rank, action) of every action, an overlapped pair as its two halves."""
        for rank, actions in enumerate(self.actions):
            for action in actions:
                for part in action.parts:
                    yield rank, part

    def format(self) -> str:
        """Human-readable table, one line per rank (``F0.1 F0.2 B0.1 …``)."""
        width = len(str(self.num_ranks - 1))
        return "\n".join(
            f"rank {r:>{width}}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)
        )


def make_plan(
    name: str,
    placement: Placement,
    num_microbatches: int,
    microbatch_pipeline: Sequence[int],
    actions: Sequence[Sequence[Action]],
) -> SchedulePlan:
    """Build a :class:`SchedulePlan` from lists (converted to tuples)."""
    return SchedulePlan(
        name=name,
        placement=placement,
        num_microbatches=num_microbatches,
        microbatch_pipeline=tuple(microbatch_pipeline),
        actions=tuple(tuple(a) for a in actions),
    )
