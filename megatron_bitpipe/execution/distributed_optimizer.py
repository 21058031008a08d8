"""megatron-core's distributed optimizer for chunks with their own data-parallel groups.

megatron's ``DistributedOptimizer`` shards the state of its model chunks' gradient buffers
over *one* data-parallel group. A chunk of a multi-pipeline placement (BitPipe) reduces its
gradients over its own grad-sync group (its stage's replicas x data parallel,
:meth:`megatron_bitpipe.execution.groups.PipelineGroups.grad_sync_group`), so each chunk gets
its own ``DistributedOptimizer`` over that group (:func:`build_distributed_optimizer`) and
:class:`ChunkDistributedOptimizer` chains them.

**Checkpoints.** megatron-core's ``ChainedOptimizer`` writes one sub-dict per optimizer, so
its checkpoints would depend on the number of chunks per rank. :class:`ChunkDistributedOptimizer`
presents the chain as one optimizer instead: the ``sharded_state_dict`` of a single
``DistributedOptimizer`` in the ``fully_reshardable`` form (parameter groups, grad scaler,
one ``param_state`` entry per parameter, keyed by the model's global tensor names), which any
layout and any number of chunks reads back, as does Megatron-LM's loader.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, OptimizerConfig, get_megatron_optimizer

from .groups import PipelineGroups
from .replicas import stage_order

__all__ = ["SHARDING_TYPE", "ChunkDistributedOptimizer", "build_distributed_optimizer"]

#: the distributed optimizer's checkpoint form: per parameter, in model space (any layout)
SHARDING_TYPE = "fully_reshardable"


class ChunkDistributedOptimizer(ChainedOptimizer):
    """Per-chunk megatron ``DistributedOptimizer``\\ s that step, clip and checkpoint as one.

    Stepping, clipping and the grad norm are ``ChainedOptimizer``'s (one norm over every
    rank's shards). With a loss scale (``--fp16``) every chunk's optimizer has its own grad
    scaler, and ``ChainedOptimizer`` would update each with its own chunk's overflow while
    scaling the loss by the first one's; :meth:`prepare_grads` updates all of them with one
    overflow flag, that of the whole model on every rank, so they keep one loss scale and skip
    the same steps as megatron's single optimizer. :meth:`sharded_state_dict` / :meth:`load_state_dict` use one state dict
    for the whole chain (module docstring); :meth:`load_state_dict` expects the layout of the
    last :meth:`sharded_state_dict` call (``is_loading=True``), as megatron's loaders do.
    """

    def __init__(self, chained_optimizers: List[DistributedOptimizer]):
        super().__init__(chained_optimizers)
        self._param_counts: Optional[List[int]] = None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy and unscale every chunk's gradients and check them for inf/NaN (each chunk's
        check is megatron's, reduced over all ranks), then update every chunk's grad scaler
        with the flag of all chunks: True skips the step of every chunk on every rank."""
        flags: List[bool] = []
        for part in self.chained_optimizers:
            scaler = part.grad_scaler
            if not scaler:
                flags.append(part.prepare_grads())
                continue
            part.grad_scaler = _DeferredUpdate(scaler, flags)
            try:
                part.prepare_grads()
            finally:
                part.grad_scaler = scaler
        found_inf = any(flags)
        for part in self.chained_optimizers:
            if part.grad_scaler:
                part.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """megatron's step of every chunk's optimizer (stage order); then each chunk whose DDP
        overlaps the parameter all-gather
        (:attr:`~megatron_bitpipe.execution.replicas.ChunkDistributedDataParallel.overlaps_param_gather`)
        has its gather started, asynchronously and in stage order (megatron's
        ``start_param_sync(force_dispatch=True)``), to run during the next forward, whose
        pre-hooks wait for it. Without the overlap megatron's step gathers, blocking.

        A chunk's gather is started once: a mixture-of-experts chunk has two optimizers here (its
        dense and its expert parameters, megatron's split), and its DDP's ``start_param_sync``
        starts both kinds of bucket groups at once."""
        success = super().step_with_ready_grads()
        started = set()
        for part in self.chained_optimizers:
            for chunk in part.model_chunks:
                if getattr(chunk, "overlaps_param_gather", False) and id(chunk) not in started:
                    started.add(id(chunk))
                    chunk.start_param_sync(force_dispatch=True)
        return success

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> Dict:
        metadata = kwargs.get("metadata") or {}
        sharding = metadata.get("distrib_optim_sharding_type")
        if sharding != SHARDING_TYPE:
            raise ValueError(
                f"per-chunk distributed optimizers are checkpointed in the {SHARDING_TYPE!r} form, "
                f"not {sharding!r} (Megatron-LM: --dist-ckpt-optim-fully-reshardable)"
            )
        if is_loading:
            self._allocate_states()
        self._synchronize_steps()
        parts = [part.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs) for part in self.chained_optimizers]
        merged = {key: value for key, value in parts[0].items() if key != "param_state"}
        merged["param_state"] = {}
        self._param_counts = []
        for part in parts:
            self._param_counts.append(len(part["param_state"]))
            for state in part["param_state"].values():
                merged["param_state"][len(merged["param_state"])] = state
        return merged

    @torch.no_grad()
    def _allocate_states(self) -> None:
        """Give optimizers that have not stepped yet their state tensors (megatron's
        ``DistributedOptimizer.state_dict`` needs a step count to exist with torch's Adam):
        one step of zero gradients at learning rate and weight decay 0, which changes nothing;
        loading overwrites the states."""
        for part in self.chained_optimizers:
            inner = part.optimizer
            if len(inner.state):
                continue
            saved = [(group["lr"], group["weight_decay"]) for group in inner.param_groups]
            for group in inner.param_groups:
                group["lr"] = group["weight_decay"] = 0.0
                for param in group["params"]:
                    param.grad = torch.zeros_like(param)
            inner.step()
            for group, (lr, weight_decay) in zip(inner.param_groups, saved):
                group["lr"], group["weight_decay"] = lr, weight_decay
                for param in group["params"]:
                    param.grad = None

    def load_state_dict(self, state_dict: Dict) -> None:
        if self._param_counts is None:
            raise RuntimeError("call sharded_state_dict(..., is_loading=True) before load_state_dict")
        if state_dict.get("param_state_sharding_type") != SHARDING_TYPE:
            raise ValueError(f"expected a {SHARDING_TYPE!r} optimizer state, got {state_dict.get('param_state_sharding_type')!r}")
        param_state, start = state_dict["param_state"], 0
        for part, count in zip(self.chained_optimizers, self._param_counts):
            part.load_state_dict({key: value for key, value in state_dict.items() if key != "param_state"})
            # torch's Adam keeps a per-parameter step, which megatron's loader of the parameter
            # states does not expect: set aside while they load. megatron gives every parameter
            # the same step tensor, which torch's Adam increments in place once per parameter:
            # each gets its own copy.
            steps = {param: state.pop("step") for param, state in part.optimizer.state.items() if "step" in state}
            part.load_parameter_state_from_fully_reshardable({i: param_state[start + i] for i in range(count)})
            for param, step in steps.items():
                part.optimizer.state[param]["step"] = step.clone()
            start += count
        self._synchronize_steps()


