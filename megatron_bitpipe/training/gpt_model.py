"""Building GPT models for the training loop.

:func:`build_gpt_model` gives this rank's megatron-core ``GPTModel`` chunks of any placement
(``OptimusGPTModel`` chunks with ``--tensor-parallel-mode optimus2d``) through
:func:`megatron_bitpipe.runtime.build.build_pipeline_model`: initial weights are blocks of the
full model drawn from ``--seed`` alone, whatever the layout; with ``--bf16``/``--fp16`` the
chunks are wrapped for mixed precision.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ..optimus.gpt_model import optimus_p2p_tensor_shapes
from ..runtime.build import PipelineModel, build_pipeline_model
from ..runtime.groups import ParallelGrid
from ..schedules.placement import Placement
from .config import ddp_config, transformer_config

__all__ = ["build_gpt_model", "optimus_shapes_fn"]


def build_gpt_model(args: argparse.Namespace, placement: Placement) -> PipelineModel:
    """This rank's GPT chunks of ``placement``, seed-initialised and DDP-wrapped (collective)."""
    return build_pipeline_model(
        transformer_config(args),
        ParallelGrid(args.tensor_model_parallel_size, args.data_parallel_size, args.pipeline_model_parallel_size),
        placement,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        seed=args.seed,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        ddp_config=ddp_config(args),
        tensor_parallel_mode=args.tensor_parallel_mode,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )


def optimus_shapes_fn(model: PipelineModel) -> Optional[Callable]:
    """megatron's ``adjust_tensor_shapes_fn`` for an Optimus model ([s, b/q, h/q]), else None."""
    mesh = model.groups.mesh
    return optimus_p2p_tensor_shapes(mesh) if mesh is not None else None
