"""Collectives of the q×q mesh, as plain helpers and as autograd functions.

Conventions (see :mod:`megatron_bitpipe.optimus.mesh`): the rank at ``(i, j)`` holds batch
block ``i`` and feature block ``j``. A tensor "replicated over the row group" has the same
value on every rank of mesh row ``i`` and the gradient flowing into it is identical there
too (megatron's convention for replicated outputs); likewise for the column group.

Batch-dimension collectives work on ``dim`` of a tensor whose blocks along ``dim`` are the
mesh rows: block ``k`` belongs to the column-group member with group rank ``k``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mesh import OptimusMesh

#: parameter attribute: the column sum of this parameter's gradient is left to the finaliser
#: (:mod:`megatron_bitpipe.optimus.grads`)
DEFERRED = "optimus_column_sum_deferred"


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place sum over ``group``; returns the (contiguous) reduced tensor."""
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


#: torch 2.13 names the tensor all-gather and reduce-scatter ``*_single`` and warns
#: (FutureWarning) on the older names, which earlier versions have alone; looked up at each call
#: (``benchmarking.meters.CollectiveMeter`` wraps them)
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_blocks(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every member's ``local`` stacked on a new leading dimension: ``[group size, *shape]``,
    member ``k``'s block (group rank ``k``) at index ``k``.

    One collective in place of ``size`` broadcasts; the result holds ``size`` blocks at once
    (``size`` × the memory of ``local``, a fresh buffer; ``local`` is copied into its slot).
    """
    out = torch.empty((group.size(),) + tuple(local.shape), dtype=local.dtype, device=local.device)
    # flat views: gloo accepts only the concatenated form of the output
    getattr(dist, _ALL_GATHER)(out.view(-1), local.contiguous().view(-1), group=group)
    return out


def reduce_scatter_blocks(partials: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block ``group.rank()`` of the sum over members of ``partials`` ``[group size, *shape]``.

    Returns a fresh ``[*shape]`` tensor. One collective in place of ``size`` reduces, each of
    which summed one block onto its owner; with ``size`` = 2 the sum is bitwise the same (one
    commutative addition), with more members the association order is gloo's/NCCL's.
    """
    out = torch.empty(partials.shape[1:], dtype=partials.dtype, device=partials.device)
    # a base tensor, not a view: callers may return it from an autograd function whose
    # output is then modified in place (the cross entropy overwrites the logits)
    getattr(dist, _REDUCE_SCATTER)(out.view(-1), partials.contiguous().view(-1), group=group)
    return out


def _along_dim(collective, tensor: torch.Tensor, dim: int, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``collective(out, input, group=group)`` on ``tensor`` with ``dim`` moved first; ``out``
    is a fresh buffer of ``rows`` rows along ``dim``, returned with ``dim`` back in place."""
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((rows,) + tuple(moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    collective(out, moved, group=group)
    return out.movedim(0, dim)


def all_gather_along(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenation along ``dim`` of every member's ``tensor``, in group-rank order."""
    return _along_dim(getattr(dist, _ALL_GATHER), tensor, dim, tensor.shape[dim] * group.size(), group)


def _reduce_scatter_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Block ``group.rank()`` along ``dim`` of the sum of every member's ``tensor``."""
    size = tensor.shape[dim]
    if size % group.size():
        raise ValueError(f"dimension {dim} of size {size} not divisible by {group.size()}")
    return _along_dim(getattr(dist, _REDUCE_SCATTER), tensor, dim, size // group.size(), group)


def batch_block(tensor: torch.Tensor, dim: int, mesh: OptimusMesh) -> torch.Tensor:
    """This rank's batch block (block ``mesh.row`` of ``mesh.side``) of ``tensor`` along ``dim``."""
    size = tensor.shape[dim]
    if size % mesh.side:
        raise ValueError(f"batch dimension {size} not divisible by the mesh side {mesh.side}")
    return tensor.narrow(dim, mesh.row * (size // mesh.side), size // mesh.side)


class _GatherBatch(torch.autograd.Function):
    """Forward: all-gather batch blocks over the column group. Backward: keep own block.

    The output is replicated over the column group, so its incoming gradient is the full
    one on every member and the own block needs no communication.
    """

    @staticmethod
    def forward(ctx, tensor, dim, mesh):
        ctx.dim, ctx.mesh = dim, mesh
        return all_gather_along(tensor, dim, mesh.column_group)

    @staticmethod
    def backward(ctx, grad):
        return batch_block(grad, ctx.dim, ctx.mesh).contiguous(), None, None


class _ReduceScatterBatch(torch.autograd.Function):
    """Forward: sum partial full-batch tensors over the column group, keep own batch block.

    Backward: all-gather the batch blocks of the gradient over the column group.
    """

    @staticmethod
    def forward(ctx, tensor, dim, mesh):
        ctx.dim, ctx.mesh = dim, mesh
        return _reduce_scatter_dim(tensor, dim, mesh.column_group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.mesh.column_group), None, None


class _SumGradsOverColumn(torch.autograd.Function):
    """Identity forward on one or more tensors; backward sums their gradients over the
    column group in one all-reduce (the gradients flattened and concatenated).

    For parameters replicated over the column group (biases, LayerNorm weights of one
    feature block, used on every batch block): each member's local gradient covers only its
    batch block, and the true gradient is their sum. Summing several at once changes no
    value (element-wise sums), only the number of collectives.
    """

    @staticmethod
    def forward(ctx, mesh, *tensors):
        ctx.mesh = mesh
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = all_reduce_sum(torch.cat([grad.reshape(-1) for grad in grads]), ctx.mesh.column_group)
        sums = flat.split([grad.numel() for grad in grads])
        return (None,) + tuple(total.view_as(grad) for total, grad in zip(sums, grads))


def gather_batch(tensor: torch.Tensor, dim: int, mesh: OptimusMesh) -> torch.Tensor:
    """Full batch along ``dim`` from the batch blocks of the column group (autograd-aware)."""
    return _GatherBatch.apply(tensor, dim, mesh)


def reduce_scatter_batch(tensor: torch.Tensor, dim: int, mesh: OptimusMesh) -> torch.Tensor:
    """Own batch block of the column-group sum of full-batch partials (autograd-aware)."""
    return _ReduceScatterBatch.apply(tensor, dim, mesh)


def column_replicated(parameter: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    """Use of a column-replicated parameter whose gradient must be summed over batch blocks:
    in this use's backward, or (the parameter marked by
    :func:`megatron_bitpipe.optimus.grads.defer_column_sums`) once per iteration by the
    finaliser, the parameter itself."""
    (used,) = column_replicated_all((parameter,), mesh)
    return used


def column_replicated_all(parameters, mesh: OptimusMesh) -> tuple:
    """:func:`column_replicated` for several parameters used together (e.g. a norm's weight
    and bias): one all-reduce of their concatenated gradients instead of one each.
    ``None`` entries pass through as ``None``; so do deferred ones (all of them or none)."""
    present = [p for p in parameters if p is not None]
    deferred = [getattr(p, DEFERRED, False) for p in present]
    if all(deferred):
        return tuple(parameters)
    if any(deferred):
        raise ValueError("column_replicated_all: some of the parameters used together defer their column sum, some do not")
    used = iter(_SumGradsOverColumn.apply(mesh, *present))
    return tuple(None if p is None else next(used) for p in parameters)
