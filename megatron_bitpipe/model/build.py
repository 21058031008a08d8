"""One call from a config to a trainable pipeline model: groups, chunks, weights, DDP.

:func:`build_pipeline_model` is what the pretrain scripts and the tests use; every step
is also available on its own (:mod:`megatron_bitpipe.execution.groups`, :mod:`.chunks`, :mod:`.init`,
:mod:`megatron_bitpipe.execution.replicas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from ..optimus.grads import defer_column_sums
from ..optimus.validation import check_optimus_model_config
from ..schedules.layer_split import StageLayers
from ..schedules.placement import Placement
from ..execution.groups import ParallelGrid, PipelineGroups
from .sdpa_attention import SdpaDotProductAttention, uses_core_attention
from .experts import check_expert_layout
from .init import initialize_from_seed, without_megatron_init
from ..model_partition import ChunkSpec, chunk_specs
from .chunks import build_gpt_chunks
from .precision import ChunkFloat16Module
from ..execution.replicas import mark_replica_parameters, wrap_ddp
from .sharded_state import attach_sharded_state_dicts

__all__ = ["PipelineModel", "init_megatron_state", "build_pipeline_model", "check_context_parallel_model"]


def init_megatron_state(pg_collection: ProcessGroupCollection, seed: int) -> None:
    """Set the megatron-core module state that explicit process groups do not cover.

    The global memory buffer (DotProductAttention takes scratch tensors from it) and the RNG
    tracker's streams (``model_parallel_cuda_manual_seed`` with this rank's tp, ep and expert
    tp ranks: the model-parallel and expert streams differ per rank, the default stream is
    ``seed`` everywhere).
    Also seeds torch's generator with ``seed``. Call once per rank before building models;
    calling it again re-seeds.
    """
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed, tp_rank=pg_collection.tp.rank(), ep_rank=pg_collection.ep.rank(), etp_rank=pg_collection.expt_tp.rank(),
        force_reset_rng=True,
    )


@dataclass
class PipelineModel:
    """This rank's part of a pipeline-parallel model.

    Attributes:
        chunks: megatron DDP-wrapped model chunks, index = local chunk id; pass them as
            ``model`` to the forward_backward_func.
        groups: the process groups (placement, channels, grad-sync groups).
        specs: what each chunk holds (pipeline, stage, layers, pre/post-process).
        config: the shared model config.
    """

    chunks: List[DistributedDataParallel]
    groups: PipelineGroups
    specs: List[ChunkSpec]
    config: TransformerConfig


def check_context_parallel_model(config, grid, layer_spec, gradient_reduction: str) -> None:
    """Refuse, in one ValueError naming the flag and the rule, a model that context parallelism
    (``grid.cp`` > 1) does not support here; nothing at ``grid.cp = 1``. Called before any group
    exists. The rules: ``config.context_parallel_size`` equals ``grid.cp``; the layers' core
    attention is :class:`~.sdpa_attention.SdpaDotProductAttention` (``--attention-backend
    sdpa``: megatron-core's local ``DotProductAttention`` has no context parallelism, and
    Transformer Engine's is not wired here); no mixture of experts; synchronous data-parallel
    gradient reduction (not decentralized data parallelism or ABS-SGD)."""
    if config.context_parallel_size != grid.cp:
        raise ValueError(
            f"the model config's context_parallel_size {config.context_parallel_size} differs from "
            f"--context-parallel-size {grid.cp} of the layout"
        )
    if grid.cp == 1:
        return
    flag = f"--context-parallel-size {grid.cp}"
    if layer_spec is None or not uses_core_attention(layer_spec, SdpaDotProductAttention):
        raise ValueError(
            f"{flag} needs --attention-backend sdpa (a layer spec whose core attention is SdpaDotProductAttention): "
            "megatron-core's local DotProductAttention has no context parallelism"
        )
    if config.num_moe_experts:
        raise ValueError(f"{flag} with --num-experts is not supported")
    if gradient_reduction != "data-parallel":
        raise ValueError(f"{flag} needs synchronous data-parallel gradient reduction (not {gradient_reduction!r})")


def build_pipeline_model(
    config: TransformerConfig,
    grid: ParallelGrid,
    placement: Placement,
    *,
    vocab_size: int,
    max_sequence_length: int,
    seed: int,
    share_embeddings_and_output_weights: bool = True,
    ddp_config: Optional[DistributedDataParallelConfig] = None,
    tensor_parallel_mode: str = "1d",
    chunk_builder: Callable[..., List[torch.nn.Module]] = build_gpt_chunks,
    gradient_reduction: str = "data-parallel",
    stage_layers: Optional[StageLayers] = None,
    **model_kwargs,
) -> PipelineModel:
    """Build, initialise and wrap this rank's model chunks of ``placement`` on ``grid``.

    ``chunk_builder`` makes the chunks: :func:`~.chunks.build_gpt_chunks` (GPT, the default),
    :func:`~.bert_model.build_bert_chunks` (BERT) or any function with their signature
    (``config, groups, *, vocab_size, max_sequence_length,
    share_embeddings_and_output_weights, **model_kwargs``). Collective over all ranks. The
    initial weights depend only on ``seed`` and the model shape
    (:func:`~.init.initialize_from_seed`), so both replicas of every stage start
    bit-identical and any layout starts from the single-process model; each rank draws only its
    own shards, once (megatron's initialisation is skipped: the chunks are built from a copy of
    ``config`` with ``perform_initialization=False``). With
    ``config.bf16``/``config.fp16`` each chunk is wrapped in
    :class:`~.precision.ChunkFloat16Module` (fp32 loss on whichever rank holds it). The default DDP
    config overlaps gradient reduction (the eager per-chunk all-reduce of BitPipe) and
    reduces in fp32; with ``ddp_config.use_distributed_optimizer`` each chunk's gradients are
    reduce-scattered over its grad-sync group instead (pair with
    :func:`megatron_bitpipe.training.optimizer.build_optimizer` and an ``OptimizerConfig`` with
    ``use_distributed_optimizer``). Each chunk's
    ``sharded_state_dict`` (distributed checkpoints) is the placement-aware one of
    :mod:`.sharded_state`.

    ``tensor_parallel_mode`` is ``--tensor-parallel-mode``: ``"1d"`` (megatron's tensor
    parallelism) or ``"optimus2d"`` (Optimus 2D over a q x q mesh of the ``grid.tp = q*q``
    ranks: ``OptimusGPTModel`` chunks, pipeline p2p of ``[s, b/q, h/q]`` blocks; the mesh is
    ``model.groups.mesh``). Its size constraints are checked here, before any communication
    (:func:`megatron_bitpipe.optimus.validation.check_optimus_model_config`); GPT only. Its
    column-replicated parameters' gradients are summed over the mesh column once per
    iteration (:mod:`megatron_bitpipe.optimus.grads`): finalise the gradients with
    ``finalize_model_grads_func(model.groups.mesh)``, as the executor and the training loop do.
    ``model_kwargs`` go to ``chunk_builder`` (``layer_spec``, ``position_embedding_type``,
    ``add_binary_head``, ...). ``gradient_reduction`` is what the chunks' DDP reduces over
    (:func:`~megatron_bitpipe.execution.replicas.wrap_ddp`): ``"data-parallel"`` (synchronous), ``"replicas"`` (within
    each data-parallel replica; builds the replica groups) or ``"none"`` (the caller reduces).
    ``stage_layers`` gives each stage of a pipeline its layers, in pipeline order (default: equal
    stages of ``config.num_layers``; ``chunk_builder`` takes it as ``stage_layers``); the initial
    weights do not depend on it.

    Context parallelism (``grid.cp`` > 1, ``config.context_parallel_size`` the same): each
    sequence is split over ``grid.cp`` ranks (:mod:`.context_parallel`; feed each rank its
    part, :func:`~.context_parallel.context_parallel_batch`), which needs SDPA core attention
    in ``layer_spec``; what is refused: :func:`check_context_parallel_model`.
    """
    if tensor_parallel_mode == "optimus2d":
        check_optimus_model_config(config, grid.tp, vocab_size)
    check_expert_layout(config, grid)
    check_context_parallel_model(config, grid, model_kwargs.get("layer_spec"), gradient_reduction)
    groups = PipelineGroups.build(grid, placement, tensor_parallel_mode, replica_groups=gradient_reduction == "replicas")
    init_megatron_state(groups.rank_pgs, seed)
    chunks = chunk_builder(
        without_megatron_init(config),
        groups,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        **({} if stage_layers is None else {"stage_layers": stage_layers}),
        **model_kwargs,
    )
    if groups.mesh is not None:  # summed once per iteration by finalize_model_grads_func(groups.mesh)
        defer_column_sums(chunks)
    layers = config.num_layers if stage_layers is None else stage_layers
    experts = groups.local_experts(config.num_moe_experts)
    specs = chunk_specs(placement, layers, groups.pp_rank, share_embeddings_and_output_weights, experts)
    initialize_from_seed(chunks, specs, seed, groups.tp)
    attach_sharded_state_dicts(chunks, specs, groups)
    ddp_config = ddp_config or DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)
    if not ddp_config.use_distributed_optimizer:
        mark_replica_parameters(chunks, specs)
    if config.bf16 or config.fp16:
        chunks = [ChunkFloat16Module(config, chunk) for chunk in chunks]
    return PipelineModel(wrap_ddp(chunks, groups, config, ddp_config, gradient_reduction), groups, specs, config)
