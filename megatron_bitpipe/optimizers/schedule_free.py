"""Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled") from the
``schedulefree`` package, made exact around evaluation and checkpoints.

``schedulefree.AdamWScheduleFree`` keeps ``z`` (the SGD-like sequence) and ``exp_avg_sq`` per
parameter and stores in the parameter itself either ``y`` (train mode: where gradients are
taken) or the averaged iterate ``x`` (eval mode: what is evaluated and saved). Its
``eval()``/``train()`` switch between them by interpolating with ``z``; a train→eval→train
round trip is not bit-exact in floating point (measured: up to 1.2e-7 on fp32 weights of
order 1), so evaluating or saving would perturb the training run. :class:`ScheduleFreeAdamW` keeps a copy of ``y``
(state ``"y"``) while in eval mode and puts it back on ``train()``: training with evaluations
and checkpoints is bit-identical to training without them, and a checkpoint saved in eval
mode (weights ``x``, state ``z``, ``exp_avg_sq``, ``y``) resumes the exact run.

The package's other behaviours the wrappers rely on: ``step()`` raises unless in train mode
(the optimizer is put in train mode when built), it divides ``p.grad`` in place (megatron's
gradient buffers are zeroed before the next step anyway), and it has its own linear warm-up
over ``warmup_steps`` (``--lr-warmup-iters``; megatron's scheduler then runs constant).

The package is an optional extra (``pip install 'megatron-bitpipe[schedulefree]'``); this
module imports it, :func:`megatron_bitpipe.optimizers.build_megatron_optimizer` reports its
absence naming the flag. :func:`megatron_bitpipe.optimizers.averaged_weights` switches a
megatron optimizer's Schedule-Free parts around evaluation and checkpointing.
"""

from __future__ import annotations

import torch
from schedulefree import AdamWScheduleFree

__all__ = ["ScheduleFreeAdamW"]


class ScheduleFreeAdamW(AdamWScheduleFree):
    """``schedulefree.AdamWScheduleFree`` with an exact eval→train round trip (module
    docstring); starts in train mode. ``group_state``: the parameter-group entries that are
    optimizer state (a checkpoint restores them; the others are flags or the scheduler's)."""

    group_state = ("k", "weight_sum", "lr_max", "scheduled_lr", "train_mode")
    #: the model must hold the averaged iterate for evaluation and checkpoints (``averaged_weights``)
    averages_weights = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train()

    @torch.no_grad()
    def eval(self):
        for group in self.param_groups:
            if group["train_mode"]:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        self.state[p]["y"] = p.detach().clone()
        super().eval()

    @torch.no_grad()
    def train(self):
        stashed = [
            (p, self.state[p].pop("y"))
            for group in self.param_groups
            if not group["train_mode"]
            for p in group["params"]
            if "y" in self.state[p]
        ]
        super().train()
        for p, y in stashed:
            p.copy_(y)

    @staticmethod
    def init_state(optimizer: "ScheduleFreeAdamW", config=None) -> None:
        """megatron's ``init_state_fn``: the package's initial state for parameters without one."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if "z" not in state:
                    state["z"] = p.detach().clone(memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if not group["train_mode"] and "y" not in state:
                    state["y"] = p.detach().clone()

    def lr_for_logging(self) -> float:
        """The learning rate the next step uses (the package's warm-up applied), first group."""
        group = self.param_groups[0]
        warmup = group["warmup_steps"]
        return group["lr"] * ((group["k"] + 1) / warmup if group["k"] < warmup else 1.0)
