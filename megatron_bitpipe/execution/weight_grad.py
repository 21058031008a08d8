"""Split backward (zero-bubble style): input gradient now, weight gradients later —
through megatron-core's weight-gradient deferral contract (the one it uses for Transformer
Engine).

A plan may run the backward of a (chunk, micro-batch) as two actions: ``I`` computes the
input gradient (what the previous stage waits for) and ``W``, later, the weight gradients.
The contract, as megatron-core 0.16-0.19 wire it for TE's linears:

* ``delay_wgrad_compute`` on the model config
  (:func:`~megatron_bitpipe.megatron_compat.enable_delay_wgrad_compute`) makes a linear's
  backward leave its weight gradient out and queue the work instead;
* every deferring linear keeps a FIFO of that work, one entry per backward it ran;
  ``linear.backward_dw()`` runs the oldest entry;
* megatron-core rolls ``backward_dw()`` up: ``SelfAttention.backward_dw`` (QKV, output
  projection), ``MLP.backward_dw`` (fc2, fc1), ``MoELayer.backward_dw`` (each routed expert's
  MLP, and its shared experts when asked: asked here); :class:`ChunkWeightGrad` rolls those up per
  transformer layer and, with the deferring linears outside layers (the LM head), per chunk.
  One ``ChunkWeightGrad.backward_dw()`` = one micro-batch's weight gradients of the chunk, the
  oldest (the validator makes each chunk's ``W``'s follow its ``I``'s micro-batch order).

This module gives megatron-core's *local* tensor-parallel linears that contract
(:func:`enable_split_backward`: an instance ``_forward_impl`` and ``backward_dw`` and a
:class:`WeightGradQueue` per linear; megatron's classes and globals untouched) and accepts
modules that bring their own (Transformer Engine's ``Linear``/``LayerNormLinear``/... built
with ``delay_wgrad_compute``: ``need_backward_dw()``, ``backward_dw()``, a FIFO
``wgrad_store``).

Why a local linear decides at forward time: megatron DDP registers a post-hook on every
parameter's gradient accumulator that asserts a gradient exists; the accumulator (and the
hook) runs whenever the weight is an autograd input of a node, even if that node returns
no gradient for it. So a deferring linear's autograd function does not take the weight as an
input at all (it reaches it through a plain object, with no autograd edge and no ``detach``),
and ``backward_dw`` later hands the gradient to what the accumulator would have run
(:class:`GradientSinks`): for a parameter of a megatron DDP, that DDP's own gradient hook,
called directly with ``param.grad`` set (``main_grad += grad``, ``grad`` cleared, the bucket
told the gradient is ready) — the whole backward's operators for the weight, one GEMM and one
add, with no autograd engine run per linear (which would also copy the gradient before the
hook adds it); for any other parameter, its gradient accumulator
(``torch.autograd.backward(weight, grad)``), so ``.grad`` accumulation and hooks behave as
for a gradient autograd produced. Tied weights (the LM head using the embedding's Parameter:
the embedding's contribution arrives in ``I``, the head's in ``W``) go to the embedding
Parameter's sink. With ``gradient_accumulation_fusion`` it adds into ``weight.main_grad``
with megatron's fused kernel and then does DDP's bookkeeping, as megatron's backward does.
(TE instead marks its deferred weights ``skip_backward_post_hook`` and megatron DDP, with its
own ``delay_wgrad_compute``, hooks them to the module's ``backward_dw``.)

Invariants:

* a local linear defers when its config has ``delay_wgrad_compute``, autograd records its
  forward and its weight requires a gradient; otherwise it runs megatron's own function;
* math and communication equal megatron's ``LinearWithGradAccumulationAndAsyncCommunication``:
  sequence-parallel all-gather of the input in forward, ``allreduce_dgrad`` all-reduce or
  sequence-parallel reduce-scatter of the input gradient in ``I``, bias gradient in ``I``;
* the deferring forward runs the plain forward's operators; ``I`` + ``W`` run the whole
  backward's, split in two (``scripts/bench_split.py`` counts them);
* a queued entry holds the linear's local input and its output gradient until it runs; with
  sequence parallelism it re-gathers the input over the tensor-parallel group (as megatron's
  backward does) instead of keeping the ``tp`` times larger gathered copy. Tensor-parallel
  ranks of a stage run the same plan, so their gathers line up;
* every queued entry runs exactly once: ``backward_dw()`` on an empty queue raises
  :class:`SplitBackwardError`, and :meth:`ChunkWeightGrad.pending` names what is left so the
  executor can refuse to end a step that would drop weight gradients.
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Iterator, List, Optional, Sequence, Tuple

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
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_tensor_model_parallel_group_if_none, prepare_input_tensors_for_wgrad_compute

from .. import megatron_compat
from ..optimus.layers import OptimusLinear

__all__ = [
    "WeightGradQueue",
    "GradientSinks",
    "ChunkWeightGrad",
    "accumulate_weight_grad",
    "enable_split_backward",
    "queued_weight_work",
    "SplitBackwardError",
]


class SplitBackwardError(ValueError):
    """The model has layers whose weight gradients cannot be deferred, or the deferred work
    was run out of step (``backward_dw`` with nothing queued, work left over)."""


class WeightGradQueue:
    """One module's FIFO of deferred weight-gradient work: one ``(parameter, closure)`` entry
    per backward of the module, run oldest first by :meth:`backward_dw`.

    ``name`` names the module in errors.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._entries: Deque[Tuple[torch.Tensor, Callable[[], None]]] = deque()

    def push(self, param: torch.Tensor, closure: Callable[[], None]) -> None:
        """Queue the weight work of one backward (called by the linear's backward)."""
        self._entries.append((param, closure))

    def backward_dw(self) -> None:
        """Run the oldest entry once (it frees what it held); SplitBackwardError if none is queued."""
        if not self._entries:
            raise SplitBackwardError(
                f"backward_dw() on {self.name}: no deferred weight-gradient work is queued "
                "(a W without its I, or a module the chunk's roll-up reaches twice)"
            )
        _, closure = self._entries.popleft()
        closure()

    def parameters(self) -> Iterator[torch.Tensor]:
        """The parameters the queued entries will add gradients to."""
        return (param for param, _ in self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def accumulate_weight_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param`` as autograd would: through its gradient accumulator, so
    ``.grad`` accumulates and the hooks on it (megatron DDP's ``main_grad += grad``) run."""
    torch.autograd.backward(param, grad)


class GradientSinks:
    """Where deferred weight gradients go, by parameter (see the module docstring).

    Built from the model chunks of one rank: a parameter of a megatron DDP among them goes to
    that DDP's own gradient hook (:func:`~megatron_bitpipe.megatron_compat.ddp_gradient_hooks`),
    any other parameter to its autograd gradient accumulator (:func:`accumulate_weight_grad`).
    Invariant: a gradient handed to :meth:`add` is added exactly once, where the whole
    backward would have added it.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module] = ()):
        self._hooks = {}
        for chunk in chunks:
            self._hooks.update(megatron_compat.ddp_gradient_hooks(chunk))

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (``param``'s shape) to ``param``'s gradient."""
        hook = self._hooks.get(param)
        if hook is None:
            accumulate_weight_grad(param, grad)
            return
        param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)  # autograd casts so too
        hook()

    def added_to_main_grad(self, param: torch.nn.Parameter) -> None:
        """After a fused kernel added ``param``'s gradient to ``param.main_grad``: DDP's
        bookkeeping only, as megatron's backward leaves it (``grad_added_to_main_grad`` and a
        placeholder gradient, which DDP's hook clears without adding)."""
        hook = self._hooks.get(param)
        if hook is not None:
            param.grad_added_to_main_grad = True
            param.grad = torch.empty_like(param)
            hook()


class _DeferredWeightGradLinear(torch.autograd.Function):
    """megatron's linear with async communication; the weight gradient goes to the linear's queue.

    The weight is not an argument (no autograd edge, see the module docstring): ``target``
    holds it, the queue and the gradient sinks — inside a plain object, since every tensor
    argument of ``apply`` would become an autograd input.
    """

    @staticmethod
    @custom_fwd
    def forward(ctx, input, bias, target, fusion, allreduce_dgrad, sequence_parallel, tp_group):
        weight = target.param
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
            scattered = torch.empty(input.size(), dtype=input.dtype, device=input.device)  # megatron's allocation
            handle = dist_reduce_scatter_func(scattered, grad_input, group=ctx.tp_group, async_op=True)
            grad_input = scattered
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        target = ctx.target
        closure = _weight_grad_closure(target, input, grad_output, ctx.fusion, ctx.sequence_parallel, ctx.tp_group)
        target.queue.push(target.param, closure)
        if handle is not None:
            handle.wait()
        return grad_input, grad_bias, None, None, None, None, None


@dataclass(frozen=True)
class _Target:
    """Where a deferred weight gradient goes: ``param``'s gradient (through ``sinks``), queued
    on ``queue``."""

    param: torch.nn.Parameter
    queue: "WeightGradQueue"
    sinks: GradientSinks


def _gather_sequence(input: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather ``input`` along dim 0 over ``tp_group`` into megatron's global "mpu" buffer."""
    shape = list(input.size())
    shape[0] *= tp_group.size()
    total = get_global_memory_buffer().get_tensor(shape, input.dtype, "mpu")
    dist_all_gather_func(total, input, group=tp_group)
    return total


def _weight_grad_closure(target: _Target, input, grad_output, fusion: bool, sequence_parallel: bool, tp_group) -> Callable[[], None]:
    """The weight work of one linear backward: ``target.param``'s gradient += grad_outputᵀ · total_input."""

    def weight_grad() -> None:
        param = target.param
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        if fusion and hasattr(param, "main_grad"):
            _fused_accumulate(input_2d, grad_2d, param.main_grad)
            target.sinks.added_to_main_grad(param)
        else:
            target.sinks.add(param, grad_2d.t().matmul(input_2d))

    return weight_grad


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
    """``_forward_impl`` of one local linear: the deferred-weight-gradient function while
    ``config.delay_wgrad_compute`` is set and autograd records the call, megatron's own
    otherwise (evaluation, recompute's first pass under ``no_grad``, a model not split).

    Keywords newer megatron-core releases add to the call (``gtp_remat_size`` in 0.19) go to
    megatron's function unchanged; deferring needs them at their neutral values
    (:func:`~megatron_bitpipe.megatron_compat.linear_call_is_plain`).
    """

    def __init__(self, original: Callable, queue: WeightGradQueue, config, sinks: GradientSinks):
        self.original = original
        self.queue = queue
        self.config = config
        self.sinks = sinks

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
        defer = getattr(self.config, "delay_wgrad_compute", False) and torch.is_grad_enabled() and weight.requires_grad
        if not defer:
            return self.original(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group,
                **newer_keywords,
            )
        if not megatron_compat.linear_call_is_plain(newer_keywords):
            raise SplitBackwardError(f"split backward cannot defer a linear called with {newer_keywords}")
        if not input.requires_grad and not (bias is not None and bias.requires_grad):
            raise SplitBackwardError(
                f"split backward: {self.queue.name} gets an input that needs no gradient and has no bias: its weight "
                "would be the only autograd edge of its output, which a deferred weight gradient leaves out"
            )
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return _DeferredWeightGradLinear.apply(
            input, bias, _Target(weight, self.queue, self.sinks), gradient_accumulation_fusion, allreduce_dgrad,
            sequence_parallel, tp_group,
        )


# -- modules that bring the contract themselves (Transformer Engine) ----------------------------


def _self_deferring(module: torch.nn.Module) -> Optional[bool]:
    """For a module with its own deferral (Transformer Engine >= 2.3: ``need_backward_dw()``,
    or a ``wgrad_store`` with ``delay_wgrad_compute()``): whether it defers; None for others."""
    need = getattr(module, "need_backward_dw", None)
    if callable(need):
        return bool(need())
    store = getattr(module, "wgrad_store", None)
    if store is not None and callable(getattr(store, "delay_wgrad_compute", None)):
        return bool(store.delay_wgrad_compute())
    return None


def queued_weight_work(module: torch.nn.Module) -> Optional[int]:
    """How many entries a deferring module has queued: a :class:`WeightGradQueue`'s length,
    or the size of Transformer Engine's ``wgrad_store.context`` queue; None when it cannot be
    seen (TE's ``backward_dw`` itself returns silently on an empty queue)."""
    queue = module.__dict__.get("wgrad_queue")
    if isinstance(queue, WeightGradQueue):
        return len(queue)
    context = getattr(getattr(module, "wgrad_store", None), "context", None)
    size = getattr(context, "qsize", None)
    return size() if callable(size) else None


def _queued_parameters(module: torch.nn.Module) -> List[torch.Tensor]:
    """The parameters a deferring module's queued work adds to (a TE module: its own deferred ones)."""
    queue = module.__dict__.get("wgrad_queue")
    if isinstance(queue, WeightGradQueue):
        return list(queue.parameters())
    if queued_weight_work(module) == 0:
        return []
    return [p for p in module.parameters() if getattr(p, "skip_backward_post_hook", False)]


# -- roll-up ------------------------------------------------------------------------------------


class ChunkWeightGrad:
    """``backward_dw()`` of one model chunk: one micro-batch's deferred weight gradients, the oldest.

    Rolled up like megatron-core's own interface: each transformer layer's ``self_attention``
    and ``mlp`` (their ``backward_dw`` reach QKV / output projection and fc1 / fc2), then each
    deferring module outside them (the LM head) directly. ``modules`` are the chunk's modules
    that defer when this is built (after :func:`enable_split_backward`); ``units`` the
    ``(name, backward_dw)`` calls, in module order (run in reverse, as a backward would). Every
    deferring module must be reached exactly once per call — before, each must have work
    queued; after, each visible queue must be one shorter (SplitBackwardError otherwise).
    """

    def __init__(self, chunk: torch.nn.Module):
        self.modules: List[Tuple[str, torch.nn.Module]] = [
            (name, module) for name, module in chunk.named_modules() if _deferring(module)
        ]
        deferring = {id(module) for _, module in self.modules}
        covered = set()
        self.units: List[Tuple[str, Callable[[], None]]] = []
        for name, layer in chunk.named_modules():
            if not isinstance(layer, TransformerLayer):
                continue
            for part in ("self_attention", "cross_attention", "mlp"):
                unit = getattr(layer, part, None)
                inside = {id(m) for m in unit.modules()} & deferring if isinstance(unit, torch.nn.Module) else set()
                if inside and callable(getattr(unit, "backward_dw", None)):
                    self.units.append((f"{name}.{part}", _layer_part_backward_dw(unit)))
                    covered |= inside
        self.units += [(name, module.backward_dw) for name, module in self.modules if id(module) not in covered]

    @property
    def defers(self) -> bool:
        """Whether a backward of this chunk queues weight work now (it then needs ``backward_dw``)."""
        return any(_deferring(module) for _, module in self.modules)

    def backward_dw(self) -> None:
        """Run one queued micro-batch's weight gradients of every deferring module of the chunk."""
        before = {name: queued_weight_work(module) for name, module in self.modules}
        empty = [name for name, count in before.items() if count == 0]
        if empty:
            raise SplitBackwardError(f"backward_dw() with no deferred weight-gradient work queued in {', '.join(empty)}")
        for _, backward_dw in reversed(self.units):
            backward_dw()
        wrong = [
            f"{name} ({count} -> {queued_weight_work(module)})"
            for (name, module), count in zip(self.modules, before.values())
            if count is not None and queued_weight_work(module) != count - 1
        ]
        if wrong:
            raise SplitBackwardError(f"the chunk's backward_dw() must run each module's oldest entry once: {', '.join(wrong)}")

    def pending(self) -> List[Tuple[str, int]]:
        """``(module name, queued entries)`` of every deferring module with work queued (modules
        whose queue cannot be seen are left out)."""
        counts = [(name, queued_weight_work(module)) for name, module in self.modules]
        return [(name, count) for name, count in counts if count]

    def pending_parameters(self) -> Iterator[torch.Tensor]:
        """The parameters the queued work will add gradients to."""
        for _, module in self.modules:
            yield from _queued_parameters(module)


def _layer_part_backward_dw(unit: torch.nn.Module) -> Callable[[], None]:
    """``unit.backward_dw`` reaching all its deferring modules: a mixture-of-experts layer's
    (``MoELayer.backward_dw(routed_experts, shared_experts)``) for its routed and shared experts."""
    if "shared_experts" in inspect.signature(unit.backward_dw).parameters:
        return functools.partial(unit.backward_dw, routed_experts=True, shared_experts=True)
    return unit.backward_dw


def _deferring(module: torch.nn.Module) -> bool:
    """A module with a :class:`WeightGradQueue` (``wgrad_queue``: a local linear made
    deferrable here, the benchmarks' emulated layer) whose config asks, or a module deferring
    itself (Transformer Engine)."""
    if isinstance(module.__dict__.get("wgrad_queue"), WeightGradQueue):
        return bool(getattr(module.config, "delay_wgrad_compute", False))
    return bool(_self_deferring(module))


# -- enabling -----------------------------------------------------------------------------------


def enable_split_backward(chunks: Sequence[torch.nn.Module]) -> int:
    """Put every linear of ``chunks`` under the weight-gradient deferral contract.

    megatron-core local ``ColumnParallelLinear``/``RowParallelLinear``: an instance
    ``_forward_impl`` that defers and a ``backward_dw`` running its :class:`WeightGradQueue`
    (``wgrad_queue``); their config (and that of modules already holding a ``wgrad_queue``)
    gets ``delay_wgrad_compute``
    (:func:`~megatron_bitpipe.megatron_compat.enable_delay_wgrad_compute`). Modules with their
    own deferral (Transformer Engine) are used as they are. The deferred gradients go to the
    :class:`GradientSinks` of ``chunks``: pass all chunks of a rank in one call (a tied LM
    head's gradient goes to the DDP of the chunk holding the embedding). Idempotent. Returns
    how many modules defer.

    Raises :class:`SplitBackwardError` (before changing anything) for: Transformer Engine
    linears of a transformer layer built without ``delay_wgrad_compute`` (build from a config
    with the flag; the scripts do with ``--split-backward``; outside the layers a TE module
    that does not defer — megatron-core 0.19's MXFP8 LM head forces it off — computes its
    weight gradient in ``I``); TE's deferred weights under a megatron DDP without
    ``delay_wgrad_compute`` (its gradient hook would fire in ``I``); Optimus 2D layers;
    megatron's own embedding-wgrad deferral (``--defer-embedding-wgrad-compute``); linears whose
    weight is sharded for rematerialisation (megatron-core 0.19's ``gtp_weight_remat_size`` > 1).
    """
    linears, own = [], 0
    for chunk in chunks:
        ddp_delays = getattr(getattr(chunk, "ddp_config", None), "delay_wgrad_compute", True)
        in_layers = {id(m) for layer in chunk.modules() if isinstance(layer, TransformerLayer) for m in layer.modules()}
        for name, module in chunk.named_modules():
            if isinstance(module.__dict__.get("wgrad_queue"), WeightGradQueue):  # already deferrable
                linears.append((name, module))
                continue
            defers = _self_deferring(module)
            if defers is not None:
                if not defers and id(module) in in_layers:
                    raise SplitBackwardError(
                        f"split backward: {name} ({type(module).__name__}) defers its weight gradients only when built "
                        "with delay_wgrad_compute: build the model from a config passed through "
                        "megatron_compat.enable_delay_wgrad_compute (the scripts do with --split-backward)"
                    )
                if defers and not ddp_delays:
                    raise SplitBackwardError(
                        f"split backward: {name} defers its weight gradients itself (Transformer Engine); wrap the chunks "
                        "in DistributedDataParallel with DistributedDataParallelConfig(delay_wgrad_compute=True)"
                    )
                own += bool(defers)
                continue
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
                linears.append((name, module))
    sinks = GradientSinks(chunks)
    for name, module in linears:
        megatron_compat.enable_delay_wgrad_compute(module.config)
        if "wgrad_queue" not in module.__dict__:
            queue = WeightGradQueue(name)
            module.wgrad_queue = queue
            module._forward_impl = _DeferrableForwardImpl(module._forward_impl, queue, module.config, sinks)
            module.backward_dw = queue.backward_dw
    return len(linears) + own
