"""Batched layers of a horizontally fused array of B models (HFTA) for megatron-core's local
GPT layers.

**Activation layout.** A fused activation is megatron's ``[s, b, h]`` with the models stacked
along the batch dimension: ``[s, B*b, h]``, model-major (rows ``k*b .. k*b + b - 1`` of the
batch dimension are model ``k``'s micro-batch). Everything megatron does per sample —
attention (its core attention, SDPA, rotary embeddings, masks), dropout, residual additions,
the cross entropy — therefore runs unchanged on a fused activation; only modules with weights
need the model dimension:

* :class:`HftaLinear` — megatron's column- and row-parallel linear (tensor-parallel size 1):
  weight ``[B, out, in]``, bias ``[B, out]``; one ``torch.bmm`` over the B models. With
  ``skip_bias_add`` the bias is returned as a ``[1, B*b, out]`` tensor that broadcasts over the
  fused activation exactly as megatron's ``[out]`` bias broadcasts over ``[s, b, out]``, so the
  bias-dropout-add and bias-activation code of megatron is used unchanged. Under BitPipe's split
  backward it follows megatron-core's weight-gradient deferral contract
  (:mod:`megatron_bitpipe.execution.weight_grad`): with ``delay_wgrad_compute`` on its config a
  backward queues the weight gradient in the linear's FIFO, and ``backward_dw()`` (reached
  through megatron's attention and MLP roll-up) runs the oldest;
* :class:`HftaNorm` — LayerNorm / RMSNorm with weight (and bias) ``[B, h]``;
* :class:`HftaEmbedding` — word and learned position embeddings ``[B, vocab, h]``,
  ``[B, positions, h]``: the same token ids for every model, the fused ``[s, B*b, h]`` out.

Every weight keeps the name megatron's layer gives it (``linear_fc1.weight``, ...), with one
leading dimension more: slice ``k`` is model ``k``'s tensor of the unfused model
(:mod:`megatron_bitpipe.hfta.extract` relies on it). Every parameter is marked
``model_dim = True``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from ..execution.weight_grad import WeightGradQueue, accumulate_weight_grad

__all__ = ["HftaLinear", "HftaNorm", "HftaEmbedding", "fused", "unfused"]


def _parameter(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(*shape, dtype=dtype))
    param.model_dim = True
    return param


def unfused(x: torch.Tensor, num_models: int) -> torch.Tensor:
    """``[s, B*b, ...]`` -> ``[B, s*b, ...]`` (each model's tokens in megatron's ``s, b`` order)."""
    s, bb = x.shape[:2]
    return x.reshape(s, num_models, bb // num_models, *x.shape[2:]).transpose(0, 1).reshape(num_models, s * (bb // num_models), *x.shape[2:])


def fused(y: torch.Tensor, s: int) -> torch.Tensor:
    """``[B, s*b, ...]`` -> ``[s, B*b, ...]`` (inverse of :func:`unfused`)."""
    num_models, sb = y.shape[:2]
    return y.reshape(num_models, s, sb // s, *y.shape[2:]).transpose(0, 1).reshape(s, num_models * (sb // s), *y.shape[2:]).contiguous()


def _per_model(vector: torch.Tensor, batch: int) -> torch.Tensor:
    """``[B, n]`` -> ``[1, B*batch, n]``: each model's row repeated over its batch rows."""
    num_models, n = vector.shape
    return vector[:, None, :].expand(num_models, batch, n).reshape(1, num_models * batch, n)


