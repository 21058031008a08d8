"""Megatron-Bridge recipes with this package's pipeline schedules (``docs/bridge.md``).

A recipe's model becomes a :class:`BitPipeGPTModelProvider` (Bridge's ``GPTModelProvider`` plus
``pipeline_schedule``, ``split_backward``, ``schedule_costs``), or on Bridge's model-config route
a :class:`BitPipeGPTModelConfig` (megatron-core's ``GPTModelConfig`` plus the same fields);
:func:`install` checks the container and installs the schedule; Bridge's ``pretrain`` runs with
:func:`forward_step`::

    cfg.model = BitPipeGPTModelProvider.from_provider(cfg.model, pipeline_schedule="bitpipe")
    install(cfg)
    pretrain(cfg, forward_step)

Needs Megatron-Bridge (``pip install megatron-bridge``); the rest of this package does not.
"""

from .builder import BitPipeGPTModelConfig
from .provider import BitPipeGPTModelProvider
from .route import forward_step, install

__all__ = ["BitPipeGPTModelConfig", "BitPipeGPTModelProvider", "forward_step", "install"]
