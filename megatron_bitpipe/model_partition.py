"""Which part of the full model each pipeline chunk and tensor-parallel rank holds, and the
parameter names that go with it.

Below the model builders (:mod:`megatron_bitpipe.model`), the executor
(:mod:`megatron_bitpipe.execution`) and Optimus 2D (:mod:`megatron_bitpipe.optimus`); imports
only :mod:`megatron_bitpipe.schedules.placement` and :mod:`~megatron_bitpipe.schedules.layer_split`. No torch.distributed and no megatron-core at
import: usable by the planner, the model builders, the executor and tests alike
(:func:`chunk_layers_of`, which reads a built model, imports megatron-core when called).

The *full* (global) model is the whole model on one rank without tensor or pipeline
parallelism. Its parameter names are megatron-core's: ``embedding.*``,
``decoder.layers.{L}.*`` for global layer ``L`` (0-based), ``decoder.final_layernorm.*``,
``output_layer.*`` (absent with tied embeddings). BERT's block is ``encoder`` instead of
``decoder``, and its post-process part also has ``lm_head.*``, ``pooler.*`` and
``binary_head.*``. A *chunk* holds a contiguous range of layers plus, optionally, the
embedding (``pre_process``) and the final norm, heads and loss (``post_process``); megatron
numbers a chunk's layers locally in its module names (``decoder.layers.{l}``,
``l = L - first_layer``) and globally in ``layer.layer_number`` (1-based, ``L + 1``).

Tensor parallelism: a parameter with megatron's ``tensor_model_parallel`` attribute is the
``tp_rank``-th of ``tp_size`` equal blocks of the full tensor along ``partition_dim``, or with
``partition_stride`` > 1 the ``tp_rank``-th block of each of ``stride`` equal parts
(:func:`tp_block`). A parameter of Optimus 2D tensor parallelism instead carries an
``optimus_layout`` (:class:`megatron_bitpipe.optimus.layout.ParamLayout`), which says which
2-D block of the full tensor each TP rank holds; :func:`tp_block` and :func:`full_shape`
defer to it (no import of the optimus package here).

Layers per stage: :class:`~megatron_bitpipe.schedules.layer_split.StageLayers` gives each stage
of one pipeline its count of layers, in pipeline order (stage ``s`` holds layers
``[first_layer(s), first_layer(s) + counts[s])``, possibly none); by default the stages are
equal, ``num_layers / S`` each for ``S`` stages per pipeline. Every pipeline of a placement is a
full copy of the model, so the same stage in two pipelines holds the same layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .schedules.layer_split import StageLayers
from .schedules.placement import Placement

__all__ = [
    "ChunkLayers",
    "ChunkSpec",
    "chunk_specs",
    "chunk_layers_of",
    "to_global_name",
    "to_local_name",
    "is_tensor_parallel",
    "holds_full_tensor",
    "full_shape",
    "tp_block",
    "from_tp_blocks",
    "join_strided_blocks",
]

_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")
# Parameters of the post-process part (final norm, heads): GPT's and BERT's.
_POST_PROCESS = (
    "output_layer.",
    "decoder.final_layernorm.",
    "encoder.final_layernorm.",
    "lm_head.",
    "pooler.",
    "binary_head.",
)
_HEAD = "output_layer.weight"
_WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class ChunkLayers:
    """The part of the full model a chunk holds.

    ``first_layer`` is the global (0-based) index of the chunk's local layer 0; the chunk has
    ``num_layers`` consecutive layers. ``tied`` marks a chunk whose own ``output_layer.weight``
    is a copy of the word embeddings (megatron's tying with
    ``share_embeddings_and_output_weights`` when the head sits on another rank than the
    embedding; see :attr:`~megatron_bitpipe.schedules.placement.Placement.head_copies_embedding`).
    ``experts``: with expert parallelism, the global indices of the routed experts the chunk
    holds in each of its MoE layers (local expert ``i``, ``...mlp.experts.local_experts.{i}``,
    is global expert ``experts[i]``); None when it holds every expert or the model has none.
    """

    first_layer: int
    num_layers: int
    pre_process: bool
    post_process: bool
    tied: bool = False
    experts: Optional[range] = None

    @property
    def layers(self) -> range:
        """Global (0-based) indices of the chunk's layers."""
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclass(frozen=True, kw_only=True)
class ChunkSpec(ChunkLayers):
    """A local chunk of a :class:`Placement`: stage ``stage`` of pipeline (replica) ``pipeline``."""

    pipeline: int
    stage: int


