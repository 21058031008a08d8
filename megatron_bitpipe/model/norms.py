"""A torch LayerNorm / RMSNorm that megatron-core's local layer spec can use with sequence parallelism.

Without apex, megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which
refuses ``sequence_parallel``. A norm acts on each token independently, so it runs on a
sequence shard unchanged; the only thing sequence parallelism needs is that the norm's
weight gradients, computed from different tokens on each tensor-parallel rank, are summed
over the tensor-parallel group. megatron's ``finalize_model_grads`` does that for every
parameter marked ``sequence_parallel = True``, which this class does.

It also gives the zero-centered gamma (``--apply-layernorm-1p``) that megatron-core's torch norm
refuses without apex or Transformer Engine: the weight holds gamma - 1 (initialised 0, as
megatron's init rules for it say) and the norm scales by ``weight + 1``, as apex's and
Transformer Engine's zero-centered norms do.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["SequenceParallelTorchNorm", "ZeroCenteredLayerNorm", "ZeroCenteredRMSNorm", "with_sequence_parallel_norms"]


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose ``weight`` is gamma - 1: it starts at 0 and scales by ``weight + 1``."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose ``weight`` is gamma - 1: it starts at 0 and scales by ``weight + 1``."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(input, self.normalized_shape, self.weight + 1, self.eps)


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (``config.normalization``), their
    zero-centered forms under ``config.layernorm_zero_centered_gamma``.

    Same arguments as megatron's norm modules; the result is a plain torch module whose
    parameters carry ``sequence_parallel = config.sequence_parallel``.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.memory_efficient_layer_norm:
            raise ValueError("--memory-efficient-layer-norm needs apex or Transformer Engine")
        if config.layernorm_zero_centered_gamma:
            norms = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}
        else:
            norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"--normalization {config.normalization} is not supported without Transformer Engine")
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_norms(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with every ``WrappedTorchNorm`` submodule swapped for :class:`SequenceParallelTorchNorm`."""
    submodules = spec.submodules
    updates = {
        f.name: SequenceParallelTorchNorm
        for f in dataclasses.fields(submodules)
        if getattr(submodules, f.name) is WrappedTorchNorm
    }
    for f in dataclasses.fields(submodules):
        child = getattr(submodules, f.name)
        if isinstance(child, ModuleSpec) and dataclasses.is_dataclass(child.submodules):
            replaced = with_sequence_parallel_norms(child)
            if replaced is not child:
                updates[f.name] = replaced
    if not updates:
        return spec
    return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, **updates))