class _Sharded(torch.nn.Module):
    """``sharded_state_dict`` of a module without tensor-parallel splits (distributed checkpoints):
    megatron's default for plain modules, which megatron's ``MLP`` does not apply to its linears."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(own, prefix, {}, sharded_offsets, dp_cp_group=metadata["dp_cp_group"])


class _DeferredWeightGradBmm(torch.autograd.Function):
    """The batched GEMM of :class:`HftaLinear` under the split backward: the backward returns the
    input gradient and queues the weight gradient's computation in ``queue`` (run by the linear's
    ``backward_dw``, in ``W``), which accumulates it into ``holder.param`` through its gradient
    accumulator. ``weight`` arrives detached; ``holder`` is a plain object, so the Parameter is
    no autograd input."""

    @staticmethod
    def forward(ctx, input_, weight, holder, queue):
        ctx.save_for_backward(input_, weight)
        ctx.holder, ctx.queue = holder, queue
        return fused(torch.bmm(unfused(input_, weight.shape[0]), weight.transpose(1, 2)), input_.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        b = weight.shape[0]
        grad_b = unfused(grad_output, b)
        grad_input = fused(torch.bmm(grad_b, weight), input_.shape[0])
        param = ctx.holder.param

        def weight_grad() -> None:
            accumulate_weight_grad(param, torch.bmm(grad_b.transpose(1, 2), unfused(input_, b)))

        ctx.queue.push(param, weight_grad)
        return grad_input, None, None, None


class _Holder:
    def __init__(self, param):
        self.param = param


class HftaLinear(_Sharded):
    """B linears ``y_k = x_k W_k^T (+ b_k)`` as one batched GEMM, with the interface of
    megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` at tensor-parallel size 1.

    ``forward(input [s, B*b, in], weight=None)`` returns ``(output [s, B*b, out], bias)``:
    ``bias`` is None unless ``skip_bias_add`` (then ``[1, B*b, out]``, see the module
    docstring). ``weight`` (``[B, out, in]``) replaces the own weight, as megatron's tied output
    layer passes the word embeddings; ``skip_weight_param_allocation`` allocates none.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        bias: bool = True,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        num_models: int,
        tp_group=None,
        **megatron_kwargs,
    ):
        super().__init__()
        if tp_group is not None and tp_group.size() > 1:
            raise ValueError("HFTA's batched linears support tensor-parallel size 1 only")
        self.num_models, self.input_size, self.output_size = num_models, input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = False
        self.config = config
        #: the weight-gradient FIFO of megatron-core's deferral contract (used with ``delay_wgrad_compute``)
        self.wgrad_queue = WeightGradQueue(type(self).__name__)
        dtype = config.params_dtype
        self.weight = None if skip_weight_param_allocation else _parameter(num_models, output_size, input_size, dtype=dtype)
        self.bias = _parameter(num_models, output_size, dtype=dtype) if bias else None
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()
        # as megatron's linears: a state dict without "_extra_state" loads (GPTModel drops the
        # tied output layer's from its distributed checkpoints)
        self._register_load_state_dict_pre_hook(lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    def get_extra_state(self) -> None:
        """None, as megatron's linears store: checkpoints hold the same ``_extra_state`` entries."""
        return None

    def set_extra_state(self, state) -> None:
        """Nothing to restore (see :meth:`get_extra_state`)."""

    def backward_dw(self) -> None:
        """Run the oldest queued weight gradient (megatron-core's deferral contract)."""
        self.wgrad_queue.backward_dw()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        s, bb = input_.shape[:2]
        batch = bb // self.num_models
        defer = getattr(self.config, "delay_wgrad_compute", False)
        if defer and torch.is_grad_enabled() and weight.requires_grad:
            out = _DeferredWeightGradBmm.apply(input_, weight.detach(), _Holder(weight), self.wgrad_queue)
        else:
            out = fused(torch.bmm(unfused(input_, self.num_models), weight.transpose(1, 2)), s)
        if self.bias is None:
            return out, None
        bias = _per_model(self.bias, batch)
        if self.skip_bias_add:
            return out, bias
        return out + bias, None


class HftaNorm(_Sharded):
    """B LayerNorms (or RMSNorms, ``config.normalization``) over the last dimension, weight and
    bias ``[B, h]``; megatron's norm constructor arguments."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *, num_models: int, **megatron_kwargs):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"HFTA supports LayerNorm and RMSNorm, not {config.normalization}")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("HFTA does not support zero-centered gamma")
        self.num_models, self.hidden_size, self.eps = num_models, hidden_size, eps
        self.rms = config.normalization == "RMSNorm"
        self.weight = _parameter(num_models, hidden_size, dtype=config.params_dtype)
        self.bias = None if self.rms else _parameter(num_models, hidden_size, dtype=config.params_dtype)
        with torch.no_grad():
            self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden_size,)
        normed = F.rms_norm(x, shape, eps=self.eps) if self.rms else F.layer_norm(x, shape, eps=self.eps)
        batch = x.shape[1] // self.num_models
        out = normed * _per_model(self.weight, batch)
        return out if self.bias is None else out + _per_model(self.bias, batch)


class _Table(torch.nn.Module):
    """One embedding table per model: ``weight [B, rows, h]``."""

    def __init__(self, num_models: int, rows: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _parameter(num_models, rows, hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [b, s]`` -> ``[B, b, s, h]``."""
        rows = self.weight.index_select(1, ids.reshape(-1))
        return rows.view(self.weight.shape[0], *ids.shape, self.weight.shape[2])


class HftaEmbedding(torch.nn.Module):
    """megatron's ``LanguageModelEmbedding`` (word + learned absolute position embeddings,
    dropout) for B models: ``forward(input_ids [b, s], position_ids)`` -> ``[s, B*b, h]``."""

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, position_embedding_type: str, num_models: int):
        super().__init__()
        self.config, self.num_models = config, num_models
        dtype = config.params_dtype
        self.word_embeddings = _Table(num_models, vocab_size, config.hidden_size, dtype)
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            self.position_embeddings = _Table(num_models, max_sequence_length, config.hidden_size, dtype)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids=None) -> torch.Tensor:
        if tokentype_ids is not None:
            raise ValueError("HFTA embeddings have no token types")
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids)
        b, s = input_ids.shape
        # [B, b, s, h] -> [s, B*b, h], model-major
        embeddings = embeddings.permute(2, 0, 1, 3).reshape(s, self.num_models * b, -1).contiguous()
        return self.embedding_dropout(embeddings)