def chunk_specs(
    placement: Placement, layers: Union[int, StageLayers], rank: int, tied: bool = False, experts: Optional[range] = None
) -> List[ChunkSpec]:
    """The chunks pipeline rank ``rank`` holds, indexed by local chunk id.

    ``layers`` is the :class:`~megatron_bitpipe.schedules.layer_split.StageLayers` of one
    pipeline (one count per stage of ``placement``), or a number of layers for equal stages.
    ``tied`` (``share_embeddings_and_output_weights``) marks the head chunk ``tied`` when its
    output layer is a copy of the embeddings
    (:attr:`~megatron_bitpipe.schedules.placement.Placement.head_copies_embedding`). Raises
    ValueError naming ``--num-layers`` if a number of layers does not fill the placement's
    equal stages (:meth:`~megatron_bitpipe.schedules.placement.Placement.layer_problem`), and
    for a split of another number of stages. ``experts``: the routed experts this rank holds
    (:attr:`ChunkLayers.experts`; None: all).
    """
    if not isinstance(layers, StageLayers):
        problem = placement.layer_problem(layers)
        if problem:
            raise ValueError(problem)
        layers = StageLayers.even(layers, placement.num_stages)
    stages = placement.num_stages
    if layers.num_stages != stages:
        raise ValueError(f"layers of {layers.num_stages} stages ({layers}) for the {stages} stages of the {placement.name} placement")
    head_copy = tied and placement.head_copies_embedding
    specs = []
    for chunk in range(placement.chunks_per_rank):
        role = placement.role(rank, chunk)
        specs.append(
            ChunkSpec(
                first_layer=layers.first_layer(role.stage),
                num_layers=layers.counts[role.stage],
                pre_process=role.stage == 0,
                post_process=role.stage == stages - 1,
                tied=head_copy and role.stage == stages - 1,
                experts=experts,
                pipeline=role.pipeline,
                stage=role.stage,
            )
        )
    return specs


def chunk_layers_of(model: torch.nn.Module) -> ChunkLayers:
    """Read :class:`ChunkLayers` off a built GPT or BERT chunk (wrapped or not).

    The offset comes from the first layer's global ``layer_number`` (1-based), so the chunk
    must have been built with correct layer numbers (megatron's own chunks, or
    :func:`megatron_bitpipe.model.chunks.chunk_config`). A chunk without layers gets
    ``first_layer`` 0, which no parameter name depends on.
    """
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    block = inner.encoder if hasattr(inner, "encoder") else inner.decoder  # BERT / GPT
    layers = block.layers
    return ChunkLayers(
        first_layer=layers[0].layer_number - 1 if len(layers) else 0,
        num_layers=len(layers),
        pre_process=inner.pre_process,
        post_process=inner.post_process,
        tied=inner.share_embeddings_and_output_weights,
        experts=_local_experts(inner),
    )


def _local_experts(model: torch.nn.Module) -> Optional[range]:
    """The global indices of the routed experts ``model``'s MoE layers hold, None for all or none."""
    for module in model.modules():
        indices = getattr(module, "local_expert_indices", None)
        num_experts = getattr(getattr(module, "config", None), "num_moe_experts", None)
        if indices is not None and num_experts is not None:
            return None if len(indices) == num_experts else range(indices[0], indices[0] + len(indices))
    return None


def to_global_name(local_name: str, chunk: ChunkLayers) -> str:
    """Full-model name of a chunk's parameter (or state dict key)."""
    match = _LAYER.match(local_name)
    if match:
        block, local, rest = match.group(1), int(match.group(2)), match.group(3)
        if local >= chunk.num_layers:
            raise KeyError(f"{local_name}: chunk has {chunk.num_layers} layers")
        return f"{block}.layers.{chunk.first_layer + local}.{_expert_name(rest, chunk.experts, global_index=True)}"
    if local_name == _HEAD and chunk.tied and not chunk.pre_process:
        return _WORD_EMBEDDING
    return local_name


