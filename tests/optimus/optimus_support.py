"""Helpers shared by the Optimus tests (run inside launched ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

from megatron_bitpipe.optimus.mesh import OptimusMesh, build_optimus_mesh
from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

#: tolerance of every 2-D vs serial comparison (fp32)
RTOL, ATOL = 1e-5, 1e-6


def world_mesh() -> OptimusMesh:
    """Mesh over the whole job (its TP group is the default group's ranks)."""
    return build_optimus_mesh(dist.new_group(list(range(dist.get_world_size()))))


def transposed(mesh: OptimusMesh) -> OptimusMesh:
    """The same ranks with rows and columns swapped: a self-consistent but wrong mesh."""
    return OptimusMesh(
        mesh.tp_group, mesh.side, mesh.column, mesh.row, mesh.column_group, mesh.row_group
    )


def random(*shape, seed: int) -> torch.Tensor:
    """The same fp32 N(0, 1) tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def block(tensor: torch.Tensor, dims: dict, mesh: OptimusMesh) -> torch.Tensor:
    """Block of ``tensor``: ``dims`` maps a dimension to "row" or "column" (the mesh index
    that selects the block along it)."""
    for dim, axis in dims.items():
        index = mesh.row if axis == "row" else mesh.column
        tensor = tensor.chunk(mesh.side, dim=dim)[index]
    return tensor


def check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """assert_close at the test tolerance, naming the quantity and the rank."""
    torch.testing.assert_close(
        actual,
        expected,
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"rank {dist.get_rank()}: {name}: {m}",
    )


def tiny_config(**overrides) -> TransformerConfig:
    """A one-layer CPU-friendly fp32 config (see ``tiny_gpt_config``), hidden 8, 2 heads."""
    settings = dict(num_layers=1, hidden_size=8, num_attention_heads=2)
    settings.update(overrides)
    return tiny_gpt_config(**settings)
