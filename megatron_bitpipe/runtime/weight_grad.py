"""Split backward (zero-bubble style): input gradient now, weight gradients later.

A plan may run the backward of a (chunk, micro-batch) as two actions: ``I`` computes the
input gradient (what the previous stage waits for) and ``W``, later, the weight gradients.
This module provides the runtime side for megatron-core's local tensor-parallel linears:

* :class:`WeightGradWork` — the deferred weight-gradient closures of one
  (chunk, micro-batch), run in the order they were deferred by :meth:`WeightGradWork.run`.
* :func:`deferring` — the deferral context. The executor enters it around the ``F`` of a
  micro-batch whose backward is split, and again around its ``I`` (activation
  recomputation replays forwards inside the backward). A linear whose forward runs inside
  it builds a graph whose backward computes the input (and bias) gradient at once and adds
  the weight gradient to the context's work instead of computing it. Outside the context
  the linear runs megatron-core's own function: nothing changes for ``B``, other schedules
  or evaluation.
* :func:`enable_split_backward` — installs the deferrable forward on every
  ``ColumnParallelLinear``/``RowParallelLinear`` of the chunks (instance attribute
  ``_forward_impl``; idempotent; megatron's classes and globals are not touched).

Why the decision is taken at forward time: megatron DDP registers a post-hook on every
parameter's gradient accumulator that asserts a gradient exists; the accumulator (and the
hook) runs whenever the weight is an autograd input of a node, even if that node returns
no gradient for it. So a weight whose gradient is deferred enters the linear's autograd
function detached, and ``W`` later feeds the gradient to the weight's own accumulator
(``torch.autograd.backward(weight, grad)``): ``.grad`` accumulation, megatron DDP's hook
(``main_grad += grad``), tied weights (the LM head using the embedding's Parameter: the
embedding's contribution arrives in ``I``, the head's in ``W``) all behave as for a
gradient produced by autograd. With ``gradient_accumulation_fusion`` ``W`` adds into
``weight.main_grad`` with megatron's fused kernel, as megatron's backward does.

Invariants:

* math and communication equal megatron's ``LinearWithGradAccumulationAndAsyncCommunication``:
  sequence-parallel all-gather of the input in forward, ``allreduce_dgrad`` all-reduce or
  sequence-parallel reduce-scatter of the input gradient in ``I``, bias gradient in ``I``;
* ``W`` holds the linear's local input and its output gradient from ``I`` until it runs; with
  sequence parallelism it re-gathers the input over the tensor-parallel group (as megatron's
  backward does) instead of keeping the ``tp`` times larger gathered copy. Tensor-parallel
  ranks of a stage run the same plan, so their ``W`` gathers line up;
* every deferred closure runs exactly once; a :class:`WeightGradWork` is empty after ``run``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from megatron.core.parallel_state import get_global_memory_buffer
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    custom_bwd,
    custom_fwd,
    dist_all_gather_func,
    dist_reduce_scatter_func,
)
from megatron.core.utils import get_tensor_model_parallel_group_if_none, prepare_input_tensors_for_wgrad_compute

from .. import megatron_compat
from ..optimus.layers import OptimusLinear

__all__ = [
    "WeightGradWork",
    "deferring",
    "active_work",
    "accumulate_weight_grad",
    "enable_split_backward",
    "SplitBackwardError",
]


class SplitBackwardError(ValueError):
    """The model has layers whose weight gradients cannot be deferred."""


class WeightGradWork:
    """The deferred weight-gradient work of one (chunk, micro-batch): ``(weight, closure)``
    pairs in the order the backward deferred them."""

    def __init__(self) -> None:
        self._items: List[Tuple[torch.Tensor, Callable[[], None]]] = []

    def add(self, weight: torch.Tensor, closure: Callable[[], None]) -> None:
        self._items.append((weight, closure))

    def weights(self) -> Iterator[torch.Tensor]:
        """The parameters the pending closures will add gradients to."""
        return (weight for weight, _ in self._items)

    def run(self) -> None:
        """Run every pending closure once, in deferral order (each frees what it held)."""
        items, self._items = self._items, []
        for _, closure in items:
            closure()

    def __len__(self) -> int:
        return len(self._items)


_ACTIVE: Optional[WeightGradWork] = None


def active_work() -> Optional[WeightGradWork]:
    """The work of the innermost :func:`deferring` context, or None outside one."""
    return _ACTIVE


@contextlib.contextmanager
def deferring(work: WeightGradWork):
    """Weight gradients of deferrable layers whose forward runs in here go to ``work``.

    A module global, not thread-local: on a GPU autograd replays recomputed forwards on its
    own thread while the caller waits inside the backward.
    """
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, work
    try:
        yield work
    finally:
        _ACTIVE = previous


class _DeferredWeightGradLinear(torch.autograd.Function):
    """megatron's linear with async communication; the weight gradient goes to ``work``.

    ``weight`` arrives detached (no autograd edge, see the module docstring); ``target``
    names the Parameter (or tied Parameter) that ``W`` accumulates into — inside a plain
    object, since every tensor argument of ``apply`` would become an autograd input.
    """

    @staticmethod
    @custom_fwd
    def forward(ctx, input, weight, bias, target, fusion, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.target, ctx.fusion = target, fusion
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        if ctx.sequence_parallel:
            assert not ctx.allreduce_dgrad
            scattered = torch.empty_like(input)
            handle = dist_reduce_scatter_func(scattered, grad_input, group=ctx.tp_group, async_op=True)
            grad_input = scattered
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        param = ctx.target.param
        closure = _weight_grad_closure(param, input, grad_output, ctx.fusion, ctx.sequence_parallel, ctx.tp_group)
        ctx.target.work.add(param, closure)
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None, None, None, None


@dataclass(frozen=True)
class _Target:
    """Where a deferred weight gradient goes: ``param``'s gradient, through ``work``."""

    param: torch.nn.Parameter
    work: WeightGradWork


