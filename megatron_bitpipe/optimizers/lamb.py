"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning") as a torch optimizer
for megatron-core's wrappers.

For each parameter ``w`` with gradient ``g`` at step ``t`` (1-based), in fp32:

    m = beta1 m + (1 - beta1) g            v = beta2 v + (1 - beta2) g^2
    u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
    r = clip(||w|| / ||u||, min_coeff, max_coeff)   (r = 1 if either norm is 0)
    w = w - lr * r * u

``||.||`` is the norm of the whole logical parameter: blocks of tensor-parallel (1-D or
Optimus 2D) parameters reduce their squared norms over ``tp_group``
(:mod:`~megatron_bitpipe.optimizers.norms`), so every layout takes the same step as a single
process. Every parameter gets the trust ratio, including those megatron excludes from weight
decay (biases, norms; their ``weight_decay`` is 0 from megatron's scheduler), as in the
paper's algorithm. State per parameter: ``exp_avg`` (m), ``exp_avg_sq`` (v) and ``step``,
as torch's Adam, so megatron's checkpointing of Adam states applies unchanged.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .norms import logical_sq_norms

__all__ = ["Lamb", "trust_ratios"]


def trust_ratios(
    weights: List[torch.Tensor],
    updates: List[torch.Tensor],
    min_coeffs: List[float],
    max_coeffs: List[float],
    tp_group: Optional[dist.ProcessGroup],
) -> List[float]:
    """``clip(||w|| / ||u||, min, max)`` per parameter over the logical parameters (one
    collective for all); None where a norm is 0 (the ratio is undefined; LAMB then uses 1)."""
    if not weights:
        return []
    norms = logical_sq_norms(weights + updates, weights + weights, tp_group).sqrt().tolist()
    n = len(weights)
    ratios: List[Optional[float]] = []
    for w_norm, u_norm, low, high in zip(norms[:n], norms[n:], min_coeffs, max_coeffs):
        ratios.append(min(max(w_norm / u_norm, low), high) if w_norm > 0 and u_norm > 0 else None)
    return ratios


class Lamb(torch.optim.Optimizer):
    """LAMB with Adam bias correction and a clipped, TP-reduced trust ratio (module docstring).

    ``tp_group`` is the tensor-parallel group of the parameters (None: no tensor
    parallelism); every rank of it must step the same parameter groups in the same order.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
        tp_group: Optional[dist.ProcessGroup] = None,
    ):
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"LAMB trust-ratio bounds need 0 < --lamb-min-coeff <= --lamb-max-coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_coeff=min_coeff, max_coeff=max_coeff)
        super().__init__(params, defaults)
        self.tp_group = tp_group

    @staticmethod
    def init_state(optimizer: "Lamb", config=None) -> None:
        """megatron's ``init_state_fn``: zero moments for parameters without state."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _moments(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """Advance ``p``'s moments with its gradient; returns the bias-corrected Adam direction."""
        state = self.state[p]
        if "exp_avg" not in state:
            self.init_state(self)
        state["step"] += 1
        t = int(state["step"].item())
        beta1, beta2 = group["betas"]
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        return (m / (1 - beta1**t)).div_(denom)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._moments(group, p)
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                entries.append((group, p, update))
        ratios = trust_ratios(
            [p for _, p, _ in entries],
            [u for _, _, u in entries],
            [g["min_coeff"] for g, _, _ in entries],
            [g["max_coeff"] for g, _, _ in entries],
            self.tp_group,
        )
        for (group, p, update), ratio in zip(entries, ratios):
            p.add_(update, alpha=-group["lr"] * (1.0 if ratio is None else ratio))
        self._after_step(entries, ratios)
        return loss

    def _after_step(self, entries, ratios) -> None:
        """Hook for subclasses: the step's (group, parameter, update) entries and trust ratios."""
