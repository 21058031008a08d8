"""A test double of Transformer Engine's deferring linears, for CPU tests of the split backward.

Transformer Engine needs CUDA, so no CPU test can build its layers. This double follows the
part of their contract (TE >= 2.3, ``delay_wgrad_compute=True``) that megatron-core and
megatron-bitpipe rely on, and nothing else:

* the constructor reads ``config.delay_wgrad_compute`` once (megatron-core's TE linears pass
  it to TE's constructor); with it the weight is marked ``skip_backward_post_hook``, so
  megatron DDP (``DistributedDataParallelConfig(delay_wgrad_compute=True)``) registers its
  gradient hook through ``register_wgrad_accumulation_and_reduce_hooks`` instead of on the
  weight's accumulator;
* the backward computes the input and bias gradients and, deferring, returns no weight
  gradient: it puts ``(input, output gradient)`` into ``wgrad_store.context`` (a
  ``queue.Queue``, FIFO); ``need_backward_dw()`` says whether it defers;
* ``backward_dw()`` takes the oldest entry, adds ``gradᵀ · input`` to ``weight.grad`` and
  runs the registered hooks; with nothing queued it returns silently, as TE's does.

Only tensor-parallel size 1 (no communication); the math is megatron's local linear's
(``input · weightᵀ + bias``). :class:`PlainDoubleLinear` is the same contract on a plain
module (no megatron-core state needed, for single-process tests).
"""

from __future__ import annotations

import dataclasses
import functools
import queue

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class _WgradStore:
    """TE's ``wgrad_store``: whether the module defers, and the FIFO ``context``."""

    def __init__(self, delay: bool):
        self._delay = delay
        self.context: "queue.Queue" = queue.Queue()

    def delay_wgrad_compute(self) -> bool:
        return self._delay


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, module):
        ctx.save_for_backward(input, weight)
        ctx.module, ctx.use_bias = module, bias is not None
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        store = ctx.module.wgrad_store
        if store.delay_wgrad_compute():
            store.context.put((input, grad_output))
            return grad_input, None, grad_bias, None
        return grad_input, _weight_grad(input, grad_output), grad_bias, None


def _weight_grad(input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    return grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))


class _DeferringContract:
    """TE's deferral interface on top of a megatron linear's parameters and initialisation."""

    def _init_contract(self) -> None:
        self.wgrad_store = _WgradStore(bool(getattr(self.config, "delay_wgrad_compute", False)))
        self.wgrad_accumulation_and_reduce_hooks = []
        if self.wgrad_store.delay_wgrad_compute():
            self.weight.skip_backward_post_hook = True

    def need_backward_dw(self) -> bool:
        return self.wgrad_store.delay_wgrad_compute()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        if not self.need_backward_dw() or self.wgrad_store.context.empty():
            return
        input, grad_output = self.wgrad_store.context.get()
        grad = _weight_grad(input, grad_output)
        self.weight.grad = grad if self.weight.grad is None else self.weight.grad + grad
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def forward(self, input_, *unused_args, **unused_kwargs):
        bias = None if self.skip_bias_add else self.bias
        output = _Linear.apply(input_, self.weight, bias, self)
        return output, (self.bias if self.skip_bias_add else None)


class PlainDoubleLinear(_DeferringContract, torch.nn.Module):
    """``in_features -> out_features`` with a bias, deferring when ``config.delay_wgrad_compute``."""

    def __init__(self, config, in_features: int, out_features: int, generator: torch.Generator):
        super().__init__()
        self.config, self.skip_bias_add = config, False
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(out_features, generator=generator))
        self._init_contract()


class DoubleColumnLinear(_DeferringContract, ColumnParallelLinear):
    """A column-parallel linear with Transformer Engine's deferral contract (TP 1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.tp_group.size() == 1, "the Transformer Engine double supports tensor-parallel size 1 only"
        self._init_contract()


class DoubleRowLinear(_DeferringContract, RowParallelLinear):
    """A row-parallel linear with Transformer Engine's deferral contract (TP 1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.tp_group.size() == 1, "the Transformer Engine double supports tensor-parallel size 1 only"
        self._init_contract()


def te_double_layer_spec(config):
    """The runtime's GPT layer spec with the four linears (QKV, output projection, fc1, fc2)
    replaced by the doubles, where megatron-core's TE spec puts TE linears."""
    from megatron_bitpipe.model.chunks import default_gpt_layer_spec

    spec = default_gpt_layer_spec(config)
    layer = spec.submodules
    attention, mlp = layer.self_attention, layer.mlp
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, linear_qkv=DoubleColumnLinear, linear_proj=DoubleRowLinear),
    )
    linears = dict(linear_fc1=DoubleColumnLinear, linear_fc2=DoubleRowLinear)
    if isinstance(mlp, functools.partial):  # megatron-core 0.19: MLP.as_mlp_submodule with its submodules
        mlp = functools.partial(mlp.func, *mlp.args, **dict(mlp.keywords, submodules=dataclasses.replace(mlp.keywords["submodules"], **linears)))
    else:  # 0.16: a ModuleSpec
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **linears))
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention, mlp=mlp))