def _gather_sequence(input: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather ``input`` along dim 0 over ``tp_group`` into megatron's global "mpu" buffer."""
    shape = list(input.size())
    shape[0] *= tp_group.size()
    total = get_global_memory_buffer().get_tensor(shape, input.dtype, "mpu")
    dist_all_gather_func(total, input, group=tp_group)
    return total


def _weight_grad_closure(param, input, grad_output, fusion: bool, sequence_parallel: bool, tp_group) -> Callable[[], None]:
    """``W`` of one linear call: ``param``'s gradient += grad_outputᵀ · total_input."""

    def weight_grad() -> None:
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        if fusion and hasattr(param, "main_grad"):
            _fused_accumulate(input_2d, grad_2d, param.main_grad)
        else:
            accumulate_weight_grad(param, grad_2d.t().matmul(input_2d))

    return weight_grad


def accumulate_weight_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param`` as autograd would: through its gradient accumulator, so
    ``.grad`` accumulates and the hooks on it (megatron DDP's ``main_grad += grad``) run."""
    torch.autograd.backward(param, grad)


def _fused_accumulate(input_2d, grad_2d, main_grad) -> None:
    """megatron's gradient-accumulation-fusion kernel: ``main_grad += grad_2dᵀ · input_2d``."""
    kernel = megatron_layers.fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(input_2d, grad_2d, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(input_2d, grad_2d, main_grad)
    else:
        raise RuntimeError(f"gradient accumulation fusion does not support {main_grad.dtype} gradients")


class _DeferrableForwardImpl:
    """``_forward_impl`` of one linear: megatron's own outside :func:`deferring`, the
    deferred-weight-gradient function inside it.

    Keywords newer megatron-core releases add to the call (``gtp_remat_size`` in 0.19) go to
    megatron's function unchanged; deferring needs them at their neutral values
    (:func:`~megatron_bitpipe.megatron_compat.linear_call_is_plain`).
    """

    def __init__(self, original: Callable):
        self.original = original

    def __call__(
        self,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer=None,
        wgrad_deferral_limit=None,
        tp_group=None,
        **newer_keywords,
    ):
        work = active_work()
        if work is None or not weight.requires_grad:
            return self.original(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group,
                **newer_keywords,
            )
        if not megatron_compat.linear_call_is_plain(newer_keywords):
            raise SplitBackwardError(f"split backward cannot defer a linear called with {newer_keywords}")
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return _DeferredWeightGradLinear.apply(
            input, weight.detach(), bias, _Target(weight, work), gradient_accumulation_fusion, allreduce_dgrad,
            sequence_parallel, tp_group,
        )


def enable_split_backward(chunks: Sequence[torch.nn.Module]) -> int:
    """Make the weight gradients of every megatron-core local linear of ``chunks`` deferrable.

    Idempotent. Returns how many linears defer. Raises :class:`SplitBackwardError` (before
    changing anything) for layers whose weight gradients cannot be split: Transformer Engine
    layers (use ``--transformer-impl local``), Optimus 2D layers (``--tensor-parallel-mode
    optimus2d`` is not supported with the split backward), megatron's own embedding-wgrad
    deferral (``--defer-embedding-wgrad-compute``) and linears whose weight is sharded for
    rematerialisation (megatron-core 0.19's ``gtp_weight_remat_size`` > 1).
    """
    linears = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if "transformer_engine" in type(module).__module__:
                raise SplitBackwardError(
                    f"split backward: {name} is a Transformer Engine layer ({type(module).__name__}); "
                    "pass --transformer-impl local"
                )
            if isinstance(module, OptimusLinear):
                raise SplitBackwardError(
                    f"split backward: {name} is an Optimus 2D layer; --tensor-parallel-mode optimus2d is not "
                    "supported with the split backward (use --tensor-parallel-mode 1d)"
                )
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                if getattr(module.config, "defer_embedding_wgrad_compute", False):
                    raise SplitBackwardError(
                        "split backward defers every weight gradient itself: drop --defer-embedding-wgrad-compute"
                    )
                if megatron_compat.linear_weight_shards(module) > 1:
                    raise SplitBackwardError(
                        f"split backward: {name} shards its weight for rematerialisation (gtp_weight_remat_size > 1), "
                        "which the deferred weight gradients do not support"
                    )
                linears.append(module)
    for module in linears:
        if not isinstance(module.__dict__.get("_forward_impl"), _DeferrableForwardImpl):
            module._forward_impl = _DeferrableForwardImpl(module._forward_impl)
    return len(linears)
