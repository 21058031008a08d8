"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for megatron-core's
local layers (``--attention-backend sdpa``).

:class:`SdpaDotProductAttention` is a drop-in ``core_attention`` of megatron-core's
``SelfAttention`` spec in place of the unfused ``DotProductAttention`` (baddbmm + softmax +
bmm over a materialised ``[b, heads, s, s]`` tensor). It takes the same constructor arguments
(the ones ``SelfAttention`` passes: ``config, layer_number, attn_mask_type, attention_type,
attention_dropout, softmax_scale, cp_comm_type, pg_collection``) and the same forward
(``query, key, value`` as ``[s, b, heads, head_dim]``, ``attention_mask``, ``attn_mask_type``,
``attention_bias``, ``packed_seq_params``), and returns ``[s, b, heads * head_dim]`` — the
same in megatron-core 0.16.1 and 0.19.2 (see :mod:`megatron_bitpipe.megatron_compat`).

What it computes, compared with ``DotProductAttention``:

* **Masks.** A causal layer (GPT: ``attn_mask_type`` causal) runs SDPA with ``is_causal=True``
  and no materialised mask; like megatron's fused causal softmax and Transformer Engine, a
  mask passed to a causal layer is not read. A padding layer (BERT) passes megatron's boolean
  mask (``True`` = masked out) inverted, as SDPA's ``attn_mask`` (``True`` = attends). The mask
  type is the constructor's, as in ``DotProductAttention`` (the forward argument is ignored).
  Rows whose keys are all masked (padding query rows of BERT's ``[b, 1, s, s]`` mask) give 0
  here and megatron's mean of the values there; those rows reach no loss (later layers mask
  them as keys, the losses skip them), so losses and gradients agree.
* **Scaling.** SDPA's ``scale`` is ``softmax_scale`` (default 1/sqrt(head_dim)).
  ``apply_query_key_layer_scaling`` divides megatron's fp16 scores by the layer number and
  multiplies them back in the fp32 softmax: the same effective scale, which SDPA applies in
  its fp32 accumulation, so the flag changes nothing here. SDPA's GPU kernels always take the
  softmax in fp32 (as ``attention_softmax_in_fp32``).
* **GQA.** ``num_query_groups`` < heads: SDPA's ``enable_gqa`` (no copy of the keys and
  values) without a mask; with a mask the keys and values are repeated per query head, as
  megatron does (head ``i`` reads group ``i // (heads / groups)`` in both).
* **Tensor parallelism.** The heads per partition are the tensors' (megatron's
  ``SelfAttention`` splits them); the partition sizes are kept as ``DotProductAttention``
  keeps them.
