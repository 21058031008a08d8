"""Self-attention and residual dropout for Optimus 2D.

The QKV projection is an :class:`~megatron_bitpipe.optimus.layers.OptimusLinear` (h → 3h in
megatron-core's interleaved per-query-group layout), so its output block on the rank at
``(i, j)`` is batch block ``i`` × query groups block ``j``: whole heads. Scores, softmax,
dropout and the weighted sum are then local, exactly megatron-core's 1-D tensor-parallel
attention with the row group as its TP group (heads are split across a mesh row, the batch
across a mesh column). The output projection is another SUMMA linear.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType

from megatron_bitpipe.optimus.collectives import batch_block
from megatron_bitpipe.optimus.mesh import OptimusMesh


class OptimusSelfAttention(SelfAttention):
    """megatron-core ``SelfAttention`` on ``[s, b/q, h/q]`` blocks.

    The attention sees the mesh row group as its tensor-parallel group: each rank computes
    ``heads/q`` heads of its ``b/q`` sequences. ``attention_mask`` may cover the whole
    micro-batch (``[b, 1, s, s]``, this rank's batch block is taken), the local block, or
    broadcast (batch dimension 1).
    """

    def __init__(
        self,
        config,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        *,
        mesh: OptimusMesh,
    ):
        if pg_collection is None:
            raise ValueError("OptimusSelfAttention needs the model's pg_collection")
        row_parallel_groups = copy.copy(pg_collection)
        row_parallel_groups.tp = mesh.row_group
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=row_parallel_groups,
        )
        self.mesh = mesh

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs):
        full_batch = hidden_states.shape[1] * self.mesh.side
        if attention_mask is not None and attention_mask.shape[0] == full_batch:
            attention_mask = batch_block(attention_mask, 0, self.mesh)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def get_optimus_bias_dropout_add(training: bool, fused: bool):
    """megatron-core's bias-dropout-add, drawing dropout masks from the model-parallel RNG
    stream: the residual stream is partitioned, so each mesh position needs its own mask."""
    bias_dropout_add = get_bias_dropout_add(training, fused)
    if not training:
        return bias_dropout_add

    def bias_dropout_add_per_position(x_with_bias, residual, prob):
        if prob == 0:
            return bias_dropout_add(x_with_bias, residual, prob)
        with get_cuda_rng_tracker().fork():
            return bias_dropout_add(x_with_bias, residual, prob)

    return bias_dropout_add_per_position
