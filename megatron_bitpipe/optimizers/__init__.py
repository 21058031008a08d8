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
* :mod:`.factory` — building them like megatron-core's own optimizers, their flags and rules.

See ``docs/optimizers.md``.
"""

from .factory import (
    OPTIMIZERS,
    OptimizerChoice,
    add_optimizer_args,
    averaged_weights,
    build_megatron_optimizer,
    lr_for_logging,
    megatron_parts,
    optimizer_problems,
)
from .rex import REX, ParamScheduler, rex_coefficient

__all__ = [
    "OPTIMIZERS",
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
