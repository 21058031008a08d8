"""Where pipeline stages live: stage → (rank, local chunk), for one or more pipelines.

A *pipeline* is one path of a micro-batch through all ``num_stages`` stages of the
model. Schedules with two pipelines (Chimera, BitPipe) keep one weight replica per
pipeline: stage ``s`` of every pipeline holds the same layers, and the gradients of
those copies are summed (see :meth:`Placement.replicas`).

Invariants (checked by :class:`Placement`):

* every pipeline has the same number of stages;
* every (rank, chunk) slot holds exactly one (pipeline, stage);
* on every rank the chunk indices are exactly ``0 .. chunks_per_rank - 1``.

Units: a stage's *weight* is the fraction of one device's share of one model replica
(``L / D`` layers, ``D`` = number of ranks) that the stage holds; compute and activation
costs of a stage scale with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, Optional, Sequence, Tuple

from .errors import VP_FLAG


@dataclass(frozen=True, order=True)
class StageLocation:
    """A (rank, local chunk) slot."""

    rank: int
    chunk: int


@dataclass(frozen=True)
class ChunkRole:
    """What a (rank, chunk) slot holds: stage ``stage`` of pipeline ``pipeline``."""

    pipeline: int
    stage: int


@dataclass(frozen=True)
class ChunkLinks:
    """Where the stage held by a (rank, chunk) slot sits in its pipeline.

    Attributes:
        pipeline: the pipeline the slot belongs to.
        previous: slot of the previous stage (None for the first stage): a forward's input
            comes from there and a backward's input gradient goes there.
        next: slot of the next stage (None for the last stage): a forward's output goes
            there and a backward's output gradient comes from there.
    """

    pipeline: int
    previous: Optional[StageLocation]
    next: Optional[StageLocation]


@dataclass(frozen=True)
class Placement:
    """Stage locations of every pipeline.

    Attributes:
        name: short description (``looped``, ``v``, ``bidirectional``, ``bidirectional-v``).
        num_ranks: D, pipeline-parallel ranks.
        stages: ``stages[p][s]`` is the location of stage ``s`` of pipeline ``p``.
    """

    name: str
    num_ranks: int
    stages: Tuple[Tuple[StageLocation, ...], ...]

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"placement needs at least one rank, got {self.num_ranks}")
        if len({len(p) for p in self.stages}) != 1:
            raise ValueError("all pipelines of a placement must have the same number of stages")
        seen: Dict[StageLocation, Tuple[int, int]] = {}
        for p, pipeline in enumerate(self.stages):
            for s, loc in enumerate(pipeline):
                if not 0 <= loc.rank < self.num_ranks:
                    raise ValueError(f"stage {s} of pipeline {p} on rank {loc.rank} outside [0, {self.num_ranks})")
                if loc in seen:
                    raise ValueError(f"rank {loc.rank} chunk {loc.chunk} holds two stages: {seen[loc]} and {(p, s)}")
                seen[loc] = (p, s)
        for rank in range(self.num_ranks):
            chunks = sorted(loc.chunk for loc in seen if loc.rank == rank)
            if chunks != list(range(self.chunks_per_rank)):
                raise ValueError(f"rank {rank} has chunks {chunks}; expected 0..{self.chunks_per_rank - 1}")

    @property
    def num_pipelines(self) -> int:
        return len(self.stages)

    @property
    def num_stages(self) -> int:
        """Stages per pipeline (every pipeline is a full copy of the model)."""
        return len(self.stages[0])

    @property
    def chunks_per_rank(self) -> int:
        return self.num_pipelines * self.num_stages // self.num_ranks

    @property
    def stage_weight(self) -> float:
        """Layers of one stage as a fraction of ``L / D`` (one device's share of a replica)."""
        return self.num_ranks / self.num_stages

    @cached_property
    def _roles(self) -> Dict[StageLocation, ChunkRole]:
        return {loc: ChunkRole(p, s) for p, pipe in enumerate(self.stages) for s, loc in enumerate(pipe)}

    def role(self, rank: int, chunk: int) -> ChunkRole:
        """The (pipeline, stage) held by ``chunk`` on ``rank``."""
        try:
            return self._roles[StageLocation(rank, chunk)]
        except KeyError:
            raise ValueError(f"rank {rank} has no chunk {chunk} (chunks per rank: {self.chunks_per_rank})") from None

    @cached_property
    def _links(self) -> Dict[Tuple[int, int], ChunkLinks]:
        links = {}
        for p, pipe in enumerate(self.stages):
            for s, loc in enumerate(pipe):
                before = pipe[s - 1] if s > 0 else None
                after = pipe[s + 1] if s + 1 < len(pipe) else None
                links[(loc.rank, loc.chunk)] = ChunkLinks(p, before, after)
        return links

    def links(self, rank: int, chunk: int) -> ChunkLinks:
        """The pipeline and neighbouring stages' slots of ``chunk`` on ``rank``."""
        try:
            return self._links[(rank, chunk)]
        except KeyError:
            raise ValueError(f"rank {rank} has no chunk {chunk} (chunks per rank: {self.chunks_per_rank})") from None

    def location(self, pipeline: int, stage: int) -> StageLocation:
        return self.stages[pipeline][stage]

    def replicas(self, stage: int) -> Tuple[StageLocation, ...]:
        """Locations of stage ``stage`` in every pipeline: the slots whose gradients are summed."""
        return tuple(pipe[stage] for pipe in self.stages)

    def mirror_slots(self, rank: int, chunk: int) -> Tuple[StageLocation, ...]:
        """All slots holding the same layers as (rank, chunk), itself included."""
        return self.replicas(self.role(rank, chunk).stage)

    def layer_problem(self, num_layers: int, virtual_size_flag: str = VP_FLAG) -> Optional[str]:
        """Why ``num_layers`` cannot be cut into this placement's equal stages, or None.

        The message names the flags the stage count comes from (``--num-layers`` must be a
        positive multiple of the stages of one pipeline); ``virtual_size_flag`` is the flag
        that sets the virtual pipeline size on the caller's command line.
        """
        stages = self.num_stages
        if num_layers > 0 and num_layers % stages == 0:
            return None
        return (
            f"--num-layers {num_layers} must be divisible by {self.stage_count_flags(virtual_size_flag)} = {stages} "
            f"(the {self.name} placement runs {stages} stages of equal size)"
        )

    def stage_count_flags(self, virtual_size_flag: str = VP_FLAG) -> str:
        """The flags the stages of one pipeline are counted from, as a product
        (``2 x --pipeline-model-parallel-size``); ``virtual_size_flag`` as in :meth:`layer_problem`."""
        per_rank = self.num_stages // self.num_ranks
        if per_rank == 1:
            return "--pipeline-model-parallel-size"
        if self.name == "looped":
            return f"--pipeline-model-parallel-size x {virtual_size_flag}"
        return f"{per_rank} x --pipeline-model-parallel-size"

    @property
    def head_copies_embedding(self) -> bool:
        """Whether tied embeddings use megatron's own tying: a copy of the word embeddings as
        the head's ``output_layer.weight``, kept equal by all-reducing the two copies'
        gradients over megatron's embedding group.

        True for a single pipeline whose first and last stage sit on different ranks (the
        looped placement with more than one rank). Placements whose pipelines start and end
        on the same rank tie one Parameter instead (:mod:`megatron_bitpipe.model.chunks`);
        several pipelines with ends on different ranks (Chimera) are not supported with tied
        embeddings.
        """
        if self.num_pipelines != 1:
            return False
        return self.location(0, 0).rank != self.location(0, self.num_stages - 1).rank

    @property
    def ties_embeddings(self) -> bool:
        """Whether a model with tied input and output embeddings fits: one pipeline (megatron's
        own tying, :attr:`head_copies_embedding`, where its ends are apart), or several whose
        every pipeline starts and ends on one rank (one shared Parameter)."""
        return self.num_pipelines == 1 or all(
            self.location(p, 0).rank == self.location(p, self.num_stages - 1).rank for p in range(self.num_pipelines)
        )


def _placement(name: str, num_ranks: int, pipelines: Sequence[Sequence[Tuple[int, int]]]) -> Placement:
    return Placement(name, num_ranks, tuple(tuple(StageLocation(r, c) for r, c in p) for p in pipelines))


def looped(num_ranks: int, chunks_per_rank: int = 1) -> Placement:
    """Megatron's (interleaved) order: stage ``s`` on rank ``s % D``, chunk ``s // D``.

    ``chunks_per_rank=1`` is the plain 1F1B placement.
    """
    stages = [(s % num_ranks, s // num_ranks) for s in range(num_ranks * chunks_per_rank)]
    return _placement("looped", num_ranks, [stages])


def v_shape(num_ranks: int) -> Placement:
    """One pipeline of ``2D`` stages going down the ranks and back up (ZB-V, DualPipeV)."""
    down = [(s, 0) for s in range(num_ranks)]
    back = [(num_ranks - 1 - s, 1) for s in range(num_ranks)]
    return _placement("v", num_ranks, [down + back])


def bidirectional(num_ranks: int) -> Placement:
    """Chimera: two replicas of ``D`` stages, one entering at rank 0, one at rank ``D-1``.

    Chunk 0 of rank ``d`` is stage ``d`` of the down pipeline, chunk 1 is stage
    ``D-1-d`` of the up pipeline.
    """
    down = [(s, 0) for s in range(num_ranks)]
    up = [(num_ranks - 1 - s, 1) for s in range(num_ranks)]
    return _placement("bidirectional", num_ranks, [down, up])


def bidirectional_v(num_ranks: int) -> Placement:
    """BitPipe: two V-shaped replicas of ``2D`` stages, four chunks per rank.

    With 0-based stages, rank ``d`` holds

    ======  ===========  ==============  ======================
    chunk   pipeline     stage           output flows to
    ======  ===========  ==============  ======================
    0       0 (down, A)  ``d``           rank ``d+1``
    1       1 (up, B)    ``D-1-d``       rank ``d-1``
    2       0 (down, A)  ``2D-1-d``      rank ``d-1``
    3       1 (up, B)    ``D+d``         rank ``d+1``
    ======  ===========  ==============  ======================

    Pipeline A turns at rank ``D-1`` (stage ``D-1`` → ``D`` is a local hand-over),
    pipeline B turns at rank 0. Ranks ``d`` and ``D-1-d`` hold the same four stages.
    """
    down_a = [(s, 0) for s in range(num_ranks)]
    back_a = [(num_ranks - 1 - s, 2) for s in range(num_ranks)]
    down_b = [(num_ranks - 1 - s, 1) for s in range(num_ranks)]
    back_b = [(s, 3) for s in range(num_ranks)]
    return _placement("bidirectional-v", num_ranks, [down_a + back_a, down_b + back_b])
