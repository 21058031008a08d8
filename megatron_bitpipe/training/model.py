"""This rank's model chunks from the flags, for any task.

:func:`build_model` calls :func:`megatron_bitpipe.model.build.build_pipeline_model` with
everything the common flags fix (model config, parallel grid, padded vocabulary, maximum
sequence length, seed, tied embeddings, DDP config, tensor-parallel mode, position
embeddings, the layers of each pipeline stage); a model kind (:mod:`.model_kind`) adds its chunk builder, layer spec and
model-specific keywords. Initial weights are blocks of the full model drawn from ``--seed``
alone, whatever the layout; with ``--bf16``/``--fp16`` the chunks are wrapped for mixed
precision. ``--attention-backend sdpa`` swaps the layers' core attention for torch's SDPA
(:mod:`megatron_bitpipe.model.sdpa_attention`). The chunks' DDP reduces gradients over what the
data-parallel mode says
(:attr:`megatron_bitpipe.data_parallel_modes.DataParallelMode.gradient_reduction`): the
data-parallel group in sync mode, nothing with ABS-SGD (:mod:`.abs_sgd` reduces, one
iteration later), each data-parallel replica only in a decentralized mode (BitPipe's weight
replicas; :mod:`.decentralized` exchanges parameters between the replicas).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from ..model.build import PipelineModel, build_pipeline_model
from ..execution.groups import ParallelGrid
from ..run_config import RunConfig
from .config import ddp_config, transformer_config

__all__ = ["build_model"]


def build_model(
    run: RunConfig,
    chunk_builder: Callable[..., List[torch.nn.Module]],
    layer_spec: Callable[[RunConfig, TransformerConfig], Optional[ModuleSpec]],
    **chunk_kwargs,
) -> PipelineModel:
    """This rank's chunks of ``run``'s placement, seed-initialised and DDP-wrapped (collective).

    ``chunk_builder`` makes the chunks (``build_gpt_chunks``, ``build_bert_chunks``);
    ``layer_spec(run, config)`` is their layer spec (``None``: the builder's default);
    ``chunk_kwargs`` go to ``build_pipeline_model`` and from there to the chunk builder
    (``rotary_base``, ``add_binary_head``...). Called by
    :meth:`~.model_kind.ModelKind.build_model` with the kind's pieces.
    """
    config = transformer_config(run)
    spec = layer_spec(run, config)
    if spec is not None:
        chunk_kwargs["layer_spec"] = spec
    return build_pipeline_model(
        config,
        ParallelGrid(run.layout.tensor, run.layout.data, run.layout.pipeline, run.layout.expert, run.layout.context),
        run.placement,
        vocab_size=run.padded_vocab_size,
        max_sequence_length=run.model.max_position_embeddings or run.model.seq_length,
        seed=run.seed,
        share_embeddings_and_output_weights=not run.model.untie_embeddings_and_output_weights,
        ddp_config=ddp_config(run),
        tensor_parallel_mode=run.layout.tensor_parallel_mode,
        position_embedding_type=run.model.position_embedding_type,
        gradient_reduction=run.data_parallel_mode.gradient_reduction,
        stage_layers=run.stage_layers,
        chunk_builder=chunk_builder,
        **chunk_kwargs,
    )
