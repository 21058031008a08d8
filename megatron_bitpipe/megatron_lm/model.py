"""Model chunks for Megatron-LM's training loop: a plan schedule's placement, seed-only initial weights.

:func:`get_bitpipe_model` replaces Megatron-LM's ``training.get_model`` when this package's
plan executor runs the schedule (bitpipe, chimera, zb-h1, zbv, dualpipe, dualpipev). It builds
this rank's chunks of the schedule's placement (BitPipe: four chunks of the bidirectional V,
:func:`~megatron_bitpipe.schedules.placement.bidirectional_v`; ZB-V and DualPipeV: two of one V;
DualPipe and Chimera: two, one per pipeline; ZB-H1: one) by calling the script's own
``model_provider`` once per chunk, with

* ``config``: Megatron-LM's config from the command line
  (``core_transformer_config_from_args``) with the chunk's explicit global layer range
  (:func:`~megatron_bitpipe.model.chunks.chunk_config`), so the placement's layer offsets hold;
* ``pre_process`` / ``post_process``: whether the chunk holds its pipeline's first / last
  stage (embedding and final norm + head + loss: on the edge ranks for BitPipe, on rank 0 for
  the V schedules);
* ``pg_collection``: the rank's process groups
  (:class:`~megatron_bitpipe.execution.groups.PipelineGroups` ``rank_pgs``, plain data
  parallelism, which Megatron-LM's loop reads off the model for its loss average and
  checkpoints; with ``--expert-model-parallel-size`` its expert-parallel groups, which a
  mixture-of-experts layer's token dispatcher uses; with ``--context-parallel-size`` its
  context-parallel group, over which the SDPA core attention gathers keys and values, and the
  data x context-parallel group Megatron-LM averages the loss over); each chunk's DDP reduces over its
  grad-sync group, the mirror pair x data (x context) parallel, and expert gradients over the chunk's
  expert grad-sync group (the mirror pair x the data-parallel ranks holding the same experts).

The chunk flow is the runtime's :func:`~megatron_bitpipe.model.chunks.build_chunks` (config
and placement checks, per-chunk configs and groups, tying) with the ``model_provider`` as the
chunk factory. Then, like :func:`~megatron_bitpipe.model.build.build_pipeline_model`: a tied
head is made the embedding chunk's word-embedding Parameter where a pipeline starts and ends on
one rank (one weight per rank, gradient counted once; ZB-H1's looped pipeline ties megatron's
way, over the embedding group of its first and last rank), every weight is initialised from ``--seed`` and its full-model name (both
replicas identical, equal to any other layout's; a routed expert's name holds its global index;
megatron's own initialisation is skipped, each rank draws only its shards), each chunk gets the placement-aware
``sharded_state_dict`` of distributed checkpoints
(:mod:`~megatron_bitpipe.model.sharded_state`), a second replica's parameters are marked
for the non-distributed optimizer's grad norm, fp16/bf16 chunks are wrapped in the runtime's
:class:`~megatron_bitpipe.model.precision.ChunkFloat16Module` (inputs cast where the chunk
embeds, outputs upcast where it computes the loss) and each chunk gets its own megatron DDP
over its grad-sync group, always with ``overlap_grad_reduce`` (the executor's eager per-chunk
all-reduce; with ``--use-distributed-optimizer`` a reduce-scatter, and each chunk then has its
own distributed optimizer: :func:`megatron_bitpipe.megatron_lm.hooks.get_megatron_optimizer`;
with ``--overlap-param-gather`` that optimizer's parameter all-gather is overlapped with the next
forward, :attr:`~megatron_bitpipe.execution.replicas.ChunkDistributedDataParallel.overlaps_param_gather`).

The script's ``model_provider`` must pass ``config`` and ``pg_collection`` on to the model
(Megatron-LM's ``gpt_builder`` does); a chunk built without them raises a clear error.

:func:`initialize_chunks_from_seed` gives megatron's own looped chunks (other schedules,
``--layout-independent-init``) the same seed-only weights.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, List, Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.utils import unwrap_model

from .. import megatron_compat
from ..megatron_args import BitPipeConfigError
from ..execution.groups import ParallelGrid, PipelineGroups
from ..model.init import initialize_from_seed, without_megatron_init
from ..model_partition import ChunkSpec, chunk_layers_of, chunk_specs
from ..model.chunks import build_chunks, mark_tensor_parallel_weights, transformer_block_of
from ..model.experts import check_expert_layout
from ..model.precision import ChunkFloat16Module
from ..execution.replicas import mark_replica_parameters, wrap_ddp
from ..model.sharded_state import attach_sharded_state_dicts
from ..run_config import RunConfig

__all__ = ["build_plan_chunks", "builder_chunk_maker", "get_bitpipe_model", "initialize_chunks_from_seed"]


def _ddp_config(args, run_config: RunConfig) -> DistributedDataParallelConfig:
    """Megatron-LM's DDP settings that apply to the plan schedule's per-chunk DDP (one bucket per chunk)."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=True,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        check_for_large_grads=getattr(args, "check_for_large_grads", False),
        average_in_collective=getattr(args, "ddp_average_in_collective", False),
        use_distributed_optimizer=run_config.distributed_optimizer,
        overlap_param_gather=run_config.overlap_param_gather,
        delay_wgrad_compute=run_config.schedule.splits_backward,  # TE's deferred weights: DDP's hook after backward_dw
    )