class _DeferredUpdate:
    """A chunk optimizer's grad scaler while it checks its gradients: unscales with the
    scaler's own ``inv_scale`` and records the overflow flag instead of updating (megatron's
    ``prepare_grads`` reads ``inv_scale`` and calls ``update`` once)."""

    def __init__(self, scaler, flags: List[bool]):
        self._scaler, self._flags = scaler, flags

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scaler.inv_scale

    def update(self, found_inf: bool) -> None:
        self._flags.append(bool(found_inf))


def build_distributed_optimizer(
    chunks, groups: PipelineGroups, config: OptimizerConfig, **megatron_kwargs
) -> ChunkDistributedOptimizer:
    """One megatron ``DistributedOptimizer`` per chunk over its grad-sync group, chained in
    stage order (:class:`ChunkDistributedOptimizer`).

    ``chunks`` are the DDP-wrapped chunks (local chunk order), each reducing over its
    grad-sync group (``groups.model_pgs[c]``). After the step each chunk all-gathers its
    parameters over that group, a collective that must start in the same order on every
    rank, hence the stage order (:func:`~megatron_bitpipe.execution.replicas.stage_order`):
    blocking, or with the DDP's ``overlap_param_gather`` started asynchronously and waited
    for in the next forward (:meth:`ChunkDistributedOptimizer.step_with_ready_grads`).
    ``megatron_kwargs`` go to ``get_megatron_optimizer`` (``config_overrides``...).
    Collective over all ranks.
    """
    parts = []
    for chunk in stage_order(groups):
        chained = get_megatron_optimizer(
            config, [chunks[chunk]], use_gloo_process_groups=False, pg_collection=groups.model_pgs[chunk], **megatron_kwargs
        )
        parts += chained.chained_optimizers
    return ChunkDistributedOptimizer(parts)
