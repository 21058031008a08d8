"""Gradients of column-replicated parameters, summed over the mesh column once per iteration.

A column-replicated parameter (a linear's bias, a norm's weight and bias, the position table:
feature block ``j`` on the q ranks of mesh column ``j``) gets on each rank the gradient of
that rank's batch block only; its gradient is the sum of the q over the column group.

* Used on its own (``OptimusGPTModel`` with megatron's ``finalize_model_grads``), every use
  sums it in backward (:func:`~megatron_bitpipe.optimus.collectives.column_replicated`): one
  all-reduce per use and micro-batch, after which every copy holds the whole gradient.
* Pipelines built by :func:`megatron_bitpipe.model.build.build_pipeline_model` defer it:
  :func:`defer_column_sums` marks the parameters (attribute :data:`DEFERRED`), their uses then
  pass the local gradient on, megatron's DDP accumulates it over the iteration's micro-batches
  (and reduces it over data parallelism and the pipeline replicas as any gradient), and the
  finaliser of :func:`finalize_model_grads_func` sums every marked gradient over the column in
  one all-reduce after megatron's ``finalize_model_grads``. Sums are linear, so only the order
  of the additions changes (rounding); the number of column all-reduces per iteration drops
  from one per use and micro-batch to one.

Invariant: a marked parameter's ``main_grad`` holds the whole gradient only after the
finaliser ran; every rank of a column marks the same parameters (the chunks are built alike).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from .collectives import DEFERRED
from .mesh import OptimusMesh


def defer_column_sums(chunks: Iterable[torch.nn.Module]) -> None:
    """Mark every column-replicated parameter of ``chunks`` (before DDP wraps them)."""
    for chunk in chunks:
        for param in chunk.parameters():
            layout = getattr(param, "optimus_layout", None)
            if layout is not None and layout.column_replicated:
                setattr(param, DEFERRED, True)


def sum_deferred_column_grads(model: Iterable[torch.nn.Module], mesh: OptimusMesh) -> None:
    """Sum the ``main_grad`` of every marked parameter of ``model`` over ``mesh``'s column
    group, in one all-reduce of their concatenation (a parameter held by two chunks, counted
    once). Collective over the column group; nothing to do (no collective) without marks."""
    params: List[torch.nn.Parameter] = []
    seen = set()
    for chunk in model:
        for param in chunk.parameters():
            if getattr(param, DEFERRED, False) and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    if not params:
        return
    flat = torch.cat([param.main_grad.reshape(-1) for param in params])
    dist.all_reduce(flat, group=mesh.column_group)
    for param, total in zip(params, flat.split([param.main_grad.numel() for param in params])):
        param.main_grad.copy_(total.view_as(param.main_grad))


def finalize_model_grads_func(mesh: Optional[OptimusMesh]) -> Callable:
    """The ``config.finalize_model_grads_func`` of a model on ``mesh`` (None: 1-D tensor
    parallelism, megatron's ``finalize_model_grads`` itself): megatron's, then
    :func:`sum_deferred_column_grads`. Same signature as megatron's."""
    if mesh is None:
        return finalize_model_grads

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        sum_deferred_column_grads(model, mesh)

    return finalize