* **Dropout.** SDPA's ``dropout_p`` in training only, inside ``get_cuda_rng_tracker().fork()``
  unless sequence parallelism is on (``DotProductAttention``'s rule). The mask is drawn by
  SDPA's kernel, so **its random stream differs from the unfused path's** (same seed, other
  mask); selective recompute (``--recompute-modules core_attn``) restores the RNG states and
  replays the same mask.

* **Context parallelism** (``pg_collection.cp`` of more than one rank, megatron's load-balanced
  split of each sequence, :mod:`megatron_bitpipe.model.context_parallel`), by the constructor's
  ``cp_comm_type`` (megatron's names; megatron-core passes ``config.cp_comm_type``):
  ``all_gather`` (the default, also for ``None``): the keys and values of the whole sequence
  are all-gathered over the context-parallel group (their gradients reduce-scattered), and each
  of this rank's two query chunks attends the keys up to its own end, causally masked;
  ``p2p``: the key/value blocks pass around the context-parallel ring and the partial outputs
  are merged by log-sum-exp (:mod:`megatron_bitpipe.model.ring_attention`); ``a2a`` and
  ``a2a+p2p`` are refused. Causal layers (GPT) only; no attention dropout (refused at
  construction: no test shows its masks right under the split).

Refused (``ValueError``/``NotImplementedError`` at construction or call): context parallelism
in a layer that is not causal, with attention dropout, or with a ``config.context_parallel_size``
other than the cp group's size; sliding-window attention, ``softmax_type`` other than
``vanilla``, ``attention_bias``, packed sequences.

:func:`with_core_attention` swaps the core attention of a layer spec. For Megatron-LM's own
scripts (``--spec MODULE NAME`` imports a layer spec), this module offers
``gpt_local_sdpa_layer_spec``: megatron-core's local GPT layer spec (LayerNorm, no QK norm)
with SDPA core attention (docs/megatron_lm.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide

from .context_parallel import causal_chunk_masks, gather_keys_values
from .ring_attention import ring_attention

#: ``cp_comm_type`` values (megatron's names) this layer computes: the key/value all-gather
#: (the default, also for ``None``) and the ring (``p2p``)
CP_COMM_TYPES = ("all_gather", "p2p")

__all__ = ["SdpaDotProductAttention", "with_core_attention", "uses_core_attention", "gpt_local_sdpa_layer_spec"]


class SdpaDotProductAttention(MegatronModule):
    """megatron-core's ``DotProductAttention`` interface computed by
    ``torch.nn.functional.scaled_dot_product_attention``; see the module docstring."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        window = getattr(config, "window_size", None)
        if window is not None:
            raise NotImplementedError("--attention-backend sdpa does not support sliding-window attention")
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            raise NotImplementedError(f"--attention-backend sdpa supports softmax_type 'vanilla' only (got {softmax_type!r})")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"--context-parallel-size {config.context_parallel_size} but the attention's context-parallel group "
                f"has {cp_size} ranks"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        # The effective scale of megatron's softmax: apply_query_key_layer_scaling divides the
        # scores by the layer number and multiplies them back in the softmax.
        self.softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_comm_type = "all_gather" if cp_comm_type is None else cp_comm_type
        if cp_size > 1:
            if self.cp_comm_type not in CP_COMM_TYPES:
                raise NotImplementedError(
                    f"--cp-comm-type {self.cp_comm_type!r} with --attention-backend sdpa is not built "
                    f"(choose one of {', '.join(CP_COMM_TYPES)})"
                )
            if attn_mask_type != AttnMaskType.causal:
                raise NotImplementedError(
                    f"--context-parallel-size {cp_size} with --attention-backend sdpa supports causal attention only "
                    f"(GPT), not {attn_mask_type.name} (BERT's padding mask)"
                )
            if self.dropout_p > 0.0:
                raise NotImplementedError(
                    f"--context-parallel-size {cp_size} with --attention-backend sdpa needs --attention-dropout 0 "
                    f"(got {self.dropout_p})"
                )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        **extra_kwargs,
    ) -> torch.Tensor:
        """``[sq, b, heads, d]`` query, ``[sk, b, groups, d]`` key and value -> ``[sq, b, heads * d]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("--attention-backend sdpa supports neither attention_bias nor packed sequences")
        if extra_kwargs:
            raise NotImplementedError(f"--attention-backend sdpa: unexpected core-attention arguments {sorted(extra_kwargs)}")
        heads, groups = query.size(2), key.size(2)
        causal = self.attn_mask_type == AttnMaskType.causal
        if self.cp_group is not None and self.cp_group.size() > 1:
            return self._context_parallel(query, key, value)
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attends
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        gqa = heads != groups
        if gqa and mask is not None:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
            gqa = False
        dropout_p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal and query.size(0) > 1,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, heads, sq, d] -> [sq, b, heads * d]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), heads * context.size(3))

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's ``[S / cp, b, heads, d]`` queries (its two chunks of megatron's split)
        against the whole sequence's keys and values (all-gathered over the context-parallel
        group), causally masked -> ``[S / cp, b, heads * d]``."""
        if self.cp_comm_type == "p2p":
            return ring_attention(query, key, value, self.cp_group, self.softmax_scale)
        heads, groups = query.size(2), key.size(2)
        key, value = gather_keys_values(key, value, self.cp_group)
        if heads != groups:  # head i reads group i // (heads / groups), as megatron does
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        parts = [
            F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], attn_mask=mask, scale=self.softmax_scale)
            for rows, keys, mask in causal_chunk_masks(k.size(2), self.cp_group.size(), self.cp_group.rank(), q.device)
        ]
        context = torch.cat(parts, dim=2)
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), heads * context.size(3))


def uses_core_attention(spec: ModuleSpec, core_attention) -> bool:
    """Whether the layer spec ``spec``'s self-attention uses ``core_attention``."""
    attention = getattr(spec.submodules, "self_attention", None)
    sub = getattr(attention, "submodules", None)
    return getattr(sub, "core_attention", None) is core_attention


def with_core_attention(spec: ModuleSpec, core_attention) -> ModuleSpec:
    """A copy of the transformer-layer spec ``spec`` whose self-attention uses
    ``core_attention`` (``spec`` itself is not changed: megatron's specs are module-level
    objects). ValueError if ``spec`` has no self-attention with a ``core_attention``."""
    attention = getattr(spec.submodules, "self_attention", None)
    sub = getattr(attention, "submodules", None)
    if not isinstance(attention, ModuleSpec) or not hasattr(sub, "core_attention"):
        raise ValueError(f"layer spec of {getattr(spec.module, '__name__', spec.module)} has no self_attention.core_attention")
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(sub, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))



#: megatron-core's local GPT layer spec (LayerNorm, no QK norm) with SDPA core attention, for
#: Megatron-LM's ``--spec megatron_bitpipe.model.sdpa_attention gpt_local_sdpa_layer_spec``
gpt_local_sdpa_layer_spec = with_core_attention(get_gpt_layer_local_spec(), SdpaDotProductAttention)
