"""Optimizers and learning-rate schedules beyond megatron-core's Adam and SGD.

* :mod:`.rex` — the REX decay (``--lr-decay-style rex``, ``--rex-beta``) in megatron's
  ``OptimizerParamScheduler``;
* :mod:`.lamb` — LAMB (``--optimizer lamb``) with trust ratios over whole logical parameters
  (:mod:`.norms`: tensor-parallel and Optimus 2D blocks reduced);
* :mod:`.onebit_lamb` — 1-bit LAMB (``--optimizer onebit_lamb``): LAMB warm-up, then frozen
  variance and momenta averaged with 1-bit compression (:mod:`.compression`) over each chunk's
  gradient-sync group;
* :mod:`.schedule_free` — Schedule-Free AdamW (``--optimizer schedulefree_adamw``) from the
  ``schedulefree`` package (optional extra), exact across evaluation and checkpoints;
* :mod:`.flags` — their flags and rules (pure Python: imported by the parsers before torch);
* :mod:`.factory` — building them like megatron-core's own optimizers.

See ``docs/optimizers.md``.
"""

import importlib

from .flags import MEGATRON_OPTIMIZERS, OPTIMIZERS, OWN_OPTIMIZERS, REX, OptimizerChoice, add_optimizer_args, optimizer_problems

#: name -> submodule, for the names that need torch and megatron-core: imported on first use,
#: so the flags (:mod:`.flags`) can be parsed and checked without them
_LAZY = {
    "averaged_weights": "factory",
    "build_megatron_optimizer": "factory",
    "lr_for_logging": "factory",
    "megatron_parts": "factory",
    "ParamScheduler": "rex",
    "rex_coefficient": "rex",
}

__all__ = [
    "OPTIMIZERS",
    "MEGATRON_OPTIMIZERS",
    "OWN_OPTIMIZERS",
    "OptimizerChoice",
    "add_optimizer_args",
    "averaged_weights",
    "build_megatron_optimizer",
    "lr_for_logging",
    "megatron_parts",
    "optimizer_problems",
    "REX",
    "ParamScheduler",
    "rex_coefficient",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
