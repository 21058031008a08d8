"""Megatron-Bridge recipes with this package's pipeline schedules (``docs/bridge.md``).

A recipe's model becomes a :class:`BitPipeGPTModelProvider` (Bridge's ``GPTModelProvider`` plus
``pipeline_schedule``, ``split_backward``, ``schedule_costs``); :func:`install` checks the
container and installs the schedule; Bridge's ``pretrain`` runs with :func:`forward_step`::

    cfg.model = BitPipeGPTModelProvider.from_provider(cfg.model, pipeline_schedule="bitpipe")
    install(cfg)
    pretrain(cfg, forward_step)

Needs Megatron-Bridge (``pip install megatron-bridge``); the rest of this package does not.
"""

from .provider import BitPipeGPTModelProvider
from .route import forward_step, install

__all__ = ["BitPipeGPTModelProvider", "forward_step", "install"]
