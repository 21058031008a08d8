"""Self-attention and residual dropout for Optimus 2D.

The QKV projection is an :class:`~megatron_bitpipe.optimus.layers.OptimusLinear` (h → 3h in
megatron-core's interleaved per-query-group layout), so its output block on the rank at
``(i, j)`` is batch block ``i`` × query groups block ``j``: whole heads. Scores, softmax,
dropout and the weighted sum are then local, exactly megatron-core's 1-D tensor-parallel
attention with the row group as its TP group (heads are split across a mesh row, the batch
across a mesh column). The output projection is another SUMMA linear.

:class:`OptimusDotProductAttention` is the default core attention: megatron-core's unfused
attention (same constructor, scaling, masking and softmax), which keeps the attention
probabilities and a 1-byte dropout mask for backward instead of the dropped-out
probabilities (recomputed in backward, one multiplication per element of
``[b/q, heads/q, s, s]``).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .collectives import batch_block
from .mesh import OptimusMesh


class OptimusSelfAttention(SelfAttention):
    """megatron-core ``SelfAttention`` on ``[s, b/q, h/q]`` blocks.

    The attention sees the mesh row group as its tensor-parallel group: each rank computes
    ``heads/q`` heads of its ``b/q`` sequences. ``attention_mask`` may cover the whole
    micro-batch (``[b, 1, s, s]``, this rank's batch block is taken), the local block, or
    broadcast (batch dimension 1).

    Other keywords megatron-core's ``TransformerLayer`` passes its attention
    (``pp_layer_offset`` since 0.17, ``name`` since 0.18) go to ``SelfAttention`` unchanged.
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
        **layer_kwargs,
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
            **layer_kwargs,
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


class _DropoutMatmul(torch.autograd.Function):
    """``dropout(probs) @ value`` keeping ``probs``, a bool mask and ``value`` for backward.

    The dropped-out probabilities ``probs · mask / (1 − p)`` are recomputed in backward
    (for the gradient of ``value``) instead of being kept. ``probs`` is what the softmax
    before keeps anyway, so the attention keeps one ``[b, heads, s, s]`` float tensor and
    one bool mask where dropout followed by a matmul would keep two float tensors and the mask.
    """

    @staticmethod
    def forward(ctx, probs, value, p):
        keep = torch.rand(probs.shape, device=probs.device) >= p
        scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(probs, keep, value)
        ctx.scale = scale
        return torch.matmul(probs * keep * scale, value)

    @staticmethod
    def backward(ctx, grad_context):
        probs, keep, value = ctx.saved_tensors
        grad_probs = grad_value = None
        if ctx.needs_input_grad[0]:
            grad_probs = torch.matmul(grad_context, value.transpose(-2, -1)) * keep * ctx.scale
        if ctx.needs_input_grad[1]:
            grad_value = torch.matmul((probs * keep * ctx.scale).transpose(-2, -1), grad_context)
        return grad_probs, grad_value, None


def dropout_matmul(probs: torch.Tensor, value: torch.Tensor, p: float) -> torch.Tensor:
    """``dropout(probs, p) @ value`` over the last two dimensions (training), storing less:
    see :class:`_DropoutMatmul`. ``p == 0`` is a plain matmul."""
    if p == 0:
        return torch.matmul(probs, value)
    return _DropoutMatmul.apply(probs, value, p)


class OptimusDotProductAttention(DotProductAttention):
    """megatron-core's unfused core attention with the dropout recomputed in backward.

    Constructor, softmax scale, query-key layer scaling, masking (causal by default, padding
    masks, sliding windows) and fp32 softmax are megatron-core's ``DotProductAttention``
    (built with the mesh row group as its TP group: ``heads/q`` heads per rank). Dropout
    draws from the model-parallel RNG stream, distinct per mesh position. Only the vanilla
    softmax is supported (a learnable softmax offset would be a column-replicated parameter
    without an Optimus layout).
    """

    def __init__(self, config, *args, **kwargs):
        if config.softmax_type != "vanilla":
            raise ValueError(f"Optimus 2D supports the vanilla softmax, not {config.softmax_type}")
        super().__init__(config, *args, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[s, b, heads, d]`` query and ``[s, b, groups, d]`` key/value → ``[s, b, heads·d]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("OptimusDotProductAttention supports neither attention_bias nor packed sequences")
        seq, batch, heads, head_dim = query.shape
        repeats = heads // key.shape[2]
        if repeats > 1:  # grouped-query attention: each key/value group serves `repeats` heads
            key, value = (t.repeat_interleave(repeats, dim=2) for t in (key, value))
        # [s, b, n, d] -> [b·n, s, d]: views of the QKV projection's output where strides allow
        query, key, value = (t.reshape(seq, batch * heads, head_dim).transpose(0, 1) for t in (query, key, value))
        scores = torch.bmm(query, key.transpose(1, 2)).mul_(self.softmax_scale)
        probs = self.scale_mask_softmax(scores.view(batch, heads, seq, seq), attention_mask, self.softmax_offset)
        p = self.attention_dropout.p if self.training else 0.0
        with get_cuda_rng_tracker().fork():
            context = dropout_matmul(probs.view(batch * heads, seq, seq), value, p)
        # [b·n, s, d] -> [s, b, n·d]
        return context.view(batch, heads, seq, head_dim).permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)