def _check_chunk(chunk: torch.nn.Module, spec: ChunkSpec, pg_collection, builder: str, *, schedule: str) -> None:
    """``builder`` (the script's model_provider, or a model builder) honoured ``pg_collection``
    and ``config`` (the chunk's layer range); each failure is named on its own, with the
    ``--pipeline-schedule`` value ``schedule``."""
    model = unwrap_model(chunk)
    try:
        block = transformer_block_of(model)
    except ValueError as error:
        raise BitPipeConfigError(f"--pipeline-schedule {schedule}: {error}") from None
    if getattr(model, "pg_collection", None) is not pg_collection:
        raise BitPipeConfigError(
            f"--pipeline-schedule {schedule}: {builder} built {type(model).__name__} without the pg_collection it was "
            f"given (the model took megatron's global process groups), so {schedule} cannot build its chunks on their own "
            "groups; the model must get pg_collection (and config), as Megatron-LM's gpt_builder passes them "
            f"(Megatron-LM core_v0.16.1's pretrain_bert.py does not: BERT with {schedule} runs in megatron-bitpipe's "
            "scripts/pretrain_bert.py)"
        )
    first = block.layers[0].layer_number - 1 if len(block.layers) else None
    if spec.num_layers and first != spec.first_layer:
        raise BitPipeConfigError(
            f"--pipeline-schedule {schedule}: {builder} did not build the chunk from the config it was given, so {schedule} "
            f"cannot place its chunks: stage {spec.stage + 1} of pipeline {'AB'[spec.pipeline]} should start at layer "
            f"{spec.first_layer}, the model starts at {first} (the model must get config, whose layout holds the "
            "chunk's layer range, as Megatron-LM's gpt_builder passes it)"
        )


ChunkMaker = Callable[..., torch.nn.Module]
"""``make(pre_process=, post_process=, config=, pg_collection=, share_embeddings_and_output_weights=)``:
one chunk, built by Megatron-LM's own model code."""


def _provider_chunk_maker(args, model_provider_func: Callable) -> ChunkMaker:
    """Chunks from a script's ``model_provider``, with ``--untie-embeddings-and-output-weights``
    set while it runs unless the chunk ties (builders read the flag from the global arguments)."""

    def make(*, share_embeddings_and_output_weights: bool, **kwargs) -> torch.nn.Module:
        untie = args.untie_embeddings_and_output_weights
        args.untie_embeddings_and_output_weights = not share_embeddings_and_output_weights
        try:
            return model_provider_func(**kwargs)
        finally:
            args.untie_embeddings_and_output_weights = untie

    return make


