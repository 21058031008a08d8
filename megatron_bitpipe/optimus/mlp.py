"""The MLP of Optimus 2D: megatron-core's ``MLP`` storing only its pre-activation.

``linear_fc1`` and ``linear_fc2`` are :class:`~megatron_bitpipe.optimus.layers.OptimusLinear`
(built by megatron-core's ``MLP`` constructor, so sizes, the gated ``stride=2`` layout and
init methods are megatron's). Between them, the activation (with the fc1 bias added first,
and the gated linear unit when ``config.gated_linear_unit``) runs through
:func:`~megatron_bitpipe.optimus.recompute.recomputed`: autograd keeps only the
pre-activation ``z`` (``[s, b/q, ffn/q]``, twice that when gated); the activation's own
backward and ``linear_fc2``'s weight gradient recompute the activation from ``z``. megatron's
unfused MLP keeps ``z`` *and* the activation output (for a gated unit also the gate's
activation and the linear half), so this halves the MLP's activation memory (gated: 2/5).

Compute: two extra evaluations of the activation on ``[s, b/q, ffn/q]`` elements per
backward, no extra communication. The bias-activation fusion flags select megatron's fused
kernels for the same math and are ignored here.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from megatron.core.transformer import transformer_layer
from megatron.core.transformer.mlp import MLP

from .recompute import recomputed


class OptimusMLP(MLP):
    """megatron-core ``MLP`` on ``[s, b/q, h/q]`` blocks with the activation recomputed in
    backward. Same constructor (the spec passes the Optimus linears and the mesh's
    ``tp_group``), dense layers only.

    megatron-core 0.18+ ``TransformerLayer`` also passes ``pg_collection`` (its group is the
    spec's ``tp_group`` here) and ``is_mtp_layer`` (multi-token prediction is not supported).
    """

    def __init__(self, config, submodules, is_expert: bool = False, *, pg_collection=None, is_mtp_layer: bool = False, **kwargs):
        if is_expert or config.use_te_activation_func:
            raise ValueError("Optimus 2D MLPs are dense and use config.activation_func")
        if is_mtp_layer:
            raise ValueError("Optimus 2D does not support multi-token prediction layers")
        super().__init__(config, submodules, is_expert=is_expert, **kwargs)

    def activation(self, z: torch.Tensor) -> torch.Tensor:
        """``activation_func(z)``, or for a gated linear unit with ``z = [gate | linear]``
        (megatron's stride-2 fc1 layout): ``activation_func(gate) · (linear + offset)``,
        with megatron's optional clamping."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(z)
        gate, linear = torch.chunk(z, 2, dim=-1)
        clamp = config.activation_func_clamp_value
        if clamp is not None:
            gate = gate.clamp(max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + config.glu_linear_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """The linears' entries as they describe themselves: the fused gated fc1 already maps
        its two halves (megatron's ``MLP`` would re-split it as a 1-D block)."""
        state = {}
        for name, module in self._modules.items():
            state.update(module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return state

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """``(output [s, b/q, h/q], fc2 bias or None)`` like megatron-core's ``MLP``."""
        if per_token_scale is not None:
            raise ValueError("Optimus 2D does not support MoE per-token scaling")
        z, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            z = z + bias
        return self.linear_fc2(recomputed(self.activation, z))


class _DropUnknownMlpNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


@contextlib.contextmanager
def optimus_mlp_known():
    """Silence megatron-core's "Unknown MLP type ... Using default kwargs" while building.

    ``TransformerLayer`` logs it (once per layer) for every MLP class other than its own;
    for :class:`OptimusMLP` the spec passes the one keyword it needs (``tp_group``), so the
    notice says nothing. Only that message of that logger is dropped, only inside the block.
    """
    log = transformer_layer.logger
    notice_filter = _DropUnknownMlpNotice()
    log.addFilter(notice_filter)
    try:
        yield
    finally:
        log.removeFilter(notice_filter)
