"""Building GPT models for the training loop.

:func:`build_gpt_model` gives megatron-core ``GPTModel`` chunks of any placement through
:func:`megatron_bitpipe.runtime.build.build_pipeline_model`, or, with
``--tensor-parallel-mode optimus2d``, one ``OptimusGPTModel`` chunk per rank of the looped
placement. Either way the initial weights are blocks of the full model drawn from ``--seed``
alone (:mod:`megatron_bitpipe.runtime.init`), whatever the layout.
"""

from __future__ import annotations

import argparse

import torch

from ..optimus.gpt_model import OptimusGPTModel, optimus_p2p_tensor_shapes
from ..optimus.mesh import build_optimus_mesh
from ..runtime.build import PipelineModel, build_pipeline_model, init_megatron_state
from ..runtime.groups import ParallelGrid, PipelineGroups
from ..runtime.layout import chunk_specs
from ..runtime.replicas import mark_replica_parameters, wrap_ddp
from ..schedules.placement import Placement
from .config import ddp_config, transformer_config
from .sharding import initialize_from_seed

__all__ = ["build_gpt_model", "optimus_shapes_fn"]


def build_gpt_model(args: argparse.Namespace, placement: Placement) -> PipelineModel:
    """This rank's GPT chunks of ``placement``, seed-initialised and DDP-wrapped (collective)."""
    config = transformer_config(args)
    grid = ParallelGrid(args.tensor_model_parallel_size, args.data_parallel_size, args.pipeline_model_parallel_size)
    tied = not args.untie_embeddings_and_output_weights
    model_kwargs = dict(
        share_embeddings_and_output_weights=tied,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    if args.tensor_parallel_mode == "optimus2d":
        return _build_optimus_gpt(args, config, grid, placement, **model_kwargs)
    return build_pipeline_model(
        config,
        grid,
        placement,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        seed=args.seed,
        ddp_config=ddp_config(args),
        **model_kwargs,
    )


def _build_optimus_gpt(args, config, grid: ParallelGrid, placement: Placement, **model_kwargs) -> PipelineModel:
    """One ``OptimusGPTModel`` chunk per rank on the looped placement, seed-initialised."""
    groups = PipelineGroups.build(grid, placement)
    init_megatron_state(groups.rank_pgs, args.seed)
    mesh = build_optimus_mesh(groups.tp)
    specs = chunk_specs(placement, config.num_layers, groups.pp_rank, model_kwargs["share_embeddings_and_output_weights"])
    chunk = OptimusGPTModel(
        config,
        args.padded_vocab_size,
        args.max_position_embeddings,
        mesh=mesh,
        pg_collection=groups.model_pgs[0],
        pre_process=specs[0].pre_process,
        post_process=specs[0].post_process,
        **model_kwargs,
    )
    if torch.cuda.is_available():
        chunk.cuda(torch.cuda.current_device())
    initialize_from_seed([chunk], specs, args.seed, groups.tp)
    mark_replica_parameters([chunk], specs)
    return PipelineModel(wrap_ddp([chunk], groups, config, ddp_config(args)), groups, specs, config)


def optimus_shapes_fn(model: PipelineModel):
    """megatron's ``adjust_tensor_shapes_fn`` for an Optimus model ([s, b/q, h/q]), else None."""
    mesh = getattr(model.chunks[0].module, "mesh", None)
    return optimus_p2p_tensor_shapes(mesh) if mesh is not None else None