def _provider_name(model_provider_func: Callable) -> str:
    """``the model_provider of /path/pretrain_bert.py``: the function (inside a
    ``functools.partial``) and the file that defines it, for messages."""
    func = model_provider_func
    while isinstance(func, functools.partial):
        func = func.func
    code = getattr(func, "__code__", None)
    name = getattr(func, "__name__", type(func).__name__)
    return f"the {name} of {code.co_filename}" if code is not None else f"the model provider {name}"


def builder_chunk_maker(builder) -> ChunkMaker:
    """Chunks from a Megatron-LM ``GPTModelBuilder``: one builder per chunk, whose model config
    carries the chunk's transformer config and tying."""
    model_config = megatron_compat.builder_model_config(builder)

    def make(*, pre_process: bool, post_process: bool, config, pg_collection, share_embeddings_and_output_weights: bool):
        chunk_model_config = dataclasses.replace(
            model_config, transformer=config, share_embeddings_and_output_weights=share_embeddings_and_output_weights
        )
        return type(builder)(chunk_model_config).build_model(pg_collection, pre_process=pre_process, post_process=post_process)

    return make


def get_bitpipe_model(
    run_config: RunConfig,
    model_provider_func: Callable,
    model_type: ModelType = ModelType.encoder_or_decoder,
    wrap_with_ddp: bool = True,
    config=None,
    pg_collection=None,
) -> List[torch.nn.Module]:
    """This rank's chunks of the plan schedule, with Megatron-LM ``get_model``'s signature and result
    after ``run_config`` (the run's decisions: the schedule's placement, the layout, precision).

    Returns the placement's chunks of this rank (local chunk order), wrapped like Megatron-LM's
    (fp16/bf16 wrapper, then DDP unless ``wrap_with_ddp`` is false); see the module docstring.
    ``pg_collection`` (Megatron-LM's global groups, given since core_v0.19) is replaced by
    the placement's own groups. Collective over all ranks (process groups, as Megatron-LM's ``get_model``).
    """
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    maker = _provider_chunk_maker(args, model_provider_func)
    return build_plan_chunks(args, run_config, maker, _provider_name(model_provider_func), config, model_type, wrap_with_ddp)


def build_bitpipe_model_with(run_config: RunConfig, builder, megatron_build: Callable, *args, **kwargs) -> List[torch.nn.Module]:
    """This rank's chunks of the plan schedule (after ``run_config``) from a Megatron-LM model
    builder, with the signature and result of its ``build_distributed_models`` (``megatron_build``,
    the builder's own method, whose arguments ``args`` / ``kwargs`` are). Only builders of GPTModel
    can place the schedule's chunks."""
    from megatron.training import get_args

    if not isinstance(builder, megatron_compat.megatron_lm_functions().gpt_builder):
        schedule = run_config.schedule.schedule
        raise BitPipeConfigError(
            f"--pipeline-schedule {schedule} builds GPTModel chunks (pretrain_gpt.py); {type(builder).__name__} "
            f"picks each pipeline stage's layers in megatron's looped order and cannot hold {schedule}'s stages"
        )
    call = inspect.signature(megatron_build).bind(*args, **kwargs)
    call.apply_defaults()
    config = megatron_compat.builder_model_config(builder).transformer
    maker = builder_chunk_maker(builder)
    name = type(builder).__name__
    return build_plan_chunks(get_args(), run_config, maker, name, config, call.arguments["model_type"], call.arguments["wrap_with_ddp"])


