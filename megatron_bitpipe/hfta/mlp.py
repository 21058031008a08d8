"""The MLP of a fused array: megatron-core's ``MLP`` over batched linears, whose gated
(``--swiglu``) ``linear_fc1`` is split and checkpointed as the unfused model's, one model
dimension further in."""

from __future__ import annotations

from typing import Tuple

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.mlp import MLP

__all__ = ["HftaMLP", "fuse_gated_mlps"]

#: the ``[gate; up]`` axis of a fused ``linear_fc1`` weight ``[B, 2F/tp, h]`` or bias ``[B, 2F/tp]``
_GATED_AXIS = 1


def _gated_halves(sharded: ShardedTensor, sharded_offsets: Tuple) -> ShardedTensorFactory:
    """``sharded`` (this rank's ``[B, 2F/tp, ...]`` block of a gated ``linear_fc1`` tensor, the
    rank's gate rows then its up rows) checkpointed as two shards of one ``[B, 2F, ...]`` tensor:
    the gate block at fragment ``r`` of ``2·tp`` along the gated axis, the up block at fragment
    ``tp + r``. The stored tensor is thus every model's unfused ``[gate; up]`` weight, whatever
    the tensor-parallel size (megatron's ``apply_swiglu_sharded_factory`` does the same on axis 0,
    the model axis of a fused tensor)."""
    prepend = len(sharded_offsets)
    axis = prepend + _GATED_AXIS
    rank = sharded.global_offset[axis] // sharded.local_shape[_GATED_AXIS]
    fragments = sharded.axis_fragmentations[axis]

    @torch.no_grad()
    def build(key, tensor, replica_id, flattened_range):
        gate, up = torch.chunk(tensor, 2, dim=_GATED_AXIS)
        return [
            ShardedTensor.from_rank_offsets(key, half, *sharded_offsets, (axis, position, 2 * fragments), replica_id=replica_id, prepend_axis_num=prepend)
            for half, position in ((gate, rank), (up, rank + fragments))
        ]

    def merge(halves):
        with torch.no_grad():
            return torch.cat(halves, dim=_GATED_AXIS)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id, flattened_range=sharded.flattened_range)


class HftaMLP(MLP):
    """megatron's ``MLP`` of a fused array (its linears are :class:`.layers.HftaLinear`), made
    from a built one by :func:`fuse_gated_mlps`.

    With a gated linear unit, this rank's ``linear_fc1`` weight ``[B, 2F/tp, h]`` (and bias
    ``[B, 2F/tp]``) holds its gate block then its up block along axis 1, as megatron's unfused
    ``[2F/tp, h]`` does along axis 0: the tensors are marked with partition stride 2, so
    initialisation draws model ``k``'s full ``[gate; up]`` weight and keeps this rank's blocks,
    and :meth:`sharded_state_dict` stores the full ``[B, 2F, h]`` stack (:func:`_gated_halves`),
    so a fused checkpoint loads at any tensor-parallel size and model ``k``'s slice is the
    unfused model's weight.
    """

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        if not self.config.gated_linear_unit:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out = {}
        for name, module in self._modules.items():
            entries = module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata)
            if name == "linear_fc1":
                for key in (f"{prefix}{name}.weight", f"{prefix}{name}.bias"):
                    if key in entries:
                        entries[key] = _gated_halves(entries[key], sharded_offsets)
            out.update(entries)
        return out


def fuse_gated_mlps(model: torch.nn.Module) -> None:
    """Make every megatron ``MLP`` of ``model`` (a fused array, built) an :class:`HftaMLP` and
    mark a gated ``linear_fc1``'s tensors with partition stride 2; call before initialisation.

    megatron builds the MLP itself (its ``TransformerLayer`` hands the tensor-parallel group
    only to ``MLP`` proper, not to a subclass in the spec), so the built module changes class:
    :class:`HftaMLP` adds no state, only its checkpoint layout.
    """
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = HftaMLP
            if module.config.gated_linear_unit:
                for param in (module.linear_fc1.weight, module.linear_fc1.bias):
                    if param is not None:
                        param.partition_stride = 2
