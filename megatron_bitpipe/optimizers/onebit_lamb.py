"""1-bit LAMB (Li et al. 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
Training with LAMB's Convergence Speed") over per-chunk data-parallel groups.

**Warm-up** (the first ``freeze_step`` steps): plain :class:`~.lamb.Lamb` on gradients that
megatron DDP averages in full precision, while tracking per parameter an exponential average
(``coeff_beta``) of LAMB's trust ratio, ``lamb_coeff_freeze``.

**Freeze** (after step ``freeze_step``): the second moment ``exp_avg_sq`` is frozen; a copy,
``exp_avg_sq_fresh``, keeps being updated. Each parameter gets a momentum scaling
coefficient ``scaling_coeff = (mean over the chunk of rms(m)) / rms(m)`` (rms of the logical
parameter), so that one compression scale per chunk fits every parameter of the chunk.

**Compression stage**: gradients are no longer all-reduced. The optimizer takes over every
model chunk's gradient synchronisation (``gradient_exchange`` of
:class:`~megatron_bitpipe.execution.replicas.ChunkDistributedDataParallel`): when the chunk's
gradients are ready (BitPipe's eager ``SYNC``, or megatron's ``finish_grad_sync``), each rank
updates its momentum with its *local* gradient, ``m = beta1 m + (1 - beta1) g``, scales it,
and the chunk's momenta are averaged with 1-bit compression and error feedback over the
chunk's gradient-sync group (:class:`~.compression.CompressedAverager`: BitPipe's mirror pair
x data parallel). Every rank ends with identical bits, so replicas stay identical. The step
then reconstructs the averaged gradient ``(m - beta1 m_prev) / (1 - beta1)`` for
``exp_avg_sq_fresh`` and applies

    u = (m / (1 - beta1^t)) / (sqrt(v_frozen / (1 - beta2^T)) + eps) + weight_decay * w
    factor = max(denom_frozen / denom_fresh), mixed with 1 by ||u without decay|| / ||u||,
             clipped to [factor_min, factor_max] and to last_factor * (1 +- factor_threshold)
    w = w - lr * lamb_coeff_freeze * factor * u

(``T`` = ``freeze_step``), with norms and maxima over whole logical parameters
(:mod:`.norms`). Gradient clipping (``--clip-grad``) acts on the averaged gradients of the
warm-up only: in the compression stage no rank ever holds an averaged gradient.

State: per parameter ``step``, ``exp_avg``, ``exp_avg_sq``, ``exp_avg_sq_fresh``,
``lamb_coeff_freeze``, ``last_factor`` and (compression stage) ``scaling_coeff``; per chunk
the worker and server errors (``state_dict()["error_feedback"]``, layout-dependent). See
``docs/optimizers.md`` for where this follows DeepSpeed's ``OnebitLamb`` and where not.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from .compression import CompressedAverager, padded_size
from .lamb import Lamb
from .norms import logical_maxima, logical_numels, logical_sq_norms

__all__ = ["OnebitLamb", "ChunkMomentum"]


class ChunkMomentum:
    """The compressed momentum exchange of one model chunk (its DDP's ``gradient_exchange``).

    ``pairs`` are the chunk's (model parameter, optimizer parameter) in a fixed order (the
    same on every rank of ``group``); the model parameter's ``main_grad`` is the local
    gradient, the optimizer parameter (the fp32 main copy under mixed precision) keys the
    optimizer state. ``gradient_factor`` is what the DDP's own reduction would multiply the local
    gradient by beyond its average over ``group``
    (:attr:`~megatron_bitpipe.execution.replicas.ChunkDistributedDataParallel.replica_gradient_factor`).
    """

    def __init__(
        self,
        optimizer: "OnebitLamb",
        pairs: List[Tuple[torch.Tensor, torch.Tensor]],
        group: dist.ProcessGroup,
        gradient_factor: float = 1.0,
    ):
        self.optimizer = optimizer
        self.gradient_factor = gradient_factor
        self.pairs = pairs
        self.numel = sum(main.numel() for _, main in pairs)
        device = pairs[0][1].device if pairs else None
        self.averager = (
            CompressedAverager(padded_size(self.numel, group.size()), group, device) if group.size() > 1 and pairs else None
        )
        self._previous: Optional[List[torch.Tensor]] = None

    def _momenta(self) -> List[torch.Tensor]:
        return [self.optimizer.state[main]["exp_avg"] for _, main in self.pairs]

    def start(self) -> None:
        """Local momentum update and phase 1 of the exchange (the chunk's gradients are final)."""
        if self._previous is not None:
            raise RuntimeError("the chunk's momentum exchange was started twice in one step")
        betas = {id(p): g["betas"][0] for g in self.optimizer.param_groups for p in g["params"]}
        momenta = self._momenta()
        self._previous = [m.clone() for m in momenta]
        with torch.no_grad():
            for (model, main), m in zip(self.pairs, momenta):
                beta1 = betas[id(main)]
                m.mul_(beta1).add_(model.main_grad.float(), alpha=(1 - beta1) * self.gradient_factor)
            if self.averager is not None:
                scaled = [m.reshape(-1) * self.optimizer.state[main]["scaling_coeff"] for (_, main), m in zip(self.pairs, momenta)]
                padding = self.averager.numel - self.numel
                self.averager.start(torch.cat(scaled + [momenta[0].new_zeros(padding)]))

    def finish(self) -> None:
        """Complete the exchange: every rank of the group holds the same averaged momenta."""
        if self._previous is None:
            self.start()
        if self.averager is None or not self.averager.in_flight:
            return
        averaged = self.averager.finish()
        offset = 0
        with torch.no_grad():
            for (_, main), m in zip(self.pairs, self._momenta()):
                m.copy_(averaged[offset : offset + m.numel()].view_as(m) / self.optimizer.state[main]["scaling_coeff"])
                offset += m.numel()

    def take_previous(self) -> List[torch.Tensor]:
        """The momenta before this step's update (consumed by the optimizer step)."""
        if self._previous is None:
            raise RuntimeError(
                "1-bit LAMB compression stage: a model chunk's momentum was not exchanged this step "
                "(its gradient synchronisation did not run)"
            )
        previous, self._previous = self._previous, None
        return previous


class OnebitLamb(Lamb):
    """1-bit LAMB (module docstring). Build it, wrap it in megatron's optimizer wrapper, then
    :meth:`attach` the DDP model chunks (the factory does this)."""

    def __init__(
        self,
        params: Iterable,
        freeze_step: int,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
        tp_group: Optional[dist.ProcessGroup] = None,
        coeff_beta: float = 0.9,
        factor_min: float = 0.5,
        factor_max: float = 4.0,
        factor_threshold: float = 0.1,
    ):
        if freeze_step < 1:
            raise ValueError(f"--onebit-freeze-iters must be >= 1, got {freeze_step}")
        super().__init__(params, lr, betas, eps, weight_decay, min_coeff, max_coeff, tp_group)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_min, self.factor_max, self.factor_threshold = factor_min, factor_max, factor_threshold
        self.chunks: List[ChunkMomentum] = []
        self._ddp_chunks: List[torch.nn.Module] = []

    @staticmethod
    def init_state(optimizer: "OnebitLamb", config=None) -> None:
        """megatron's ``init_state_fn``: the warm-up's initial state."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if "exp_avg" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq_fresh"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["lamb_coeff_freeze"] = 0.0
                    state["last_factor"] = 1.0

    # -- model chunks --------------------------------------------------------------------

    def attach(self, ddp_chunks: Sequence[torch.nn.Module], optimizer_param_of: Dict[int, torch.Tensor]) -> None:
        """Take the chunks' parameters in their registration order; ``optimizer_param_of``
        maps ``id(model parameter)`` to the parameter this optimizer holds for it."""
        self.init_state(self)
        covered = set()
        for ddp in ddp_chunks:
            if not hasattr(ddp, "gradient_exchange"):
                raise TypeError(
                    "--optimizer onebit_lamb takes over the chunks' gradient synchronisation: wrap them with "
                    "megatron_bitpipe.execution.replicas.wrap_ddp"
                )
            pairs = [(p, optimizer_param_of[id(p)]) for p in unwrap_model(ddp).parameters() if p.requires_grad]
            covered.update(id(main) for _, main in pairs)
            self.chunks.append(ChunkMomentum(self, pairs, ddp.dp_cp_group, ddp.replica_gradient_factor))
        missing = [p for g in self.param_groups for p in g["params"] if id(p) not in covered]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters belong to no model chunk")
        self._ddp_chunks = list(ddp_chunks)
        self._install()

    @property
    def steps_done(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state[p]:
                    return int(self.state[p]["step"])
        return 0

    @property
    def compressing(self) -> bool:
        """Whether the next step runs in the compression stage."""
        return self.steps_done >= self.freeze_step

    def _install(self) -> None:
        for ddp, chunk in zip(self._ddp_chunks, self.chunks, strict=True):
            ddp.gradient_exchange = chunk if self.compressing else None

    # -- steps ---------------------------------------------------------------------------

    def _after_step(self, entries, ratios) -> None:
        for (_, p, _), ratio in zip(entries, ratios):
            if ratio is not None:
                state = self.state[p]
                state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * ratio
        if self.steps_done == self.freeze_step:
            self._freeze()

    def _freeze(self) -> None:
        """End of the warm-up: frozen variance, fresh copy, momentum scaling coefficients."""
        for chunk in self.chunks:
            mains = [main for _, main in chunk.pairs]
            momenta = [self.state[p]["exp_avg"] for p in mains]
            rms = (logical_sq_norms(momenta, mains, self.tp_group) / logical_numels(mains, self.tp_group).clamp(min=1)).sqrt()
            united = rms.mean().item() if len(mains) else 0.0
            for p, value in zip(mains, rms.tolist()):
                self.state[p]["exp_avg_sq_fresh"] = self.state[p]["exp_avg_sq"].clone()
                self.state[p]["scaling_coeff"] = united / value if value > 0 and united > 0 else 1.0
        self._install()

    @torch.no_grad()
    def step(self, closure=None):
        if not self.compressing:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        entries = []
        for chunk in self.chunks:
            for (_, p), previous in zip(chunk.pairs, chunk.take_previous()):
                entries.append((groups[id(p)], p, previous))
        params, prelims, updates, ratios_of_denoms = [], [], [], []
        for group, p, previous in entries:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            state["step"] += 1
            t = int(state["step"])
            m, fresh = state["exp_avg"], state["exp_avg_sq_fresh"]
            grad = (m - previous * beta1).div_(1 - beta1)
            fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2**self.freeze_step)).sqrt_().add_(group["eps"])
            denom_fresh = (fresh / (1 - beta2**t)).sqrt_().add_(group["eps"])
            prelim = (m / (1 - beta1**t)).div_(denom)
            update = prelim + group["weight_decay"] * p if group["weight_decay"] != 0 else prelim
            params.append(p)
            prelims.append(prelim)
            updates.append(update)
            ratios_of_denoms.append(denom.div_(denom_fresh))
        maxima = logical_maxima(ratios_of_denoms, self.tp_group).tolist()
        norms = logical_sq_norms(prelims + updates, params + params, self.tp_group).sqrt().tolist()
        n = len(params)
        for i, ((group, p, _), update) in enumerate(zip(entries, updates)):
            state = self.state[p]
            factor = maxima[i]
            if group["weight_decay"] != 0 and norms[n + i] > 0:
                mix = min(1.0, norms[i] / norms[n + i])
                factor = factor * mix + (1.0 - mix)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = state["last_factor"]
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            state["last_factor"] = factor
            p.add_(update, alpha=-group["lr"] * state["lamb_coeff_freeze"] * factor)
        return loss

    # -- checkpoints ---------------------------------------------------------------------

    def error_feedback_state(self) -> List[Optional[Dict[str, torch.Tensor]]]:
        """Per chunk: this rank's worker and server errors (None for a chunk exchanged over
        a group of one). Layout-dependent: they restore only into the same layout."""
        return [
            None if c.averager is None else {"worker_error": c.averager.worker_error, "server_error": c.averager.server_error}
            for c in self.chunks
        ]

    def load_error_feedback_state(self, saved: Optional[List[Optional[Dict[str, torch.Tensor]]]]) -> bool:
        """Restore :meth:`error_feedback_state`; False (errors reset to zero) if ``saved`` is
        None or does not fit this layout's chunks."""
        fits = saved is not None and len(saved) == len(self.chunks) and all(
            (s is None) == (c.averager is None)
            and (s is None or (s["worker_error"].shape == c.averager.worker_error.shape and s["server_error"].shape == c.averager.server_error.shape))
            for s, c in zip(saved, self.chunks)
        )
        for index, chunk in enumerate(self.chunks):
            if chunk.averager is not None:
                source = saved[index] if fits else None
                for key in ("worker_error", "server_error"):
                    current = getattr(chunk.averager, key)
                    setattr(chunk.averager, key, current.zero_() if source is None else source[key].to(current).clone())
        self._install()
        return fits

    def state_dict(self) -> dict:
        """torch's state dict with the per-parameter numbers (``lamb_coeff_freeze``,
        ``last_factor``, ``scaling_coeff``) moved from ``state`` to ``coefficients`` (same
        parameter ids), so that ``state`` holds only parameter-shaped tensors and ``step`` as
        megatron's sharded checkpoints expect, plus this rank's ``error_feedback``."""
        state = super().state_dict()
        coefficients = {}
        for index, entry in state["state"].items():
            numbers = {key: value for key, value in entry.items() if not torch.is_tensor(value)}
            coefficients[index] = numbers
            state["state"][index] = {key: value for key, value in entry.items() if torch.is_tensor(value)}
        state["coefficients"] = coefficients
        state["error_feedback"] = self.error_feedback_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("error_feedback", None)
        coefficients = state_dict.pop("coefficients", {})
        state_dict["state"] = {
            index: {**entry, **coefficients.get(index, {})} for index, entry in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        self.load_error_feedback_state(saved)
