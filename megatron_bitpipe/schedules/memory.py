"""Memory per pipeline rank: parameters, gradients, optimizer state and peak activations, in bytes.

Each rank holds the stages its placement puts there (:class:`~.placement.Placement`: one chunk
per stage, so a placement with two pipelines — BitPipe, Chimera, DualPipe — holds two stages'
weights per rank, each stage on two ranks). A stage holds its transformer layers, stage 0 the
embedding, the last stage the final norm and, untied, the output layer
(:mod:`.model_shape`). Tied embeddings: where a pipeline's first and last stage share a rank
the output layer is the embedding's Parameter, counted once; where they sit on different
ranks (megatron's looped placement) the last stage holds a copy.

Per parameter (:class:`TrainingMemory`): its own bytes (2 with ``--bf16``, else 4), an fp32
gradient (megatron's gradient buffer: 4 bytes), and the optimizer's state — Adam's two
moments (8 bytes) or SGD's momentum (4 bytes), plus an fp32 main copy of a bf16 parameter
(4 bytes) — divided, with ``--use-distributed-optimizer``, over the stage's gradient-sync group
(its replicas x ``--data-parallel-size`` x ``--context-parallel-size`` ranks). Megatron's
padding of its buffers is left out. Under context parallelism every rank holds a whole stage's
weights and one context-parallel rank's activations (:mod:`.model_shape`: ``s / CP`` tokens).

Mixture-of-experts layers (:mod:`.moe_shape`) hold their router and shared expert like any
weight and ``E / EP`` experts per expert-parallel rank
(:meth:`~.model_shape.ModelShape.expert_parameters`); the distributed optimizer shards the
experts' state over their expert-data-parallel group, ``EP`` times smaller (the ranks holding
the same experts: replicas x ``--data-parallel-size / EP``).

Activations come from the simulated schedule
(:attr:`~.simulate.SimulationResult.peak_activation_bytes`): the largest sum, over the step, of
the saved activations of the micro-batches in flight on the rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Sequence, Tuple

from .layer_split import StageLayers
from .model_shape import ModelShape
from .placement import Placement

__all__ = ["OPTIMIZERS", "RankMemory", "TrainingMemory", "rank_memory", "rank_parameters"]

#: optimizer -> fp32 state bytes per parameter (Adam's two moments, SGD's momentum)
OPTIMIZERS = {"adam": 8, "sgd": 4}
_FP32_BYTES = 4
_BF16_BYTES = 2


@dataclass(frozen=True)
class TrainingMemory:
    """How training stores each parameter (Megatron-LM's flags).

    Attributes:
        bf16: ``--bf16``: bf16 parameters and activations, fp32 main parameters in the optimizer.
        optimizer: ``--optimizer`` (:data:`OPTIMIZERS`).
        distributed_optimizer: ``--use-distributed-optimizer``: optimizer state (and main
            parameters) sharded over each stage's gradient-sync group.
        data_parallel_size: ``--data-parallel-size``.
    """

    bf16: bool = False
    optimizer: str = "adam"
    distributed_optimizer: bool = False
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer: choose from {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1 (got {self.data_parallel_size})")

    @property
    def element_bytes(self) -> int:
        """Bytes of a parameter and of an activation element."""
        return _BF16_BYTES if self.bf16 else _FP32_BYTES

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state bytes per parameter before sharding."""
        return OPTIMIZERS[self.optimizer] + (_FP32_BYTES if self.bf16 else 0)


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's memory, in bytes."""

    parameters: float
    gradients: float
    optimizer_state: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def summary(self) -> dict:
        """JSON-ready (``memory_bytes`` of ``simulate --json``)."""
        return {**asdict(self), "total": self.total}


def rank_parameters(model: ModelShape, placement: Placement, layers: StageLayers) -> List[List[int]]:
    """Parameters of every chunk of every rank: ``[rank][chunk]`` (a tied output layer sharing
    its rank's embedding counted with the embedding only; an MoE layer's experts those of one
    expert-parallel rank)."""
    return [[total for total, _ in chunks] for chunks in _chunk_parameters(model, placement, layers)]


def _chunk_parameters(model: ModelShape, placement: Placement, layers: StageLayers) -> List[List[Tuple[int, int]]]:
    """``[rank][chunk]``: (all parameters, the experts among them)."""
    if not model.untie_embeddings_and_output_weights and not placement.ties_embeddings:
        raise ValueError(
            f"the {placement.name} placement cannot tie the embeddings and the output layer: "
            "pass --untie-embeddings-and-output-weights"
        )
    last = placement.num_stages - 1
    out = []
    for rank in range(placement.num_ranks):
        chunks = []
        for chunk in range(placement.chunks_per_rank):
            stage = placement.role(rank, chunk).stage
            moe = model.moe_layer_count(layers.first_layer(stage), layers.counts[stage])
            count = (layers.counts[stage] - moe) * model.layer_parameters() + (moe * model.layer_parameters(moe=True) if moe else 0)
            if stage == 0:
                count += model.embedding_parameters()
            if stage == last:
                separate = model.untie_embeddings_and_output_weights or placement.head_copies_embedding
                count += model.norm_parameters() + (model.output_layer_parameters() if separate else 0)
            chunks.append((count, moe * model.expert_parameters()))
        out.append(chunks)
    return out


def rank_memory(
    model: ModelShape,
    placement: Placement,
    layers: StageLayers,
    training: TrainingMemory,
    peak_activation_bytes: Sequence[float],
) -> List[RankMemory]:
    """The memory of every pipeline rank (module docstring); ValueError for tied embeddings on a
    placement that cannot tie them (Chimera), or an expert-parallel size that does not divide
    ``--data-parallel-size``."""
    expert_parallel = model.moe.expert_model_parallel_size if model.moe else 1
    if training.data_parallel_size % expert_parallel:
        raise ValueError(
            f"--expert-model-parallel-size {expert_parallel} must divide --data-parallel-size {training.data_parallel_size}: "
            "an expert-parallel group is data-parallel copies of one stage"
        )
    group = placement.num_pipelines * training.data_parallel_size * model.context_parallel_size  # a stage's gradient-sync ranks
    shards = group if training.distributed_optimizer else 1
    expert_shards = max(1, shards // expert_parallel)
    out = []
    for rank, chunks in enumerate(_chunk_parameters(model, placement, layers)):
        parameters = sum(total for total, _ in chunks)
        experts = sum(expert for _, expert in chunks)
        out.append(RankMemory(
            parameters=parameters * training.element_bytes,
            gradients=parameters * _FP32_BYTES,
            optimizer_state=((parameters - experts) / shards + experts / expert_shards) * training.optimizer_bytes,
            activations=peak_activation_bytes[rank],
        ))  # fmt: skip
    return out
