"""This rank's model chunks from the flags, for any task.

:func:`build_model` calls :func:`megatron_bitpipe.model.build.build_pipeline_model` with
everything the common flags fix (model config, parallel grid, padded vocabulary, maximum
sequence length, seed, tied embeddings, DDP config, tensor-parallel mode, position
embeddings); a task adds its chunk builder and model-specific keywords. Initial weights are
blocks of the full model drawn from ``--seed`` alone, whatever the layout; with
``--bf16``/``--fp16`` the chunks are wrapped for mixed precision. ``--attention-backend sdpa``
swaps the layers' core attention for torch's SDPA (:mod:`megatron_bitpipe.model.sdpa_attention`). With
``--data-parallel-mode abs-sgd`` the chunks' DDP does not reduce over data parallelism
(:mod:`.abs_sgd` does, one iteration later); with a decentralized mode it reduces within each
data-parallel replica only (BitPipe's weight replicas; :mod:`.decentralized` exchanges
parameters between the replicas).
"""

from __future__ import annotations

import argparse
from typing import Callable

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from ..model.build import PipelineModel, build_pipeline_model
from ..model.chunks import default_gpt_layer_spec
from ..model.sdpa_attention import SdpaDotProductAttention, with_core_attention
from ..execution.groups import ParallelGrid
from ..run_config import RunConfig
from .config import ddp_config, transformer_config
from .decentralized.args import DECENTRALIZED_MODES

__all__ = ["build_model", "gradient_reduction"]


def gradient_reduction(data_parallel_mode: str) -> str:
    """What the chunks' DDP reduces gradients over in ``--data-parallel-mode``
    (:func:`megatron_bitpipe.execution.replicas.wrap_ddp`)."""
    if data_parallel_mode == "sync":
        return "data-parallel"
    return "replicas" if data_parallel_mode in DECENTRALIZED_MODES else "none"


def build_model(
    args: argparse.Namespace,
    run: RunConfig,
    *,
    default_layer_spec: Callable[[TransformerConfig], ModuleSpec] = default_gpt_layer_spec,
    **model_kwargs,
) -> PipelineModel:
    """This rank's chunks of ``run``'s placement, seed-initialised and DDP-wrapped (collective).

    ``model_kwargs`` go to ``build_pipeline_model`` and from there to the chunk builder
    (``chunk_builder``, ``rotary_base``, ``add_binary_head``...). With ``--attention-backend
    sdpa`` the chunks' layer spec is ``default_layer_spec`` of the config (the task's local
    spec: GPT's by default) with :class:`~megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention`
    as core attention, unless ``model_kwargs`` give a ``layer_spec``.
    """
    config = transformer_config(args, run)
    if getattr(args, "attention_backend", "auto") == "sdpa" and "layer_spec" not in model_kwargs:
        model_kwargs["layer_spec"] = with_core_attention(default_layer_spec(config), SdpaDotProductAttention)
    return build_pipeline_model(
        config,
        ParallelGrid(run.layout.tensor, run.layout.data, run.layout.pipeline),
        run.placement,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        seed=args.seed,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        ddp_config=ddp_config(run),
        tensor_parallel_mode=run.layout.tensor_parallel_mode,
        position_embedding_type=args.position_embedding_type,
        gradient_reduction=gradient_reduction(run.data_parallel_mode),
        **model_kwargs,
    )
