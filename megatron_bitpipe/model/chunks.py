"""megatron-core model chunks (GPTModel, and the base for BERT) for any placement, with explicit
global layer ranges.

**Layer ranges.** megatron-core derives a chunk's layers from ``get_transformer_layer_offset``
and ``get_num_layers_to_build``, which assume the looped order (stage = vp * D + rank) unless
``config.pipeline_model_parallel_layout`` is set; then both ask the layout object. Each chunk
therefore gets a shallow copy of the config whose layout is a :class:`ChunkLayerLayout`
answering with the chunk's own range, whatever rank or vp stage asks. Everything megatron
derives from the offset then agrees: ``TransformerLayer.layer_number`` is the global 1-based
number (attention scaling, per-layer configs, fp8 contexts use it), the sharded (distributed
checkpoint) state dict uses global layer offsets, and the MoE block spec's
``get_layer_id_list`` picks the chunk's layer specs. Module names stay local
(``decoder.layers.{l}``), as in megatron's own pipeline chunks;
:func:`megatron_bitpipe.model_partition.to_global_name` maps them.

The per-chunk config copies differ from the caller's config only in that field; attributes
set later on the caller's config (``no_sync_func``, ``finalize_model_grads_func``, ...) are
not seen through ``chunk.config``. Wrap the chunks with the caller's config (megatron DDP
takes the config explicitly and ``get_model_config`` of a DDP chunk returns that one).

**Tied embeddings.** With ``share_embeddings_and_output_weights`` and a placement whose
pipelines start and end on the same rank (V placements), the head chunk's
``output_layer.weight`` is then the embedding chunk's word-embedding *Parameter object*,
registered only in the embedding chunk: the head chunk's ``parameters()``/``state_dict()``
do not contain it, a per-chunk DDP gives it one ``main_grad`` (the embedding chunk's), and
the head's backward accumulates into that parameter like any other use of it. megatron's
tying machinery (zeroed copy + all-reduce over the embedding group at construction and
after every backward) is not used; megatron's ``sharded_state_dict`` of such a head chunk
expects its own ``output_layer.weight`` entry, which
:mod:`megatron_bitpipe.model.sharded_state` handles. A single pipeline whose ends are on different ranks (the looped
placement, :attr:`~megatron_bitpipe.schedules.placement.Placement.head_copies_embedding`) uses megatron's
own tying over the embedding group of :class:`~megatron_bitpipe.execution.groups.PipelineGroups`;
several such pipelines (Chimera) are rejected.

**Virtual pipeline.** A looped placement with ``v`` chunks per rank may set
``virtual_pipeline_model_parallel_size = v`` in the caller's config (megatron's interleaved
schedule reads it there); each chunk's own config leaves it unset (:func:`chunk_config`).

**Layer spec.** :func:`default_gpt_layer_spec` (BERT:
:func:`megatron_bitpipe.model.bert_model.default_bert_layer_spec`) is the single place choosing
between Transformer Engine and megatron-core's local modules.

**Optimus 2D.** When the groups carry an Optimus mesh (``tensor_parallel_mode="optimus2d"``),
every chunk is an :class:`~megatron_bitpipe.optimus.OptimusGPTModel` over that mesh: its
block spec follows the chunk's explicit layer range like any other spec, the tied head uses
the embedding chunk's 2-D ``[v/q, h/q]`` vocabulary block, and every parameter carries its
``optimus_layout``, which :mod:`.init` uses for seed-only initialisation.

**Weights.** megatron-core's own initialisation runs unless the config says
``perform_initialization=False`` (:func:`~megatron_bitpipe.model.build.build_pipeline_model`
does: :mod:`.init` draws every weight from the seed instead). Either way every weight of
megatron's tensor-parallel layers carries megatron's ``tensor_model_parallel`` /
``partition_dim`` / ``partition_stride`` attributes (:func:`mark_tensor_parallel_weights`:
megatron-core before 0.19 sets them only while initialising).

**Other models.** :func:`build_chunks` does the placement work (per-chunk configs, process
groups, tying) for any megatron-core language model whose block is a ``TransformerBlock``;
:func:`build_gpt_chunks` gives it GPTModel chunks (:func:`gpt_chunk_factory` makes one) and
:func:`megatron_bitpipe.model.bert_model.build_bert_chunks` BERT chunks.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional, Sequence, Union

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import BaseTransformerLayer
from megatron.core.utils import unwrap_model

from ..optimus.gpt_model import OptimusGPTModel
from ..optimus.spec import get_optimus_gpt_block_spec
from ..execution.groups import PipelineGroups
from ..model_partition import ChunkLayers, ChunkSpec, chunk_specs
from ..schedules.layer_split import StageLayers
from .experts import layer_specs_of, moe_gpt_layer_specs
from .norms import SequenceParallelTorchNorm, with_sequence_parallel_norms

__all__ = [
    "ChunkLayerLayout",
    "chunk_config",
    "default_gpt_layer_spec",
    "with_sequence_parallel_norms",
    "is_layer_spec",
    "chunk_block_spec",
    "ChunkFactory",
    "mark_tensor_parallel_weights",
    "build_chunks",
    "build_gpt_chunks",
    "gpt_chunk_factory",
]


ChunkFactory = Callable[[TransformerConfig, ChunkSpec, ProcessGroupCollection, bool], LanguageModule]
"""``make_chunk(chunk_config, spec, pg_collection, tie_in_chunk)`` for :func:`build_chunks`."""


class ChunkLayerLayout(PipelineParallelLayerLayout):
    """A pipeline layout that knows one chunk: decoder layers ``[first_layer, first_layer + num_layers)``.

    Answers megatron's offset / layer-count / layer-id queries for every (pp rank, vp stage),
    so it must only be used in the config of the chunk it describes (:func:`chunk_config`).
    The table-based parts of the base class (``layout``, validation, pretty printing) do not
    exist here.
    """

    def __init__(self, first_layer: int, num_layers: int):
        # Deliberately not the base initialiser, which parses a per-stage table.
        self.first_layer = first_layer
        self.num_layers = num_layers

    def __repr__(self) -> str:
        return f"ChunkLayerLayout(layers {self.first_layer}..{self.first_layer + self.num_layers - 1})"

    pretty_repr = __repr__

    def get_num_layers_to_build(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None) -> int:
        return self.num_layers if layer_type == LayerType.decoder else 0

    def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None) -> int:
        return self.first_layer if layer_type == LayerType.decoder else 0


def chunk_config(config: TransformerConfig, layers: ChunkLayers) -> TransformerConfig:
    """Shallow copy of ``config`` whose pipeline layout is ``layers``' explicit range.

    Raises ValueError for configs that already choose layers per stage another way
    (custom layout, uneven first/last stage, embedding or loss counted as a layer) and for
    multi-token prediction, which this layout does not describe.
    """
    conflicts = {
        "pipeline_model_parallel_layout": config.pipeline_model_parallel_layout is not None,
        "num_layers_in_first_pipeline_stage": config.num_layers_in_first_pipeline_stage is not None,
        "num_layers_in_last_pipeline_stage": config.num_layers_in_last_pipeline_stage is not None,
        "account_for_embedding_in_pipeline_split": config.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": config.account_for_loss_in_pipeline_split,
        "mtp_num_layers": config.mtp_num_layers is not None,
    }
    bad = [name for name, conflict in conflicts.items() if conflict]
    if bad:
        raise ValueError(f"explicit chunk layer ranges cannot be combined with {', '.join(bad)}")
    if config.pipeline_model_parallel_size == 1 and layers.first_layer:
        # megatron ignores the layout without pipeline parallelism (offset 0).
        raise ValueError("chunks starting after layer 0 need --pipeline-model-parallel-size > 1")
    chunk = copy.copy(config)
    chunk.pipeline_model_parallel_layout = ChunkLayerLayout(layers.first_layer, layers.num_layers)
    # A chunk is one model: megatron's interleaved schedule reads the virtual pipeline size
    # from the caller's config, the chunk's own tying and layer checks must not.
    chunk.virtual_pipeline_model_parallel_size = None
    return chunk


def default_gpt_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """Transformer Engine layer spec if TE is importable and ``config.transformer_impl`` asks
    for it (megatron's default), else megatron-core's local spec — with norms that support
    sequence parallelism when megatron would fall back to ``WrappedTorchNorm`` (no apex)."""
    if gpt_layer_specs.HAVE_TE and config.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    return with_sequence_parallel_norms(spec)


def is_layer_spec(spec) -> bool:
    """Whether ``spec`` describes one transformer layer (as opposed to a whole block)."""
    return isinstance(spec, ModuleSpec) and issubclass(spec.module, BaseTransformerLayer)


def chunk_block_spec(layer_spec: Union[ModuleSpec, Sequence[ModuleSpec]], num_layers: int) -> ModuleSpec:
    """Block spec of ``num_layers`` copies of ``layer_spec`` (or of the ``num_layers`` specs of a
    sequence, one per layer); the final norm matches the layers' (torch norms get
    :class:`SequenceParallelTorchNorm`, so sequence parallelism works without apex)."""
    final_norm = gpt_layer_specs.LNImpl
    if final_norm is WrappedTorchNorm:
        final_norm = SequenceParallelTorchNorm
    layer_specs = [layer_spec] * num_layers if isinstance(layer_spec, ModuleSpec) else list(layer_spec)
    if len(layer_specs) != num_layers:
        raise ValueError(f"{len(layer_specs)} layer specs for a block of {num_layers} layers")
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm),
    )


def transformer_block_of(model: torch.nn.Module) -> TransformerBlock:
    """The ``TransformerBlock`` of a megatron-core language model (its ``decoder`` or
    ``encoder``). ValueError for models whose layers are not a ``TransformerBlock``: hybrid and
    Mamba models (``HybridModel``, ``MambaModel``) choose each pipeline stage's layers from
    their layer pattern in megatron's looped order, so they cannot hold explicit layer ranges."""
    model = unwrap_model(model)
    block = getattr(model, "decoder", None) or getattr(model, "encoder", None)
    if not isinstance(block, TransformerBlock):
        raise ValueError(
            f"{type(model).__name__} is not built on a TransformerBlock (its layers: {type(block).__name__}); "
            "pipeline chunks with explicit layer ranges need GPTModel or BertModel layers"
        )
    return block


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give every weight of megatron's tensor-parallel layers in ``model`` that lacks them the
    attributes megatron's initialisation sets: column-parallel linears split along dim 0 (stride
    2 for the ``[gate; up]`` ``linear_fc1`` of a gated MLP, as megatron's ``MLP`` builds it; a
    bias, which megatron always marks, gives the stride where there is one), row-parallel
    linears along dim 1, vocabulary-parallel embeddings along dim 0.

    megatron-core before 0.19 sets them only inside its weight initialisation, so a model built
    with ``perform_initialization=False`` would lack them; weights that have them are left alone.

    A learnable softmax offset (``softmax_type="learnable"``: a core attention's
    ``softmax_offset``, one value per attention head) is marked split along dim 0 whatever it
    carries: megatron-core's core attention holds the values of its tensor-parallel rank's
    heads and its ``sharded_state_dict`` splits the offset along dim 0 over the tensor-parallel
    group, but megatron never marks it (its defaults call it unsplit), so without the mark every
    rank would draw the first heads' values and the grad norm would count only tp rank 0's.
    """
    gated_fc1 = {
        id(module.linear_fc1)
        for module in model.modules()
        if isinstance(module, MLP) and module.config.gated_linear_unit and not getattr(module.config, "use_kitchen", False)
    }
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear):
            bias = getattr(module, "bias", None)
            stride = getattr(bias, "partition_stride", None) or (2 if id(module) in gated_fc1 else 1)
            set_tensor_model_parallel_attributes(weight, True, 0, stride)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
        elif isinstance(module, VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
    for module in model.modules():
        offset = module._parameters.get("softmax_offset")
        if offset is not None:
            offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride = True, 0, 1


def build_chunks(
    config: TransformerConfig,
    groups: PipelineGroups,
    make_chunk: ChunkFactory,
    *,
    vocab_size: int,
    share_embeddings_and_output_weights: bool = False,
    stage_layers: Optional[StageLayers] = None,
) -> List[LanguageModule]:
    """This rank's model chunks of ``groups.placement``, indexed by local chunk id, for any
    megatron-core language model.

    ``stage_layers`` gives each stage of a pipeline its layers (pipeline order); default equal
    stages of ``config.num_layers``. ``make_chunk(chunk_config, spec, pg_collection, tie_in_chunk)`` builds one chunk: the
    model holding ``spec`` (its layers, ``pre_process``/``post_process``), built from
    ``chunk_config`` (:func:`chunk_config`: global layer numbers) with ``pg_collection``
    (``groups.model_pgs[c]``); ``tie_in_chunk`` is its ``share_embeddings_and_output_weights``
    (true for a chunk holding both ends of a tied model, and for the end chunks when megatron
    ties across ranks; across chunks of one rank see the module docstring). ``vocab_size`` is
    the padded vocabulary (divisible by the tp size). Tied embeddings: ValueError for several
    pipelines whose first and last stages are on different ranks. With CUDA available the
    chunks are moved to the current device; each records ``groups`` as
    ``chunk.pipeline_groups`` (the forward_backward_func finds placement, channels and
    grad-sync groups there). Weights of megatron's tensor-parallel layers carry their
    tensor-parallel attributes (:func:`mark_tensor_parallel_weights`). ValueError for a chunk
    not built on a ``TransformerBlock`` (:func:`transformer_block_of`).
    """
    if config.pipeline_model_parallel_size != groups.grid.pp:
        raise ValueError(
            f"config has pipeline_model_parallel_size {config.pipeline_model_parallel_size}, "
            f"the process grid {groups.grid.pp}"
        )
    if config.tensor_model_parallel_size != groups.grid.tp:
        raise ValueError(
            f"config has tensor_model_parallel_size {config.tensor_model_parallel_size}, "
            f"the process grid {groups.grid.tp}"
        )
    vp = config.virtual_pipeline_model_parallel_size
    if vp not in (None, 1) and (groups.placement.name != "looped" or vp != groups.placement.chunks_per_rank):
        raise ValueError(
            "the placement defines the chunks; virtual_pipeline_model_parallel_size may only give the "
            "chunks per rank of a looped placement"
        )
    if vocab_size % groups.grid.tp:
        raise ValueError(f"vocab_size {vocab_size} is not divisible by the tensor-parallel size {groups.grid.tp}")
    layers = config.num_layers if stage_layers is None else _checked_stage_layers(stage_layers, config)
    specs = chunk_specs(groups.placement, layers, groups.pp_rank, share_embeddings_and_output_weights)
    megatron_ties = share_embeddings_and_output_weights and groups.placement.head_copies_embedding
    if share_embeddings_and_output_weights and not megatron_ties:
        _check_tied_placement(groups)
    chunks = []
    for chunk, spec in enumerate(specs):
        # megatron ties inside one chunk, or across ranks between the end chunks; across
        # chunks of one rank see _tie_head.
        ends = (spec.pre_process or spec.post_process) if megatron_ties else (spec.pre_process and spec.post_process)
        tie_in_chunk = share_embeddings_and_output_weights and ends
        model = make_chunk(chunk_config(config, spec), spec, groups.model_pgs[chunk], tie_in_chunk)
        transformer_block_of(model)
        mark_tensor_parallel_weights(model)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        model.pipeline_groups = groups
        chunks.append(model)
    if share_embeddings_and_output_weights and not megatron_ties:
        for head, embedding in _tied_pairs(specs):
            _tie_head(chunks[head], chunks[embedding])
    return chunks


def gpt_chunk_factory(
    config: TransformerConfig,
    mesh=None,
    *,
    vocab_size: int,
    max_sequence_length: int,
    layer_spec: Union[None, ModuleSpec, Sequence[ModuleSpec]] = None,
    position_embedding_type: str = "learned_absolute",
    model_class: type = GPTModel,
    **gpt_kwargs,
) -> ChunkFactory:
    """The :data:`ChunkFactory` making :func:`build_gpt_chunks`' GPTModel chunks (``OptimusGPTModel``
    over ``mesh`` when given): a chunk holds ``spec``'s layers and its ``pre_process`` /
    ``post_process`` ends. ``layer_spec`` is one layer spec for every layer, a block spec, or a
    sequence of one layer spec per layer of the full model (a chunk takes those of its global
    layers); it defaults to :func:`default_gpt_layer_spec` of ``config``, or with
    ``config.num_moe_experts`` to :func:`~.experts.moe_gpt_layer_specs` (none with a mesh);
    ``gpt_kwargs`` go to the model class, ``model_class`` (a ``GPTModel`` subclass such as
    :class:`~megatron_bitpipe.hfta.HftaGPTModel`) without a mesh."""
    default = moe_gpt_layer_specs if config.num_moe_experts else default_gpt_layer_spec
    spec = layer_spec or (None if mesh else default(config))

    def make_chunk(chunk_config: TransformerConfig, chunk: ChunkLayers, pgs: ProcessGroupCollection, tie: bool):
        if mesh is None:
            if isinstance(spec, (list, tuple)):  # one spec per layer of the full model
                block = chunk_block_spec(layer_specs_of(spec, chunk.first_layer, chunk.num_layers), chunk.num_layers)
            else:
                block = chunk_block_spec(spec, chunk.num_layers) if is_layer_spec(spec) else spec
            model_kwargs = dict(transformer_layer_spec=block)
        else:
            block = get_optimus_gpt_block_spec(chunk_config, mesh, chunk.num_layers, layer_spec=spec)
            model_kwargs = dict(transformer_layer_spec=block, mesh=mesh)
        return (model_class if mesh is None else OptimusGPTModel)(
            config=chunk_config,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=chunk.pre_process,
            post_process=chunk.post_process,
            share_embeddings_and_output_weights=tie,
            position_embedding_type=position_embedding_type,
            pg_collection=pgs,
            **model_kwargs,
            **gpt_kwargs,
        )

    return make_chunk


def build_gpt_chunks(
    config: TransformerConfig,
    groups: PipelineGroups,
    *,
    vocab_size: int,
    max_sequence_length: int,
    share_embeddings_and_output_weights: bool = False,
    layer_spec: Optional[ModuleSpec] = None,
    position_embedding_type: str = "learned_absolute",
    stage_layers: Optional[StageLayers] = None,
    **gpt_kwargs,
) -> List[GPTModel]:
    """This rank's GPTModel chunks of ``groups.placement``, indexed by local chunk id.

    Chunk ``c`` holds :func:`~megatron_bitpipe.model_partition.chunk_specs`\\ ``[c]`` (its
    layers carry global layer numbers; ``stage_layers`` as in :func:`build_chunks`), uses ``groups.model_pgs[c]`` and its own
    :func:`chunk_config`; see :func:`build_chunks` for the checks and tied embeddings.
    ``gpt_kwargs`` go to ``GPTModel`` (rotary settings, ``parallel_output``...). With
    ``groups.mesh`` the chunks are ``OptimusGPTModel``\\ s and ``layer_spec``, if given, is an
    Optimus *layer* spec (:func:`~megatron_bitpipe.optimus.get_optimus_gpt_layer_spec`, e.g.
    with another core attention). Weights get megatron's own (layout-dependent)
    initialisation unless ``config.perform_initialization`` is false; call
    :func:`megatron_bitpipe.model.init.initialize_from_seed` for layout-independent ones.
    The chunks come from :func:`gpt_chunk_factory`.
    """
    make_chunk = gpt_chunk_factory(
        config,
        groups.mesh,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        layer_spec=layer_spec,
        position_embedding_type=position_embedding_type,
        **gpt_kwargs,
    )
    return build_chunks(
        config,
        groups,
        make_chunk,
        vocab_size=vocab_size,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        stage_layers=stage_layers,
    )


def _checked_stage_layers(stage_layers: StageLayers, config: TransformerConfig) -> StageLayers:
    if stage_layers.num_layers != config.num_layers:
        raise ValueError(f"stage layers {stage_layers} sum to {stage_layers.num_layers}, config.num_layers is {config.num_layers}")
    return stage_layers


def _check_tied_placement(groups: PipelineGroups) -> None:
    placement = groups.placement
    for pipeline in range(placement.num_pipelines):
        first = placement.location(pipeline, 0).rank
        last = placement.location(pipeline, placement.num_stages - 1).rank
        if first != last:
            raise ValueError(
                f"tied embeddings need each pipeline's first and last stage on one rank; the "
                f"{placement.name} placement puts pipeline {pipeline}'s on ranks {first} and {last}"
            )


def _tied_pairs(specs: Sequence[ChunkSpec]):
    """(head chunk, embedding chunk) local ids of each pipeline whose two ends are separate chunks here."""
    embedding = {s.pipeline: c for c, s in enumerate(specs) if s.pre_process}
    return [(c, embedding[s.pipeline]) for c, s in enumerate(specs) if s.post_process and not s.pre_process]


def _tie_head(head: LanguageModule, embedding: LanguageModule) -> None:
    """Make ``head``'s output layer use ``embedding``'s word-embedding Parameter, unregistered."""
    weight = embedding.embedding.word_embeddings.weight
    layer = head.output_layer
    if layer.weight.shape != weight.shape:
        raise ValueError(f"output layer {tuple(layer.weight.shape)} vs word embeddings {tuple(weight.shape)}")
    del layer.weight  # drops the head's own Parameter from its registry
    # A plain instance attribute: ColumnParallelLinear reads self.weight, Module does not register it.
    layer.__dict__["weight"] = weight
    head.share_embeddings_and_output_weights = True
    embedding.share_embeddings_and_output_weights = True
