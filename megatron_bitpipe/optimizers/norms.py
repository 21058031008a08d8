"""Norms and maxima of whole logical parameters from their tensor-parallel blocks.

A layer-wise optimizer (LAMB's trust ratio ``||w|| / ||u||``) needs the norm of the
*logical* parameter, not of the block one rank holds. megatron-core marks every parameter
whose values differ per tensor-parallel rank with ``tensor_model_parallel = True`` (1-D
shards; Optimus 2D blocks, where column-replicated vectors are flagged on mesh row 0 only);
a parameter without the flag is a copy of the same values on every TP rank. The squared norm
of the logical parameter is therefore the sum over the TP group of the local squared norms of
flagged blocks plus rank 0's copy of unflagged ones — the rule megatron's gradient clipping
uses (``param_is_not_tensor_parallel_duplicate``). Weight replicas (BitPipe's second
pipeline, data-parallel copies) hold the same values as the first, so a norm computed on any
of them is the logical one: nothing is reduced over replicas.

All functions take the tensors of many parameters at once and issue one collective over the
TP group (none for a TP group of one), so every rank of the group must call them with the
same parameters in the same order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["counts_on_this_rank", "logical_sq_norms", "logical_maxima", "logical_numels"]


def counts_on_this_rank(param: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> bool:
    """Whether this rank's block of ``param`` is part of the logical parameter's sum."""
    if tp_group is None or tp_group.size() == 1:
        return True
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_group.rank() == 0


def logical_sq_norms(
    tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor], tp_group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """fp32 vector of squared norms: entry ``i`` is ``||tensors[i]||^2`` over the logical
    parameter ``params[i]`` (``tensors[i]`` has the shape of this rank's block)."""
    if not tensors:
        return torch.zeros(0)
    local = torch.stack(
        [
            t.detach().float().square().sum() if counts_on_this_rank(p, tp_group) else t.new_zeros((), dtype=torch.float32)
            for t, p in zip(tensors, params, strict=True)
        ]
    )
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(local, group=tp_group)
    return local


def logical_maxima(tensors: Sequence[torch.Tensor], tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """fp32 vector: entry ``i`` is the largest element of ``tensors[i]`` over the TP group
    (copies do not change a maximum, so every rank contributes)."""
    if not tensors:
        return torch.zeros(0)
    local = torch.stack([t.detach().float().max() for t in tensors])
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=tp_group)
    return local


def logical_numels(params: Sequence[torch.Tensor], tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """fp32 vector: the number of elements of each logical parameter."""
    if not params:
        return torch.zeros(0)
    counts = [float(p.numel()) if counts_on_this_rank(p, tp_group) else 0.0 for p in params]
    local = torch.tensor(counts, dtype=torch.float32, device=params[0].device)
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(local, group=tp_group)
    return local
