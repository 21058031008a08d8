"""The optimizer of a fused array: one megatron-core optimizer per model, over that model's
slices of the fused parameters.

For model ``k`` every fused parameter ``p`` (``[B, ...]``) contributes the view ``p[k]``, with
``main_grad`` the view ``p.main_grad[k]`` of megatron DDP's gradient buffer and the parameter's
attributes (replica ``shared`` marks, tensor-parallel attributes). megatron's own parameter
groups (``_get_param_groups``: no weight decay for biases and 1-D tensors, judged on the view,
so as in the unfused model) and optimizer (Adam, ``FP32Optimizer``) are built over these views,
with ``max_lr`` = model ``k``'s learning rate in each of its groups: megatron's scheduler then
gives model ``k`` the schedule ``--lr lr_k`` gives (warm-up, decay, ``--min-lr``). The update
writes through the views into the fused parameters.

:class:`HftaOptimizer` steps the B optimizers as megatron's ``ChainedOptimizer`` does, except
that each model's gradient norm and clipping are its own (a norm over the whole array would
couple the models). ``step()`` returns ``(success, grad norm, None)`` with the norm of the whole
array (``sqrt(Σ_k norm_k²)``); ``model_grad_norms`` holds the B norms of the last step.

**Checkpoints** (``torch_dist``): the Adam moments are stored fused, like the weights:
``optimizer.state.exp_avg.<name>`` is the ``[B, ...]`` stack of the models' moments of fused
parameter ``<name>``, sharded as the parameter is; the step (common to all models) as
``common_step``; each model's parameter-group values as plain values. A fused checkpoint thus
loads into any pipeline layout of the same array.
"""

from __future__ import annotations

import math
from typing import Iterator, List, Sequence, Tuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, _get_megatron_optimizer_based_on_param_groups, _get_param_groups
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.process_groups_config import ProcessGroupCollection

from .. import megatron_compat
from .settings import HftaSettings

__all__ = ["HftaOptimizer", "build_hfta_optimizer", "model_views"]

#: parameter attributes a model's view keeps (grad-norm filters, tensor parallelism, tying)
_VIEW_ATTRIBUTES = ("shared", "tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")


class _ModelSlice:
    """Model ``k``'s slice of the chunks, as megatron's ``_get_param_groups`` reads a chunk."""

    def __init__(self, views: List[Tuple[str, torch.Tensor]]):
        self.views = views

    def named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.views)


def model_views(chunks: Sequence[torch.nn.Module], k: int) -> List[Tuple[str, torch.Tensor]]:
    """``(name, view)`` of model ``k``'s slice of every trainable parameter of ``chunks``
    (DDP-wrapped: each view's ``main_grad`` is the slice of the parameter's)."""
    views = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            view = param.detach()[k].requires_grad_(True)
            view.main_grad = param.main_grad[k]
            for attribute in _VIEW_ATTRIBUTES:
                if hasattr(param, attribute):
                    setattr(view, attribute, getattr(param, attribute))
            if hasattr(param, "partition_dim"):
                view.partition_dim = param.partition_dim - 1
            views.append((name, view))
    return views


_MOMENTS = ("exp_avg", "exp_avg_sq")


class HftaOptimizer(ChainedOptimizer):
    """B megatron optimizers, model ``k``'s at index ``k``, over the views ``fused[i][1][k]``
    of the fused parameters ``fused[i][0]``; see the module docstring."""

    def __init__(self, parts, fused: List[Tuple[torch.nn.Parameter, List[torch.Tensor]]], lrs: Sequence[float]):
        super().__init__(parts)
        self.fused, self.lrs = fused, tuple(lrs)
        self.model_grad_norms: List[float] = []

    def max_lr_of(self, part) -> float:
        """This run's peak learning rate of the model whose optimizer is ``part`` (``--hfta-lr``)."""
        return self.lrs[self.chained_optimizers.index(part)]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        if is_loading:
            for part in self.chained_optimizers:
                part.init_state_fn(part.optimizer, part.config)
        index = {id(param): i for i, (param, _) in enumerate(self.fused)}
        model_entries = {}
        for entry in nested_values(model_sharded_state_dict):
            if isinstance(entry, ShardedBase) and id(getattr(entry, "data", None)) in index:
                model_entries.setdefault(index[id(entry.data)], entry)
        state = {key: {} for key in _MOMENTS}
        for i, entry in model_entries.items():
            views = self.fused[i][1]
            for key in _MOMENTS:
                stacked = torch.stack([part.optimizer.state[view][key] for part, view in zip(self.chained_optimizers, views)])
                state[key][i] = make_sharded_optimizer_tensor(entry, stacked, prefix=f"optimizer.state.{key}")
        first = self.chained_optimizers[0].optimizer
        step = first.state[self.fused[0][1][0]].get("step") if self.fused else None
        if step is not None:
            state["common_step"] = torch.as_tensor(step).clone()
        groups = [
            [{**group, "params": LocalNonpersistentObject(group["params"])} for group in part.optimizer.state_dict()["param_groups"]]
            for part in self.chained_optimizers
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        state = state_dict["state"]
        step = state.get("common_step")
        for i, (_, views) in enumerate(self.fused):
            for k, (part, view) in enumerate(zip(self.chained_optimizers, views)):
                slot = part.optimizer.state[view]
                for key in _MOMENTS:
                    if i in state[key]:
                        slot[key].copy_(state[key][i][k])
                if step is not None:
                    slot["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        for part, groups in zip(self.chained_optimizers, state_dict["param_groups"]):
            for group, saved in zip(part.optimizer.param_groups, groups):
                group.update({key: value for key, value in saved.items() if key != "params"})

    @torch.no_grad()
    def step(self):
        if self.prepare_grads():
            return False, None, None
        norms = []
        for part in self.chained_optimizers:
            norm = part.get_grad_norm()
            if part.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(part.get_parameters(), max_norm=part.config.clip_grad, total_norm=norm)
            norms.append(float(norm))
        self.model_grad_norms = norms
        success = self.step_with_ready_grads()
        return success, math.sqrt(sum(norm * norm for norm in norms)), None


def build_hfta_optimizer(
    config: OptimizerConfig, chunks: Sequence[torch.nn.Module], hfta: HftaSettings, pg_collection: ProcessGroupCollection
) -> HftaOptimizer:
    """The :class:`HftaOptimizer` of a fused array's DDP-wrapped ``chunks`` (megatron's Adam,
    fp32, not distributed). Collective, as megatron's parameter grouping is."""
    if config.optimizer != "adam" or config.use_distributed_optimizer or config.bf16 or config.fp16:
        raise ValueError("a fused array trains with megatron's fp32 Adam, not distributed")
    parts, views = [], []
    for k, lr in enumerate(hfta.lrs):
        views.append(model_views(chunks, k))
        groups = _get_param_groups([_ModelSlice(views[k])], config, megatron_compat.standard_param_group_overrides(config))
        for group in groups:
            group["max_lr"] = lr
        parts.append(
            _get_megatron_optimizer_based_on_param_groups(
                config, model_chunks=list(chunks), param_groups=groups, model_parallel_group=pg_collection.mp, pg_collection=pg_collection
            )
        )
    params = [param for chunk in chunks for param in chunk.parameters() if param.requires_grad]
    return HftaOptimizer(parts, [(param, [model[i][1] for model in views]) for i, param in enumerate(params)], hfta.lrs)
