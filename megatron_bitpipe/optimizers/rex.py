"""The REX learning-rate schedule inside megatron-core's ``OptimizerParamScheduler``.

REX (Chen, Wolfe, Kyrillidis 2021, "REX: Revisiting Budgeted Training with an Improved
Schedule") decays the learning rate after warm-up as

    lr = min_lr + (max_lr - min_lr) * (1 - z) / (1 - beta * z)

with ``z`` in [0, 1] the elapsed fraction of the decay phase (sampled at every step, as
megatron's other styles). ``beta = 0`` is the linear decay, ``beta = 1/2`` the paper's
schedule (``(1 - z) / (1/2 + (1 - z)/2)``), and larger ``beta`` keeps the rate high for
longer. :class:`ParamScheduler` is megatron-core's scheduler with ``"rex"`` as one more
``lr_decay_style`` and as a ``lr_wsd_decay_style`` (the annealing phase of WSD); every
other style is megatron's own code.
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["REX", "rex_coefficient", "ParamScheduler"]

REX = "rex"


def rex_coefficient(z: float, beta: float) -> float:
    """``(1 - z) / (1 - beta z)``: 1 at ``z = 0``, 0 at ``z = 1``, decreasing for ``beta < 1``."""
    if not 0.0 <= z <= 1.0:
        raise ValueError(f"REX decay fraction {z} outside [0, 1]")
    return (1.0 - z) / (1.0 - beta * z)


class ParamScheduler(OptimizerParamScheduler):
    """megatron-core's ``OptimizerParamScheduler`` that also knows ``"rex"``.

    ``rex_beta`` (``--rex-beta``) must lie in [0, 1). Same steps, warm-up, weight-decay
    schedule and checkpoint behaviour as megatron's class; ``state_dict`` also carries
    ``rex_beta``, and loading a state saved with another beta is refused like megatron
    refuses other changed settings (unless overriding or using the checkpoint's values).
    """

    def __init__(self, *args, rex_beta: float = 0.5, **kwargs):
        if not 0.0 <= rex_beta < 1.0:
            raise ValueError(f"--rex-beta must lie in [0, 1), got {rex_beta}")
        self.rex_beta = rex_beta
        super().__init__(*args, **kwargs)

    def get_lr(self, param_group: dict) -> float:
        wsd_rex = self.lr_decay_style == "WSD" and self.lr_wsd_decay_style == REX
        if self.lr_decay_style != REX and not wsd_rex:
            return super().get_lr(param_group)
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if wsd_rex:
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                return max_lr
            z = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
        else:
            z = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        return min_lr + (max_lr - min_lr) * rex_coefficient(z, self.rex_beta)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["rex_beta"] = self.rex_beta
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("rex_beta", None)
        if saved is not None:
            self.rex_beta = self._check_and_set(self.rex_beta, saved, "REX beta (--rex-beta)")
        super().load_state_dict(state_dict)
