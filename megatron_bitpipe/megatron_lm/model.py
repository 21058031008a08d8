"""Model chunks for Megatron-LM's training loop: BitPipe's V layout, seed-only initial weights.

:func:`get_bitpipe_model` replaces Megatron-LM's ``training.get_model`` when the schedule is
``bitpipe``. It builds this rank's four chunks of the bidirectional V
(:func:`~megatron_bitpipe.schedules.placement.bidirectional_v`) by calling the script's own
``model_provider`` once per chunk, with

* ``config``: Megatron-LM's config from the command line
  (``core_transformer_config_from_args``) with the chunk's explicit global layer range
  (:func:`~megatron_bitpipe.runtime.model.chunk_config`), so the V's layer offsets hold;
* ``pre_process`` / ``post_process``: whether the chunk holds its pipeline's first / last
  stage (embedding on stage 1, final norm + head + loss on stage 2D: both on the edge ranks);
* ``pg_collection``: the chunk's process groups
  (:class:`~megatron_bitpipe.runtime.groups.PipelineGroups`: the data-parallel group of a
  chunk is its grad-sync group, the mirror pair x data parallel).

The chunk flow is the runtime's :func:`~megatron_bitpipe.runtime.model.build_chunks` (config
and placement checks, per-chunk configs and groups, tying) with the ``model_provider`` as the
chunk factory. Then, like :func:`~megatron_bitpipe.runtime.build.build_pipeline_model`: a tied
head is made the embedding chunk's word-embedding Parameter (one weight per rank, gradient
counted once), every weight is initialised from ``--seed`` and its full-model name (both
replicas identical, equal to any other layout's), the second replica's parameters are marked
for the grad norm, fp16/bf16 chunks are wrapped in the runtime's
:class:`~megatron_bitpipe.runtime.precision.ChunkFloat16Module` (inputs cast where the chunk
embeds, outputs upcast where it computes the loss) and each chunk gets its own megatron DDP
over its grad-sync group, always with ``overlap_grad_reduce`` (BitPipe's eager per-chunk
all-reduce).

The script's ``model_provider`` must pass ``config`` and ``pg_collection`` on to the model
(Megatron-LM's ``gpt_builder`` does); a chunk built without them raises a clear error.

:func:`initialize_chunks_from_seed` gives megatron's own looped chunks (other schedules,
``--layout-independent-init``) the same seed-only weights.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.utils import unwrap_model

from ..megatron_args import BitPipeConfigError
from ..runtime.groups import ParallelGrid, PipelineGroups
from ..runtime.init import initialize_from_seed
from ..runtime.layout import ChunkSpec, chunk_layers_of, chunk_specs
from ..runtime.model import build_chunks
from ..runtime.precision import ChunkFloat16Module
from ..runtime.replicas import mark_replica_parameters, wrap_ddp
from ..schedules.placement import bidirectional_v

__all__ = ["get_bitpipe_model", "initialize_chunks_from_seed"]


def _ddp_config(args) -> DistributedDataParallelConfig:
    """Megatron-LM's DDP settings that apply to BitPipe's per-chunk DDP (one bucket per chunk)."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=True,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        check_for_large_grads=getattr(args, "check_for_large_grads", False),
        average_in_collective=getattr(args, "ddp_average_in_collective", False),
    )


def _check_chunk(chunk: torch.nn.Module, spec: ChunkSpec, pg_collection) -> None:
    """The script's model_provider honoured ``config`` (layer range) and ``pg_collection``."""
    model = unwrap_model(chunk)
    block = getattr(model, "decoder", None) or getattr(model, "encoder", None)
    first = block.layers[0].layer_number - 1 if block is not None and len(block.layers) else None
    if getattr(model, "pg_collection", None) is not pg_collection or first != spec.first_layer:
        raise BitPipeConfigError(
            "--pipeline-schedule bitpipe: the script's model_provider did not build the chunk from the "
            "config and pg_collection it was given (Megatron-LM's gpt_builder does); bitpipe cannot place "
            f"its chunks (stage {spec.stage + 1} of pipeline {'AB'[spec.pipeline]} should start at layer "
            f"{spec.first_layer}, the model starts at {first})"
        )


