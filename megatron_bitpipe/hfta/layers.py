"""Batched layers of a horizontally fused array of B models (HFTA) for megatron-core's local
GPT layers, with megatron's tensor (and sequence) parallelism.

**Activation layout.** A fused activation is megatron's ``[s, b, h]`` with the models stacked
along the batch dimension: ``[s, B*b, h]``, model-major (rows ``k*b .. k*b + b - 1`` of the
batch dimension are model ``k``'s micro-batch). Everything megatron does per sample —
attention (its core attention, SDPA, rotary embeddings, masks), dropout, residual additions,
the (vocabulary-parallel) cross entropy — therefore runs unchanged on a fused activation; only
modules with weights need the model dimension. With sequence parallelism the sequence
dimension (dim 0) is split over the tensor-parallel ranks, ``[s/tp, B*b, h]``, as megatron
splits ``[s, b, h]``: megatron's own gathers and scatters along dim 0 apply unchanged.

**Tensor parallelism** (size ``tp``, megatron's semantics and megatron-core's mappings,
:mod:`megatron.core.tensor_parallel.mappings`; every tensor below is this rank's block):

* :class:`HftaLinear` — megatron's ``ColumnParallelLinear`` (``parallel_mode="column"``):
  weight ``[B, out/tp, in]``, bias ``[B, out/tp]``; the input enters through megatron's
  copy to the tensor-parallel region (all-gathered along the sequence with sequence
  parallelism), the output ``[s, B*b, out/tp]`` stays split unless ``gather_output``.
  ``RowParallelLinear`` (``parallel_mode="row"``): weight ``[B, out, in/tp]``, bias ``[B,
  out]`` (not split, marked ``sequence_parallel`` like megatron's), input ``[s, B*b, in/tp]``,
  output summed over the tensor-parallel ranks (reduce-scattered along the sequence with
  sequence parallelism) before the bias. One ``torch.bmm`` over the B models either way. With
  ``skip_bias_add`` the bias is returned as a ``[1, B*b, n]`` tensor that broadcasts over
  the fused activation exactly as megatron's ``[n]`` bias broadcasts over ``[s, b, n]``, so the
  bias-dropout-add and bias-activation code of megatron is used unchanged. Under BitPipe's split
  backward it follows megatron-core's weight-gradient deferral contract
  (:mod:`megatron_bitpipe.execution.weight_grad`): with ``delay_wgrad_compute`` on its config a
  backward queues the weight gradient in the linear's FIFO (from the GEMM's input, the
  sequence-gathered one with sequence parallelism), and ``backward_dw()`` (reached through
  megatron's attention and MLP roll-up) runs the oldest;
* :class:`HftaNorm` — LayerNorm / RMSNorm with weight (and bias) ``[B, h]``, not split; marked
  ``sequence_parallel = config.sequence_parallel`` like megatron's norms, so megatron's
  ``finalize_model_grads`` sums their gradients over the tensor-parallel ranks;
* :class:`HftaEmbedding` — megatron's ``LanguageModelEmbedding``: word embeddings ``[B,
  vocab/tp, h]`` split over the vocabulary like ``VocabParallelEmbedding`` (rank ``r`` holds
  rows ``r*vocab/tp ..``; other ids give zeros, summed over the tensor-parallel ranks), learned
  position embeddings ``[B, positions, h]`` not split; the same token ids for every model, the
  fused ``[s, B*b, h]`` out (``[s/tp, B*b, h]`` with sequence parallelism).

Every weight keeps the name megatron's layer gives it (``linear_fc1.weight``, ...), with one
leading dimension more: slice ``k`` is model ``k``'s tensor of the unfused model
(:mod:`megatron_bitpipe.hfta.extract` relies on it). Every parameter is marked
``model_dim = True``; split ones carry megatron's ``tensor_model_parallel``,
``partition_dim`` (megatron's dimension + 1, the model dimension coming first) and
``partition_stride``, and checkpoints (``sharded_state_dict``) shard them along that axis, so a
fused checkpoint loads at any tensor-parallel size.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none

from ..execution.weight_grad import WeightGradQueue, accumulate_weight_grad

__all__ = ["HftaLinear", "HftaNorm", "HftaEmbedding", "fused", "unfused"]


def _parameter(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(*shape, dtype=dtype))
    param.model_dim = True
    return param


def _split(param: torch.nn.Parameter, megatron_dim: int, stride: int = 1) -> torch.nn.Parameter:
    """Mark ``param`` split over the tensor-parallel ranks along megatron's dimension
    ``megatron_dim`` of the unfused tensor (megatron's ``set_tensor_model_parallel_attributes``;
    the fused tensor's axis is one more)."""
    tensor_parallel.set_tensor_model_parallel_attributes(param, True, megatron_dim + 1, stride)
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
    """``sharded_state_dict`` (distributed checkpoints) of a module whose tensors ``tp_axes``
    (state-dict name -> axis of the fused tensor) are split over ``self.tp_group`` and the rest
    replicated: megatron's ``make_sharded_tensors_for_checkpoint``, which megatron's ``MLP``
    calls its linears for by name."""

    tp_axes: Dict[str, int] = {}
    tp_group = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            own, prefix, self.tp_axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )


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
    """B linears ``y_k = x_k W_k^T (+ b_k)`` as one batched GEMM, with the interface and the
    tensor parallelism of megatron's ``ColumnParallelLinear`` (``parallel_mode="column"``) or
    ``RowParallelLinear`` (``"row"``); shapes in the module docstring.

    ``forward(input, weight=None)`` returns ``(output, bias)``: column ``[s, B*b, in]`` ->
    ``[s, B*b, out/tp]`` (``out`` with ``gather_output``; the input ``[s/tp, B*b, in]`` with
    sequence parallelism), row ``[s, B*b, in/tp]`` -> ``[s, B*b, out]`` (``[s/tp, B*b, out]``
    with sequence parallelism). ``bias`` is None unless ``skip_bias_add`` (then ``[1, B*b,
    n]``, see the module docstring). ``weight`` (``[B, out/tp, in]``) replaces the own weight,
    as megatron's tied output layer passes the word embeddings; ``skip_weight_param_allocation``
    allocates none.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        num_models: int,
        parallel_mode: str,
        bias: bool = True,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        stride: int = 1,
        is_expert: bool = False,
        tp_group=None,
        **megatron_kwargs,
    ):
        super().__init__()
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode must be 'column' or 'row', not {parallel_mode!r}")
        if is_expert:
            raise ValueError("HFTA's batched linears are no expert layers")
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        tp = get_pg_size(self.tp_group)
        column = parallel_mode == "column"
        if input_size % (1 if column else tp) or output_size % (tp if column else 1):
            raise ValueError(f"a {parallel_mode}-parallel linear {input_size} -> {output_size} does not split over {tp} ranks")
        self.parallel_mode, self.num_models, self.input_size, self.output_size = parallel_mode, num_models, input_size, output_size
        self.skip_bias_add, self.gather_output, self.input_is_parallel = skip_bias_add, gather_output, input_is_parallel
        self.sequence_parallel = config.sequence_parallel and tp > 1
        if self.sequence_parallel and not column and not input_is_parallel:
            raise ValueError("a row-parallel linear with sequence parallelism needs input_is_parallel")
        self.config = config
        #: the weight-gradient FIFO of megatron-core's deferral contract (used with ``delay_wgrad_compute``)
        self.wgrad_queue = WeightGradQueue(type(self).__name__)
        dtype = config.params_dtype
        out_local, in_local = (output_size // tp, input_size) if column else (output_size, input_size // tp)
        self.weight_shape = (num_models, out_local, in_local)
        self.weight = None
        if not skip_weight_param_allocation:
            self.weight = _split(_parameter(*self.weight_shape, dtype=dtype), 0 if column else 1, stride)
        self.bias = _parameter(num_models, out_local, dtype=dtype) if bias else None
        if self.bias is not None:
            if column:
                _split(self.bias, 0, stride)
            else:
                self.bias.sequence_parallel = config.sequence_parallel
            with torch.no_grad():
                self.bias.zero_()
        self.tp_axes = {"weight": 1, "bias": 1} if column else {"weight": 2}
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

    def _bmm(self, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``[s', B*b, in']`` x ``[B, out', in']`` -> ``[s', B*b, out']``, the weight gradient
        deferred under ``delay_wgrad_compute``."""
        if getattr(self.config, "delay_wgrad_compute", False) and torch.is_grad_enabled() and weight.requires_grad:
            return _DeferredWeightGradBmm.apply(input_, weight.detach(), _Holder(weight), self.wgrad_queue)
        return fused(torch.bmm(unfused(input_, self.num_models), weight.transpose(1, 2)), input_.shape[0])

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if weight.shape != self.weight_shape:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {self.weight_shape} as expected")
        batch = input_.shape[1] // self.num_models
        bias = None if self.bias is None else _per_model(self.bias, batch)
        group = self.tp_group
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                input_ = mappings.gather_from_sequence_parallel_region(input_, group=group)
            else:
                input_ = mappings.copy_to_tensor_model_parallel_region(input_, group=group)
            out = self._bmm(input_, weight)
            if bias is not None and not self.skip_bias_add:
                out, bias = out + bias, None
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather:
                out = mappings.gather_from_tensor_model_parallel_region(out, group=group)
            return out, bias
        if not self.input_is_parallel:
            input_ = mappings.scatter_to_tensor_model_parallel_region(input_, group=group)
        out = self._bmm(input_, weight)
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, group=group)
        else:
            out = mappings.reduce_from_tensor_model_parallel_region(out, group=group)
        if bias is None or self.skip_bias_add:
            return out, bias
        return out + bias, None


