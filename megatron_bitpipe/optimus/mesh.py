"""The q×q device mesh that Optimus 2D tensor parallelism lays over megatron-core's TP group.

A tensor-parallel group of p = q² ranks is viewed as a q×q mesh. The rank with group rank
``r`` (its index in the TP group's rank list) sits at mesh position ``(row, column) =
divmod(r, q)``:

* the **row group** of a rank is the q ranks of its mesh row (same ``row``, columns
  0..q−1, in column order);
* the **column group** is the q ranks of its mesh column (same ``column``, rows 0..q−1,
  in row order).

Placement convention used by every Optimus module: the rank at ``(i, j)`` holds batch
block ``i`` and hidden (feature) block ``j`` of an activation, and block ``(i, j)`` of a
weight matrix. So the row group shares one batch block and splits the features (heads,
vocabulary) across its members; the column group shares one feature block and splits the
batch.

Everything is derived from the TP group's rank list, never from global-rank arithmetic,
so any megatron rank order (``--order``, non-contiguous TP groups) gives a correct mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch.distributed as dist


def mesh_side(tensor_parallel_size: int) -> int:
    """Side q of the mesh for a TP size of q²; ValueError unless the size is a square ≥ 4."""
    side = math.isqrt(tensor_parallel_size)
    if side * side != tensor_parallel_size or side < 2:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel_size} is not a square q*q with q >= 2, "
            "which --tensor-parallel-mode optimus2d requires (e.g. 4, 9, 16)"
        )
    return side


def mesh_rows(tp_ranks: Sequence[int], side: int) -> List[List[int]]:
    """Global ranks of each mesh row of one TP group, row by row, each in column order."""
    return [list(tp_ranks[row * side : (row + 1) * side]) for row in range(side)]


def mesh_columns(tp_ranks: Sequence[int], side: int) -> List[List[int]]:
    """Global ranks of each mesh column of one TP group, column by column, each in row order."""
    return [list(tp_ranks[column::side]) for column in range(side)]


@dataclass(frozen=True)
class OptimusMesh:
    """This rank's place in the q×q mesh and the two process groups it communicates over.

    Invariants:
        * ``side ** 2 == tp_group.size()``; ``row, column = divmod(tp_group.rank(), side)``.
        * In ``row_group`` this rank has group rank ``column``; the member with group rank
          ``k`` is mesh position ``(row, k)``.
        * In ``column_group`` this rank has group rank ``row``; the member with group rank
          ``k`` is mesh position ``(k, column)``.
    """

    tp_group: dist.ProcessGroup
    side: int
    row: int
    column: int
    row_group: dist.ProcessGroup
    column_group: dist.ProcessGroup

    @property
    def tp_rank(self) -> int:
        """Group rank in the TP group, ``row * side + column`` (seeds this position's RNG)."""
        return self.row * self.side + self.column


def build_optimus_mesh(tp_group: dist.ProcessGroup) -> OptimusMesh:
    """Create the row and column groups of every TP group and return this rank's mesh.

    Collective over the default process group, like ``torch.distributed.new_group``: every
    rank of the job must call it, each passing its own TP group. The TP size is checked
    before any communication. Each rank contributes its TP group's rank list (one
    ``all_gather_object``), so all ranks create the same groups in the same order.
    """
    tp_ranks = dist.get_process_group_ranks(tp_group)
    side = mesh_side(len(tp_ranks))

    every_tp_group: List[List[int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every_tp_group, tp_ranks)
    distinct_tp_groups = sorted({tuple(ranks) for ranks in every_tp_group})
    if any(len(ranks) != side * side for ranks in distinct_tp_groups):
        raise ValueError(f"TP groups of different sizes: {distinct_tp_groups}")

    all_rows = [row for ranks in distinct_tp_groups for row in mesh_rows(ranks, side)]
    all_columns = [col for ranks in distinct_tp_groups for col in mesh_columns(ranks, side)]
    row_group, _ = dist.new_subgroups_by_enumeration(all_rows)
    column_group, _ = dist.new_subgroups_by_enumeration(all_columns)
    return optimus_mesh(tp_group, row_group, column_group)


def optimus_mesh(tp_group: dist.ProcessGroup, row_group: dist.ProcessGroup, column_group: dist.ProcessGroup) -> OptimusMesh:
    """This rank's mesh from its TP group and the row and column groups holding it (made from
    :func:`mesh_rows` / :func:`mesh_columns` of its TP group's rank list); RuntimeError when
    their order breaks the mesh. Local."""
    tp_ranks = dist.get_process_group_ranks(tp_group)
    side = mesh_side(len(tp_ranks))
    row, column = divmod(tp_group.rank(), side)
    # torch orders a group's ranks ascending; TP rank lists are ascending too, so slices of
    # them keep mesh order. Check it, since every broadcast root below relies on it.
    if row_group.rank() != column or column_group.rank() != row:
        raise RuntimeError(
            f"mesh order broken: TP ranks {tp_ranks}, row group "
            f"{dist.get_process_group_ranks(row_group)}, column group "
            f"{dist.get_process_group_ranks(column_group)}"
        )
    return OptimusMesh(tp_group, side, row, column, row_group, column_group)
