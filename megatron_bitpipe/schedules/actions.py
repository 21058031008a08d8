"""The action vocabulary of a pipeline schedule and the plan that holds it.

A *plan* is pure data: for every pipeline rank, the ordered list of actions that rank
executes in one training step. Communication is not written in a plan; it follows from
the plan's :class:`~megatron_bitpipe.schedules.placement.Placement` (which rank and
local chunk hold each stage), see :mod:`megatron_bitpipe.schedules.comm`.

Invariants of a valid plan (checked by :func:`megatron_bitpipe.schedules.validate.validate_plan`):

* every rank runs exactly one ``F`` for each (chunk, micro-batch) pair that its chunks
  own and, in a training plan, either one ``B`` after it or a split backward: one ``I``
  after the ``F`` and one ``W`` after the ``I``;
* ``SYNC(chunk)`` appears once per chunk, after that chunk's last ``B`` or ``W``;
* a micro-batch runs on exactly one pipeline (``microbatch_pipeline``), so a chunk only
  sees the micro-batches of the pipeline it belongs to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

from .placement import Placement


class ActionType(str, enum.Enum):
    """What a rank does in one action.

    ``BACKWARD`` is the full backward (input and weight gradients). A *split* backward
    (zero-bubble style) runs the same work as two actions: ``BACKWARD_INPUT`` computes
    the input gradient — the part the previous stage waits for — and ``BACKWARD_WEIGHT``,
    later, the weight gradients of the same (chunk, micro-batch).
    """

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  #: input gradient only (sent upstream like ``B``'s)
    BACKWARD_WEIGHT = "W"  #: the deferred weight gradients of an earlier ``I``
    SYNC = "S"  #: start the asynchronous gradient all-reduce of one chunk

    @property
    def computes_input_grad(self) -> bool:
        """True for the actions that produce the gradient sent to the previous stage."""
        return self in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)

    @property
    def ends_backward(self) -> bool:
        """True for the actions after which a (chunk, micro-batch)'s gradients are complete."""
        return self in (ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT)

    def __str__(self) -> str:
        return self.value


F = ActionType.FORWARD
B = ActionType.BACKWARD
I = ActionType.BACKWARD_INPUT
W = ActionType.BACKWARD_WEIGHT
SYNC = ActionType.SYNC


@dataclass(frozen=True)
class Action:
    """One step of a rank's plan.

    Attributes:
        type: forward, backward (whole, or its input / weight part) or gradient sync.
        chunk: local model-chunk index on the rank (0-based).
        microbatch: global micro-batch index in ``[0, N)``; ``None`` for ``SYNC``.
    """

    type: ActionType
    chunk: int
    microbatch: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.type is SYNC) != (self.microbatch is None):
            raise ValueError(f"{self.type} action needs microbatch={'None' if self.type is SYNC else 'an int'}")

    @property
    def comm_key(self) -> "Action":
        """The action as its neighbouring stages see it: an ``I`` receives and sends what
        the whole ``B`` would, so both have the key ``B(chunk, micro-batch)``."""
        if self.type is ActionType.BACKWARD_INPUT:
            return Action(ActionType.BACKWARD, self.chunk, self.microbatch)
        return self

    def __str__(self) -> str:
        if self.type is SYNC:
            return f"S{self.chunk}"
        return f"{self.type}{self.chunk}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"F1.3"`` → F(chunk 1, micro-batch 3), ``"W0.2"``, ``"S2"`` → SYNC(2)."""
        kind, rest = ActionType(text[0]), text[1:]
        if kind is SYNC:
            return cls(kind, int(rest))
        chunk, microbatch = rest.split(".")
        return cls(kind, int(chunk), int(microbatch))


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

    def __iter__(self) -> Iterator[Tuple[int, Action]]:
        for rank, actions in enumerate(self.actions):
            for action in actions:
                yield rank, action

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
