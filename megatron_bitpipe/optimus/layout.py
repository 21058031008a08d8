"""How each Optimus parameter is laid out on the mesh, and how to cut it from a serial tensor.

Every parameter of an Optimus module carries a :class:`ParamLayout` (attribute
``optimus_layout``) saying which block of the serial (single-process megatron-core) tensor
it holds. That one description drives:

* :func:`shard_serial_tensor` — the local block cut from the serial tensor (tests, loading
  a single-process checkpoint);
* :func:`set_param_layout` — megatron-core's ``tensor_model_parallel`` flag, so that grad-norm
  clipping and parameter counts see every element exactly once across the TP group;
* whether the gradient needs summing over the column group (column-replicated kinds);
* layout-independent initialisation and weight collection in :mod:`megatron_bitpipe.model`
  (:meth:`ParamLayout.tp_block`, :meth:`ParamLayout.from_tp_blocks`), which find the layout
  on the parameter and need no import of this package.

Serial megatron layouts: linear weights are ``[out, in]``, embedding tables ``[vocab, h]``,
position tables ``[positions, h]``, biases and norm parameters ``[features]``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Tuple

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from ..model_partition import join_strided_blocks
from .mesh import OptimusMesh, mesh_side


class LayoutKind(enum.Enum):
    """Which block of the serial tensor the rank at mesh position (i, j) holds."""

    #: serial ``[out, in]`` → local ``[in/q, out/q]`` = ``Wᵀ[in block i, out block j]``
    LINEAR_WEIGHT = "linear_weight"
    #: serial ``[vocab, h]`` → local ``[vocab/q, h/q]`` = block ``(i, j)``
    VOCAB_TABLE = "vocab_table"
    #: serial ``[n]`` → local ``[n/q]`` = block ``j``; replicated over the column group
    FEATURE_VECTOR = "feature_vector"
    #: serial ``[positions, h]`` → local ``[positions, h/q]``; replicated over the column group
    FEATURE_TABLE = "feature_table"


@dataclass(frozen=True)
class ParamLayout:
    """A parameter's mesh layout: which block of the serial tensor each mesh position holds.

    ``stride`` > 1 describes the output dimension of a gated MLP's first linear (and its
    bias), stored like megatron-core's ``stride=2`` column-parallel layout: the serial output
    dimension is ``stride`` concatenated parts, and output block ``j`` holds block ``j`` of each.

    The block geometry needs only the mesh position ``(row, column)`` and side ``q``, not
    process groups, so code that knows a parameter only by its TP rank and size (seed
    initialisation, weight collection in :mod:`megatron_bitpipe.model_partition`) uses
    :meth:`tp_block` / :meth:`serial_shape` / :meth:`from_tp_blocks` through the
    parameter's ``optimus_layout`` attribute; the mesh invariant ``(row, column) =
    divmod(tp_rank, q)`` (:class:`~megatron_bitpipe.optimus.mesh.OptimusMesh`) links the two.
    """

    kind: LayoutKind
    stride: int = 1

    @property
    def column_replicated(self) -> bool:
        """True if every rank of a mesh column holds the same values."""
        return self.kind in (LayoutKind.FEATURE_VECTOR, LayoutKind.FEATURE_TABLE)

    def block(self, serial: torch.Tensor, row: int, column: int, side: int) -> torch.Tensor:
        """Block of ``serial`` held at mesh position ``(row, column)`` (a view unless ``stride`` > 1)."""
        if self.kind is LayoutKind.LINEAR_WEIGHT:
            return _feature_block(serial, 0, column, side, self.stride).chunk(side, dim=1)[row].t()
        if self.kind is LayoutKind.VOCAB_TABLE:
            return serial.chunk(side, dim=0)[row].chunk(side, dim=1)[column]
        if self.kind is LayoutKind.FEATURE_VECTOR:
            return _feature_block(serial, 0, column, side, self.stride)
        return serial.chunk(side, dim=1)[column]

    def serial_shape(self, local_shape: Sequence[int], tp_size: int) -> Tuple[int, ...]:
        """Shape of the serial tensor whose blocks on ``tp_size`` = q² ranks have ``local_shape``."""
        side = mesh_side(tp_size)
        if self.kind is LayoutKind.LINEAR_WEIGHT:
            rows, columns = local_shape
            return (columns * side, rows * side)
        if self.kind is LayoutKind.VOCAB_TABLE:
            return tuple(n * side for n in local_shape)
        if self.kind is LayoutKind.FEATURE_VECTOR:
            return (local_shape[0] * side,)
        return (local_shape[0], local_shape[1] * side)

    def tp_block(self, serial: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """:meth:`block` for TP rank ``tp_rank`` of a TP group of ``tp_size`` = q² ranks."""
        side = mesh_side(tp_size)
        row, column = divmod(tp_rank, side)
        return self.block(serial, row, column, side)

    def from_tp_blocks(self, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The serial tensor from every TP rank's block (``blocks[r]`` from TP rank ``r``).

        Inverse of :meth:`tp_block`. Column-replicated kinds are read from mesh row 0;
        ValueError if another row's copy is not bit-identical to it.
        """
        side = mesh_side(len(blocks))
        at = lambda row, column: blocks[row * side + column]  # noqa: E731
        if self.column_replicated:
            for rank, copy in enumerate(blocks):
                if not torch.equal(copy, at(0, rank % side)):
                    row, column = divmod(rank, side)
                    raise ValueError(
                        f"column-replicated block at mesh ({row}, {column}) differs from row 0's"
                    )
        if self.kind is LayoutKind.LINEAR_WEIGHT:
            columns = [torch.cat([at(i, j).t() for i in range(side)], dim=1) for j in range(side)]
            return join_strided_blocks(columns, 0, self.stride)
        if self.kind is LayoutKind.VOCAB_TABLE:
            return torch.cat(
                [torch.cat([at(i, j) for j in range(side)], dim=1) for i in range(side)], dim=0
            )
        if self.kind is LayoutKind.FEATURE_VECTOR:
            return join_strided_blocks([at(0, j) for j in range(side)], 0, self.stride)
        return torch.cat([at(0, j) for j in range(side)], dim=1)