class HftaNorm(torch.nn.Module):
    """B LayerNorms (or RMSNorms, ``config.normalization``) over the last dimension, weight and
    bias ``[B, h]`` (marked ``sequence_parallel``, see the module docstring); megatron's norm
    constructor arguments. Checkpointed by its parent as megatron's plain torch norms are
    (replicated over the tensor-parallel ranks)."""

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
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

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
        """``ids [b, s]`` (row numbers of this table) -> ``[B, b, s, h]``."""
        rows = self.weight.index_select(1, ids.reshape(-1))
        return rows.view(self.weight.shape[0], *ids.shape, self.weight.shape[2])


class HftaEmbedding(_Sharded):
    """megatron's ``LanguageModelEmbedding`` (vocabulary-parallel word embeddings + learned
    absolute position embeddings, dropout) for B models: ``forward(input_ids [b, s],
    position_ids)`` -> ``[s, B*b, h]`` (``[s/tp, B*b, h]`` with sequence parallelism and
    ``scatter_to_sequence_parallel``); layout in the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str,
        num_models: int,
        tp_group=None,
        scatter_to_sequence_parallel: bool = True,
    ):
        super().__init__()
        self.config, self.num_models = config, num_models
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        self.vocab_start, self.vocab_end = VocabUtility.vocab_range_from_global_vocab_size(
            vocab_size, get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        )
        dtype = config.params_dtype
        self.word_embeddings = _Table(num_models, self.vocab_end - self.vocab_start, config.hidden_size, dtype)
        _split(self.word_embeddings.weight, 0)
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            self.position_embeddings = _Table(num_models, max_sequence_length, config.hidden_size, dtype)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        # megatron's rule: without position embeddings the word embeddings' sum over the
        # tensor-parallel ranks is reduce-scattered straight into the sequence-parallel region
        self.reduce_scatter_embeddings = not self.add_position_embedding and config.sequence_parallel and scatter_to_sequence_parallel
        self.tp_axes = {"word_embeddings.weight": 1}

    def _fused(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``[B, b, s, h]`` -> ``[s, B*b, h]``, model-major."""
        num_models, b, s, h = embeddings.shape
        return embeddings.permute(2, 0, 1, 3).reshape(s, num_models * b, h).contiguous()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids=None) -> torch.Tensor:
        if tokentype_ids is not None:
            raise ValueError("HFTA embeddings have no token types")
        group = self.tp_group
        if get_pg_size(group) > 1:  # ids of other ranks' rows: row 0, zeroed
            outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
            words = self.word_embeddings((input_ids - self.vocab_start).masked_fill(outside, 0))
            words = words.masked_fill(outside[None, :, :, None], 0.0)
        else:
            words = self.word_embeddings(input_ids)
        if self.reduce_scatter_embeddings:
            embeddings = mappings.reduce_scatter_to_sequence_parallel_region(self._fused(words), group=group)
        else:
            embeddings = mappings.reduce_from_tensor_model_parallel_region(words, group=group)
            if self.add_position_embedding:
                embeddings = embeddings + self.position_embeddings(position_ids)
            embeddings = self._fused(embeddings)
        if not self.config.sequence_parallel:
            return self.embedding_dropout(embeddings)
        if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
            embeddings = mappings.scatter_to_sequence_parallel_region(embeddings, group=group)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.embedding_dropout(embeddings)