def to_local_name(global_name: str, chunk: ChunkLayers) -> Optional[str]:
    """Inverse of :func:`to_global_name`: the chunk's name, or None if the chunk lacks it.

    For the tied word embedding, a chunk that holds only the output layer answers
    ``output_layer.weight``; a chunk holding both answers the embedding name.
    """
    match = _LAYER.match(global_name)
    if match:
        block, layer, rest = match.group(1), int(match.group(2)), match.group(3)
        if layer not in chunk.layers:
            return None
        rest = _expert_name(rest, chunk.experts, global_index=False)
        return None if rest is None else f"{block}.layers.{layer - chunk.first_layer}.{rest}"
    if global_name.startswith("embedding."):
        if chunk.pre_process:
            return global_name
        if global_name == _WORD_EMBEDDING and chunk.tied and chunk.post_process:
            return _HEAD
        return None
    if global_name.startswith(_POST_PROCESS):
        return global_name if chunk.post_process else None
    raise KeyError(f"{global_name}: not a GPT or BERT parameter name")


def _expert_name(rest: str, experts: Optional[range], global_index: bool) -> Optional[str]:
    """``rest`` of a layer's parameter name with its routed expert's local index made global
    (``global_index``) or the global one local (None: the chunk lacks that expert)."""
    match = _EXPERT.match(rest) if experts is not None else None
    if match is None:
        return rest
    index = int(match.group(2))
    if global_index:
        if index >= len(experts):
            raise KeyError(f"{rest}: the chunk holds {len(experts)} experts")
        return f"{match.group(1)}{experts[index]}{match.group(3)}"
    if index not in experts:
        return None
    return f"{match.group(1)}{experts.index(index)}{match.group(3)}"


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether megatron split ``param`` over the tensor-parallel ranks."""
    return bool(getattr(param, "tensor_model_parallel", False))


def holds_full_tensor(param: torch.Tensor, tp_size: int) -> bool:
    """Whether ``param`` is its full tensor, unsplit and in the full tensor's orientation
    (:func:`tp_block` gives the full tensor itself): no Optimus 2D layout, and not split or
    ``tp_size`` 1."""
    return getattr(param, "optimus_layout", None) is None and (tp_size == 1 or not is_tensor_parallel(param))


def full_shape(param: torch.Tensor, tp_size: int) -> Tuple[int, ...]:
    """Shape of the full tensor of which ``param`` is one tensor-parallel block."""
    layout = getattr(param, "optimus_layout", None)
    if layout is not None:
        return layout.serial_shape(param.shape, tp_size)
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def tp_block(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tp rank's block of ``full`` for ``param`` (``full`` itself if not tp-partitioned).

    megatron splits a tensor-parallel parameter along ``param.partition_dim`` into
    ``tp_size x stride`` equal parts and gives rank ``r`` parts ``r, r + tp_size, ...``
    (``stride = param.partition_stride``: 2 for the fused [gate; up] weight of SwiGLU), so
    with stride 1 the block is the ``tp_rank``-th of ``tp_size`` (a view of ``full``).
    An Optimus 2D parameter takes its 2-D block (``param.optimus_layout``).
    """
    if holds_full_tensor(param, tp_size):
        return full
    layout = getattr(param, "optimus_layout", None)
    if layout is not None:
        return layout.tp_block(full, tp_rank, tp_size)
    stride = getattr(param, "partition_stride", 1)
    parts = full.chunk(tp_size * stride, dim=param.partition_dim)
    if stride == 1:
        return parts[tp_rank]
    return torch.cat(parts[tp_rank::tp_size], dim=param.partition_dim)


def join_strided_blocks(blocks: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The tensor whose ``len(blocks)`` blocks along ``dim`` are ``blocks`` (in order), each
    block made of parts ``j, j + n, ...`` of the tensor cut into ``n x stride`` parts (``n =
    len(blocks)``): the inverse of that cut (:func:`tp_block`'s with ``stride`` > 1)."""
    pieces = [block.chunk(stride, dim=dim) for block in blocks]
    return torch.cat([piece[s] for s in range(stride) for piece in pieces], dim=dim)


def from_tp_blocks(blocks: Sequence[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """The full tensor of tensor-parallel ``param`` from every tp rank's block (rank order): the
    inverse of :func:`tp_block` (an Optimus 2D parameter by its ``optimus_layout``)."""
    layout = getattr(param, "optimus_layout", None)
    if layout is not None:
        return layout.from_tp_blocks(blocks)
    return join_strided_blocks(blocks, param.partition_dim, getattr(param, "partition_stride", 1))
