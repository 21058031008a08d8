"""Helpers shared by the Optimus tests (run inside launched ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

from megatron_bitpipe.optimus.mesh import OptimusMesh, build_optimus_mesh

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
    """A CPU-friendly transformer config: fp32, CPU initialisation, no fused kernels."""
    settings = dict(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)