def _build(args, model_provider_func: Callable, tie_in_chunk: bool, **kwargs) -> torch.nn.Module:
    """``model_provider_func(**kwargs)`` with ``--untie-embeddings-and-output-weights`` set
    unless ``tie_in_chunk``.

    Builders read the flag from the global arguments. megatron ties natively only within a
    chunk or across looped first/last stages (it asserts a head-only chunk is not on the
    first pipeline rank); no BitPipe chunk holds both ends, so every chunk is built untied
    and :func:`~megatron_bitpipe.runtime.model.build_chunks` ties the heads afterwards.
    """
    untie = args.untie_embeddings_and_output_weights
    args.untie_embeddings_and_output_weights = not tie_in_chunk
    try:
        return model_provider_func(**kwargs)
    finally:
        args.untie_embeddings_and_output_weights = untie


def get_bitpipe_model(
    model_provider_func: Callable,
    model_type: ModelType = ModelType.encoder_or_decoder,
    wrap_with_ddp: bool = True,
    config=None,
    pg_collection=None,
) -> List[torch.nn.Module]:
    """This rank's BitPipe chunks, with Megatron-LM ``get_model``'s signature and result.

    Returns the four chunks (local chunk order of the placement), wrapped like Megatron-LM's
    (fp16/bf16 wrapper, then DDP unless ``wrap_with_ddp`` is false); see the module docstring.
    Collective over all ranks (process groups, as Megatron-LM's ``get_model``).
    """
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if model_type != ModelType.encoder_or_decoder:
        raise BitPipeConfigError(f"--pipeline-schedule bitpipe does not support {model_type} models (encoder-decoder)")
    if pg_collection is not None:
        raise BitPipeConfigError("--pipeline-schedule bitpipe builds its own process groups; get_model(pg_collection=...) is not supported")
    args.model_type = model_type
    grid = ParallelGrid(tp=args.tensor_model_parallel_size, dp=args.data_parallel_size, pp=args.pipeline_model_parallel_size)
    groups = PipelineGroups.build(grid, bidirectional_v(grid.pp))
    config = config if config is not None else core_transformer_config_from_args(args)

    def make_chunk(chunk_config, spec: ChunkSpec, chunk_pgs, tie_in_chunk: bool) -> torch.nn.Module:
        chunk = _build(
            args,
            model_provider_func,
            tie_in_chunk,
            pre_process=spec.pre_process,
            post_process=spec.post_process,
            config=chunk_config,
            pg_collection=chunk_pgs,
        )
        _check_chunk(chunk, spec, chunk_pgs)
        chunk.model_type = model_type
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        return chunk

    tied = not args.untie_embeddings_and_output_weights
    chunks = build_chunks(
        config, groups, make_chunk, vocab_size=args.padded_vocab_size, share_embeddings_and_output_weights=tied
    )
    specs = chunk_specs(groups.placement, config.num_layers, groups.pp_rank, tied)
    initialize_from_seed(chunks, specs, args.seed, groups.tp)
    mark_replica_parameters(chunks, specs)

    if args.fp16 or args.bf16:
        chunks = [ChunkFloat16Module(config, chunk) for chunk in chunks]
    if wrap_with_ddp:
        chunks = wrap_ddp(chunks, groups, config, _ddp_config(args))
    return chunks


def initialize_chunks_from_seed(model: List[torch.nn.Module], seed: int, tp_group: Optional[torch.distributed.ProcessGroup]) -> None:
    """Re-initialise megatron's own chunks from ``seed`` alone (``--layout-independent-init``).

    Local; call before the optimizer is built. A tied head's copy of the word embeddings gets
    the embedding's value, as megatron's construction-time all-reduce would give it.
    """
    initialize_from_seed(model, [chunk_layers_of(chunk) for chunk in model], seed, tp_group)
