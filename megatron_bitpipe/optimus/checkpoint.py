"""Optimus 2D parameters in megatron-core distributed checkpoints.

A distributed checkpoint stores each tensor of the serial (single-process) model once, under
its megatron-core name, and each rank writes or reads the blocks it holds
(``ShardedTensor``: global shape, this rank's offsets, ``replica_id`` 0 on the one copy that
is written). An Optimus parameter's block of the serial tensor is given by its
:class:`~megatron_bitpipe.optimus.layout.ParamLayout`; :func:`optimus_sharded_entry` turns
megatron's default entry for it (which treats the block as a whole tensor replicated over
the TP group) into that description:

* vocabulary tables ``[v/q, h/q]``: block ``(i, j)`` of ``[v, h]``;
* linear weights ``[in/q, out/q]``: the transpose of block ``(j, i)`` of the serial
  ``[out, in]`` weight; with ``stride`` > 1 (SwiGLU's fused ``[gate; up]``) one block per part,
  at the places megatron's 1-D tensor parallelism puts them;
* feature vectors ``[n/q]`` and position tables ``[positions, h/q]``: feature block ``j``,
  held alike by every row of a mesh column: rows > 0 are replicas.

Transposed and strided blocks go through a ``ShardedTensorFactory`` (the stored blocks on
save, the local layout again on load), which megatron's optimizers apply to their states as
well. So Optimus checkpoints load into megatron's 1-D tensor parallelism (any size), a
single process or another mesh, and the other way round.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor, ShardedTensorFactory

from .layout import LayoutKind, ParamLayout
from .mesh import OptimusMesh

__all__ = ["optimus_sharded_entry"]


def _prepended(entry: ShardedBase) -> List[Tuple[int, int, int]]:
    """The ``(axis, offset, size)`` axes megatron prepends (stacked layers), from ``entry``."""
    tensor = entry
    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        tensor = built[0] if isinstance(built, list) else built
    return [(axis, tensor.global_offset[axis], tensor.global_shape[axis]) for axis in range(tensor.prepend_axis_num)]


def _replica_id(entry: ShardedBase, layout: ParamLayout, mesh: OptimusMesh) -> Tuple[int, ...]:
    """megatron's ``(pipeline, tensor, data)`` replica id with the tensor coordinate of ``layout``."""
    rid = entry.replica_id if isinstance(entry.replica_id, tuple) else (entry.replica_id, 0, 0)
    return (rid[0], mesh.row if layout.column_replicated else 0, *rid[2:])


def optimus_sharded_entry(entry: ShardedBase, param: torch.Tensor, mesh: OptimusMesh) -> ShardedBase:
    """The sharded-state entry of Optimus parameter ``param`` (module docstring).

    ``entry`` is megatron's default one for ``param`` (its key, stacked-layer axes and data-
    parallel replica id are kept).
    """
    layout: ParamLayout = param.optimus_layout
    key, prepend = entry.key, _prepended(entry)
    axis = len(prepend)
    replica_id = _replica_id(entry, layout, mesh)
    q, row, column, stride = mesh.side, mesh.row, mesh.column, layout.stride
    allow = bool(getattr(entry, "allow_shape_mismatch", False))
    if layout.kind is LayoutKind.VOCAB_TABLE:
        return ShardedTensor.from_rank_offsets(
            key, param, *prepend, (axis, row, q), (axis + 1, column, q), replica_id=replica_id,
            prepend_axis_num=axis, allow_shape_mismatch=allow,
        )
    if layout.kind is LayoutKind.FEATURE_TABLE:
        return ShardedTensor.from_rank_offsets(
            key, param, *prepend, (axis + 1, column, q), replica_id=replica_id, prepend_axis_num=axis,
            allow_shape_mismatch=allow,
        )
    transposed = layout.kind is LayoutKind.LINEAR_WEIGHT
    if layout.kind is LayoutKind.FEATURE_VECTOR and stride == 1:
        return ShardedTensor.from_rank_offsets(
            key, param, *prepend, (axis, column, q), replica_id=replica_id, prepend_axis_num=axis
        )

    def build(key, data, replica_id, flattened_range):
        serial_block = data.t() if transposed else data
        parts = serial_block.chunk(stride, dim=0)
        extra = [(axis + 1, row, q)] if transposed else []
        return [
            ShardedTensor.from_rank_offsets(
                key, part.contiguous(), *prepend, (axis, p * q + column, stride * q), *extra,
                replica_id=replica_id, prepend_axis_num=axis,
            )
            for p, part in enumerate(parts)
        ]

    def merge(loaded):
        serial_block = torch.cat(list(loaded), dim=0)
        return serial_block.t().contiguous() if transposed else serial_block

    return ShardedTensorFactory(key, param, build, merge, replica_id)


def optimus_module_sharded_state_dict(module: torch.nn.Module, mesh: OptimusMesh, prefix: str, sharded_offsets, metadata) -> dict:
    """``sharded_state_dict`` of a module whose own parameters are Optimus blocks (the 2-D
    linears and norms): megatron's default entries (stacked-layer ``sharded_offsets``, data-parallel
    replica id from ``metadata['dp_cp_group']``), each turned into :func:`optimus_sharded_entry`."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = make_sharded_tensors_for_checkpoint(
        module.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets,
        tp_group=mesh.tp_group, dp_cp_group=metadata["dp_cp_group"],
    )
    return {
        name: optimus_sharded_entry(entry, entry.data, mesh) if getattr(entry.data, "optimus_layout", None) is not None else entry
        for name, entry in state.items()
    }
