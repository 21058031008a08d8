"""Full (single-process) tensors from the tensor-parallel blocks of the ranks, any TP mode.

:func:`gather_full` is the inverse of :func:`megatron_bitpipe.runtime.layout.tp_block`
(which, with :func:`~megatron_bitpipe.runtime.layout.full_shape`, goes from full tensors to a
rank's block): megatron's 1-D blocks along ``partition_dim`` (strided ones too, e.g. SwiGLU's
fused [gate; up]) and Optimus 2D blocks (by the parameter's ``optimus_layout``). Checkpoints
go through these three functions, so they are independent of the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.layout import is_tensor_parallel

__all__ = ["gather_full"]


def gather_full(local: torch.Tensor, param: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor whose block for ``param`` on this rank is ``local`` (same shape as ``param``:
    the parameter itself, its gradient, an optimizer moment).

    Collective over ``tp_group`` when ``param`` is split (every TP rank calls it for the same
    parameter); returns ``local`` itself for a parameter every TP rank holds whole.
    """
    layout = getattr(param, "optimus_layout", None)
    if tp_group.size() == 1 or not (layout is not None or is_tensor_parallel(param)):
        return local
    blocks = [torch.empty_like(local) for _ in range(tp_group.size())]
    dist.all_gather(blocks, local.contiguous(), group=tp_group)
    if layout is not None:
        return layout.from_tp_blocks(blocks)
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    parts = [block.chunk(stride, dim=dim) for block in blocks]  # rank r holds parts r, r + tp, ...
    return torch.cat([rank_parts[s] for s in range(stride) for rank_parts in parts], dim=dim)