def _feature_block(
    tensor: torch.Tensor, dim: int, block: int, side: int, stride: int
) -> torch.Tensor:
    """Block ``block`` of ``side`` along ``dim``, taken from each of ``stride`` equal parts."""
    parts = tensor.chunk(stride, dim=dim)
    if stride == 1:
        return parts[0].chunk(side, dim=dim)[block]
    return torch.cat([part.chunk(side, dim=dim)[block] for part in parts], dim=dim)


def shard_serial_tensor(
    serial: torch.Tensor, layout: ParamLayout, mesh: OptimusMesh
) -> torch.Tensor:
    """This rank's block of a serial megatron-core tensor (a new contiguous tensor)."""
    return layout.block(serial, mesh.row, mesh.column, mesh.side).contiguous().clone()


def set_param_layout(param: torch.nn.Parameter, layout: ParamLayout, mesh: OptimusMesh) -> None:
    """Attach ``layout`` and set megatron-core's ``tensor_model_parallel`` flag.

    megatron-core counts a parameter in grad norms and parameter counts when it is flagged
    ``tensor_model_parallel`` or sits on TP rank 0. Blocks (weights, tables) are distinct on
    every rank: flagged. Column-replicated parameters are flagged only on mesh row 0, so
    each column's copy is counted once (rank 0 is in row 0, so the other rows never count).
    """
    param.optimus_layout = layout
    param.tensor_model_parallel = (not layout.column_replicated) or mesh.row == 0


def init_local_block(
    param: torch.nn.Parameter,
    serial_shape: tuple,
    layout: ParamLayout,
    mesh: OptimusMesh,
    init_method,
    use_cpu_initialization: bool,
) -> None:
    """Initialise ``param`` in place with ``init_method``.

    With ``use_cpu_initialization`` the whole serial tensor is drawn from the default RNG
    (identical on every rank, in megatron-core's order and dtype handling) and this rank's
    block is cut from it, so a model initialises exactly like its single-process twin with
    the same seed. Otherwise the local block is drawn from megatron-core's model-parallel
    RNG stream, which is distinct per mesh position.
    """
    with torch.no_grad():
        if use_cpu_initialization:
            serial = torch.empty(serial_shape, dtype=torch.float, requires_grad=False)
            init_method(serial)
            param.copy_(shard_serial_tensor(serial.to(param.dtype), layout, mesh))
        else:
            with get_cuda_rng_tracker().fork():
                init_method(param)


def load_serial_state_dict(
    module: torch.nn.Module,
    serial: Mapping[str, torch.Tensor],
    mesh: OptimusMesh,
    serial_name: Callable[[str], str] = lambda name: name,
) -> None:
    """Copy this rank's blocks of single-process megatron-core weights into ``module``.

    ``serial`` maps serial parameter names to tensors (e.g. a ``GPTModel.state_dict()`` with
    no tensor or pipeline parallelism); ``serial_name`` maps ``module``'s parameter names to
    those (identity without pipeline parallelism). Parameters without an Optimus layout are
    copied whole. In place, so DDP's buffer views stay valid. ValueError on shape mismatch.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = serial[serial_name(name)]
            layout = getattr(param, "optimus_layout", None)
            if layout is not None:
                value = shard_serial_tensor(value, layout, mesh)
            if value.shape != param.shape:
                raise ValueError(
                    f"{name}: serial block {tuple(value.shape)}, parameter {tuple(param.shape)}"
                )
            param.copy_(value)