def build_plan_chunks(
    args, run_config: RunConfig, make: ChunkMaker, builder: str, config, model_type, wrap_with_ddp: bool
) -> List[torch.nn.Module]:
    """This rank's chunks of ``run_config``'s placement, each made by ``make`` (named
    ``builder`` in messages) from ``config`` with the chunk's layer range (the module
    docstring's flow): seed-only weights, fp16/bf16 wrapper, per-chunk DDP unless
    ``wrap_with_ddp`` is false. ``args`` is Megatron-LM's namespace (or the Megatron-Bridge
    container's, :func:`megatron_bitpipe.bridge.fields.megatron_lm_namespace`); its
    ``model_type`` is set. Collective over all ranks (process groups)."""
    if model_type != ModelType.encoder_or_decoder:
        raise BitPipeConfigError(f"--pipeline-schedule {run_config.schedule.schedule} does not support {model_type} models (encoder-decoder)")
    args.model_type = model_type
    layout = run_config.layout
    grid = ParallelGrid(tp=layout.tensor, dp=layout.data, pp=layout.pipeline, ep=layout.expert, cp=layout.context)
    check_expert_layout(config, grid)
    groups = PipelineGroups.build(grid, run_config.placement)

    def make_chunk(chunk_config, spec: ChunkSpec, chunk_pgs, tie_in_chunk: bool) -> torch.nn.Module:
        # The model gets the rank's groups (plain data parallelism): Megatron-LM's loop reads its
        # reductions' groups from the model (core_v0.19: the loss average over data parallelism,
        # checkpoint writers). The chunk's grad-sync group (``chunk_pgs``) goes to its DDP only.
        chunk = make(
            pre_process=spec.pre_process,
            post_process=spec.post_process,
            config=chunk_config,
            pg_collection=groups.rank_pgs,
            share_embeddings_and_output_weights=tie_in_chunk,
        )
        _check_chunk(chunk, spec, groups.rank_pgs, builder, schedule=run_config.schedule.schedule)
        chunk.model_type = model_type
        return chunk

    tied = not args.untie_embeddings_and_output_weights
    if run_config.schedule.splits_backward:  # before building: TE linears read it in their constructor
        megatron_compat.enable_delay_wgrad_compute(config)
    chunks = build_chunks(
        without_megatron_init(config),  # every weight is drawn once, below
        groups,
        make_chunk,
        vocab_size=args.padded_vocab_size,
        share_embeddings_and_output_weights=tied,
        stage_layers=run_config.stage_layers,
    )
    for param in (p for chunk in chunks for p in chunk.parameters()):
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    layers = config.num_layers if run_config.stage_layers is None else run_config.stage_layers
    specs = chunk_specs(groups.placement, layers, groups.pp_rank, tied, groups.local_experts(config.num_moe_experts))
    initialize_from_seed(chunks, specs, args.seed, groups.tp)
    attach_sharded_state_dicts(chunks, specs, groups)
    if not run_config.distributed_optimizer:
        mark_replica_parameters(chunks, specs)

    if run_config.precision.name != "fp32":
        chunks = [ChunkFloat16Module(config, chunk) for chunk in chunks]
    if wrap_with_ddp:
        chunks = wrap_ddp(chunks, groups, config, _ddp_config(args, run_config))
    return chunks


def initialize_chunks_from_seed(model: List[torch.nn.Module], seed: int, tp_group: Optional[torch.distributed.ProcessGroup]) -> None:
    """Re-initialise megatron's own chunks from ``seed`` alone (``--layout-independent-init``).

    Local; call before the optimizer is built. A tied head's copy of the word embeddings gets
    the embedding's value, as megatron's construction-time all-reduce would give it. The chunks'
    learnable softmax offsets are first marked tensor-parallel like this package's chunks'
    (:func:`~megatron_bitpipe.model.chunks.mark_tensor_parallel_weights`), so each rank draws its
    own heads' values and megatron's grad norm counts every head once.
    """
    for chunk in model:
        mark_tensor_parallel_weights(unwrap_model(chunk))
    initialize_from_seed(model, [chunk_layers_of(chunk) for chunk in model], seed, tp_group)
