"""From an Optimus 2D block to the serial (single-process megatron-core) tensor and back.

:mod:`megatron_bitpipe.optimus.layout` cuts a rank's block out of a serial tensor
(:func:`~megatron_bitpipe.optimus.layout.shard_serial_tensor`); this module goes the other
way, for layout-independent initialisation and checkpoints:

* :func:`serial_shape` — the serial shape of a parameter from its block and layout;
* :func:`gather_serial_tensor` — the whole serial tensor from every rank's block (a
  collective over the TP group), e.g. a parameter, its gradient or an optimizer moment.

Both follow ``shard_serial_tensor`` by construction: the gather scatters each rank's block
to the serial positions ``shard_serial_tensor`` takes it from (found by sharding a tensor of
serial element indices), so the two can never disagree.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Tuple

import torch
import torch.distributed as dist

from megatron_bitpipe.optimus.layout import LayoutKind, ParamLayout, shard_serial_tensor
from megatron_bitpipe.optimus.mesh import OptimusMesh

__all__ = ["serial_shape", "gather_serial_tensor"]


def serial_shape(block_shape: Tuple[int, ...], layout: ParamLayout, side: int) -> Tuple[int, ...]:
    """Shape of the serial tensor whose ``layout`` blocks on a ``side`` x ``side`` mesh are
    ``block_shape``: linear weights ``[in/q, out/q]`` -> ``[out, in]``; vocabulary tables
    ``[v/q, h/q]`` -> ``[v, h]``; feature vectors ``[n/q]`` -> ``[n]``; feature tables
    ``[p, h/q]`` -> ``[p, h]``."""
    if layout.kind is LayoutKind.LINEAR_WEIGHT:
        rows, columns = block_shape
        return (columns * side, rows * side)
    if layout.kind is LayoutKind.VOCAB_TABLE:
        return tuple(size * side for size in block_shape)
    if layout.kind is LayoutKind.FEATURE_VECTOR:
        return (block_shape[0] * side,)
    return (block_shape[0], block_shape[1] * side)


def gather_serial_tensor(block: torch.Tensor, layout: ParamLayout, mesh: OptimusMesh) -> torch.Tensor:
    """The serial tensor whose ``layout`` block on this rank is ``block``.

    Collective over ``mesh.tp_group`` (every rank passes its block of the same tensor);
    every rank gets the whole tensor, on ``block``'s device and dtype.
    """
    side = mesh.side
    shape = serial_shape(tuple(block.shape), layout, side)
    blocks = [torch.empty_like(block) for _ in range(side * side)]
    dist.all_gather(blocks, block.contiguous(), group=mesh.tp_group)
    indices = torch.arange(int(torch.Size(shape).numel())).view(shape)
    serial = torch.empty(shape, dtype=block.dtype, device=block.device).view(-1)
    for tp_rank, gathered in enumerate(blocks):
        row, column = divmod(tp_rank, side)
        position = SimpleNamespace(side=side, row=row, column=column)
        where = shard_serial_tensor(indices, layout, position).view(-1).to(block.device)
        serial[where] = gathered.view(-1)
    return serial.view(shape)
