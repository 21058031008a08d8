"""How a rank's parameter relates to the full (single-process) tensor, for any TP mode.

A :class:`Sharding` answers three questions for a parameter of a model chunk:

* :meth:`~Sharding.full_shape` — the full tensor's shape;
* :meth:`~Sharding.block` — this rank's block of a full tensor (no communication);
* :meth:`~Sharding.gather` — the full tensor from every TP rank's block of a tensor shaped
  like the parameter (parameter, gradient, optimizer moment); a collective over the TP group.

:func:`sharding_of` picks megatron's 1-D tensor parallelism (a parameter flagged
``tensor_model_parallel`` is one of TP equal blocks along ``partition_dim``) or Optimus 2D
(a parameter with an ``optimus_layout``, on a chunk carrying its ``mesh``). Seed
initialisation and checkpoints go through it, so both are independent of the layout.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.distributed as dist

from ..optimus.layout import shard_serial_tensor
from ..optimus.serial import gather_serial_tensor, serial_shape
from ..runtime.init import seeded_full_tensor
from ..runtime.layout import ChunkLayers, is_tensor_parallel, to_global_name, tp_block
from ..runtime.model import unwrap

__all__ = ["Sharding", "sharding_of", "initialize_from_seed"]


class Sharding:
    """Block <-> full tensor for the parameters of one chunk on this rank.

    Args:
        tp_group: the chunk's tensor-parallel group.
        mesh: the chunk's Optimus mesh (its TP group is ``tp_group``), or None for 1-D.
    """

    def __init__(self, tp_group: dist.ProcessGroup, mesh=None):
        self.tp_group = tp_group
        self.mesh = mesh

    def _layout(self, param: torch.Tensor):
        layout = getattr(param, "optimus_layout", None)
        if layout is not None and self.mesh is None:
            raise ValueError("an Optimus 2D parameter needs the chunk's mesh")
        return layout

    def full_shape(self, param: torch.Tensor) -> Tuple[int, ...]:
        layout = self._layout(param)
        if layout is not None:
            return serial_shape(tuple(param.shape), layout, self.mesh.side)
        shape = list(param.shape)
        if is_tensor_parallel(param):
            shape[param.partition_dim] *= self.tp_group.size()
        return tuple(shape)

    def block(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``full`` for ``param`` (may be a view of ``full``)."""
        layout = self._layout(param)
        if layout is not None:
            return shard_serial_tensor(full, layout, self.mesh)
        return tp_block(full, param, self.tp_group.rank(), self.tp_group.size())

    def gather(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The full tensor whose block for ``param`` on this rank is ``local``.

        Collective over the TP group when ``param`` is split (every TP rank calls it for the
        same parameter); returns ``local`` itself for a replicated parameter.
        """
        layout = self._layout(param)
        if layout is not None:
            return gather_serial_tensor(local, layout, self.mesh)
        if self.tp_group.size() == 1 or not is_tensor_parallel(param):
            return local
        blocks = [torch.empty_like(local) for _ in range(self.tp_group.size())]
        dist.all_gather(blocks, local.contiguous(), group=self.tp_group)
        stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
        parts = [block.chunk(stride, dim=dim) for block in blocks]  # inverse of tp_block
        return torch.cat([rank_parts[s] for s in range(stride) for rank_parts in parts], dim=dim)


def sharding_of(chunk: torch.nn.Module, tp_group: dist.ProcessGroup) -> Sharding:
    """The :class:`Sharding` of a (wrapped) model chunk: Optimus 2D if it has a ``mesh``."""
    return Sharding(tp_group, getattr(unwrap(chunk), "mesh", None))


def initialize_from_seed(
    chunks: Sequence[torch.nn.Module], layers: Sequence[ChunkLayers], seed: int, tp_group: dist.ProcessGroup
) -> None:
    """:func:`megatron_bitpipe.runtime.init.initialize_from_seed` for any TP mode: every
    parameter becomes its block of :func:`~megatron_bitpipe.runtime.init.seeded_full_tensor`.

    Local (no communication); in place. ``layers[i]`` says which part of the full model
    ``chunks[i]`` holds.
    """
    with torch.no_grad():
        for chunk, chunk_layers in zip(chunks, layers, strict=True):
            sharding = sharding_of(chunk, tp_group)
            model = unwrap(chunk)
            for local_name, param in model.named_parameters():
                full = seeded_full_tensor(to_global_name(local_name, chunk_layers), sharding.full_shape(param), model.config, seed)
                param.copy_(sharding.block(full, param))
