"""Building the optimizers of this package the way megatron-core builds its own.

:func:`build_megatron_optimizer` is ``megatron.core.optimizer.get_megatron_optimizer`` for
``--optimizer adam`` and ``sgd`` (SGD with a state initialiser, so that a checkpoint's momentum
loads: megatron-core gives its SGD none) and, for ``lamb``, ``onebit_lamb``,
``schedulefree_adamw`` and ``sgd`` in a decentralized data-parallel mode
(:class:`~.decentralized_sgd.DecentralizedSGD`), does
what megatron-core does for its optimizers outside the factory (Muon): a torch optimizer over
megatron's parameter groups (``_get_param_groups``: weight-decay and learning-rate overrides,
the same groups on every rank), wrapped in ``FP32Optimizer`` or, with ``--bf16``/``--fp16``,
``Float16OptimizerWithFloat16Params`` (fp32 main parameters, loss scaling), inside a
``ChainedOptimizer``. Gradient clipping, the grad norm, checkpointing hooks and the
learning-rate scheduler then work as for Adam. The distributed optimizer, CPU offloading and
expert parallelism are not supported by these optimizers (refused by
:func:`~.flags.optimizer_problems`).

:func:`averaged_weights` and :func:`lr_for_logging` are what a training loop needs besides
``step()``; the flags and their rules are in :mod:`.flags`.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
from megatron.core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    _get_param_groups,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.core.process_groups_config import ProcessGroupCollection

from .decentralized_sgd import DecentralizedSGD, init_sgd_state
from .flags import MEGATRON_OPTIMIZERS, OPTIMIZERS, OWN_OPTIMIZERS, OptimizerChoice, add_optimizer_args, optimizer_problems
from .lamb import Lamb
from .onebit_lamb import OnebitLamb

__all__ = [
    "OPTIMIZERS",
    "OptimizerChoice",
    "add_optimizer_args",
    "optimizer_problems",
    "build_megatron_optimizer",
    "averaged_weights",
    "lr_for_logging",
    "megatron_parts",
]

def megatron_parts(optimizer) -> List:
    """The megatron optimizers inside ``optimizer`` (a ChainedOptimizer's parts, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _grad_scaler(config: OptimizerConfig):
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def _torch_optimizer(config: OptimizerConfig, choice: OptimizerChoice, param_groups: List[dict], tp_group):
    if choice.name == "sgd":
        return DecentralizedSGD(param_groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
    common = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, weight_decay=config.weight_decay)
    if choice.name == "lamb":
        return Lamb(param_groups, min_coeff=choice.lamb_min_coeff, max_coeff=choice.lamb_max_coeff, tp_group=tp_group, **common)
    if choice.name == "onebit_lamb":
        return OnebitLamb(
            param_groups,
            freeze_step=choice.onebit_freeze_iters,
            min_coeff=choice.lamb_min_coeff,
            max_coeff=choice.lamb_max_coeff,
            tp_group=tp_group,
            **common,
        )
    try:
        from .schedule_free import ScheduleFreeAdamW
    except ImportError as error:
        raise ImportError(
            "--optimizer schedulefree_adamw needs the schedulefree package: pip install 'megatron-bitpipe[schedulefree]'"
        ) from error
    return ScheduleFreeAdamW(
        param_groups, warmup_steps=choice.sf_warmup_iters, r=choice.sf_r, weight_lr_power=choice.sf_weight_lr_power, **common
    )


class _PerRankOptimizerState:
    """Mixin for megatron's wrappers of 1-bit LAMB: its per-rank state (error feedback, and the
    per-parameter coefficients keyed by this rank's parameter ids) becomes one
    ``ShardedObject`` per rank in megatron's sharded (``torch_dist``) checkpoints, instead of
    common state that only rank 0 would write."""

    PER_RANK_KEYS = ("coefficients", "error_feedback")

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        state = super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        inner = state["optimizer"] if "optimizer" in state else state
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for key in self.PER_RANK_KEYS:
            if key in inner:
                inner[key] = ShardedObject(f"optimizer.onebit_lamb.{key}", inner[key], (world,), (rank,), replica_id=0)
        return state


class _OnebitFP32Optimizer(_PerRankOptimizerState, FP32Optimizer):
    """``FP32Optimizer`` of 1-bit LAMB (per-rank sharded state)."""


class _OnebitFloat16Optimizer(_PerRankOptimizerState, Float16OptimizerWithFloat16Params):
    """``Float16OptimizerWithFloat16Params`` of 1-bit LAMB (per-rank sharded state)."""


def _optimizer_param_of(wrapped) -> Dict[int, torch.Tensor]:
    """``id(model parameter) -> the parameter the torch optimizer holds for it``."""
    if isinstance(wrapped, Float16OptimizerWithFloat16Params):
        mapping = {}
        for models, mains in zip(wrapped.float16_groups, wrapped.fp32_from_float16_groups):
            mapping.update({id(m): main for m, main in zip(models, mains)})
        for group in wrapped.fp32_from_fp32_groups:
            mapping.update({id(p): p for p in group})
        return mapping
    return {id(p): p for group in wrapped.optimizer.param_groups for p in group["params"]}


def build_megatron_optimizer(
    config: OptimizerConfig,
    choice: OptimizerChoice,
    model_chunks: List[torch.nn.Module],
    *,
    pg_collection: Optional[ProcessGroupCollection] = None,
    config_overrides=None,
    use_gloo_process_groups: bool = False,
    **megatron_kwargs,
):
    """The megatron optimizer of ``choice`` over ``model_chunks`` (see the module docstring).

    ``pg_collection`` supplies the tensor-parallel group (LAMB's norms) and the model-parallel
    group (grad norm); None means megatron's global groups (Megatron-LM's loop).
    ``--optimizer onebit_lamb`` needs chunks wrapped by
    :func:`megatron_bitpipe.execution.replicas.wrap_ddp`. Collective (parameter groups are
    aligned across ranks, as in megatron).
    """
    if choice.name in MEGATRON_OPTIMIZERS and not (choice.name == "sgd" and choice.decentralized):
        optimizer = get_megatron_optimizer(
            config,
            model_chunks,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            pg_collection=pg_collection,
            **megatron_kwargs,
        )
        if choice.name == "sgd":
            for part in megatron_parts(optimizer):
                part.init_state_fn = init_sgd_state
        return optimizer
    if choice.name not in OWN_OPTIMIZERS + ("sgd",):
        raise ValueError(f"--optimizer {choice.name!r} is not one of {', '.join(OPTIMIZERS)}")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    overrides = config_overrides if config_overrides is not None else get_standard_config_overrides(config)
    param_groups = _get_param_groups(model_chunks, config, overrides)
    if any(group["is_expert_parallel"] and group["params"] for group in param_groups):
        raise ValueError(f"--optimizer {choice.name} does not support expert-parallel parameters")
    param_groups = [group for group in param_groups if not group["is_expert_parallel"]]
    inner = _torch_optimizer(config, choice, param_groups, pg_collection.tp)
    init_state_fn = type(inner).init_state
    onebit = isinstance(inner, OnebitLamb)
    if config.fp16 or config.bf16:
        wrapper = _OnebitFloat16Optimizer if onebit else Float16OptimizerWithFloat16Params
        wrapped = wrapper(inner, config, _grad_scaler(config), init_state_fn)
    else:
        wrapped = (_OnebitFP32Optimizer if onebit else FP32Optimizer)(inner, config, init_state_fn)
    wrapped.grad_stats_parallel_group = pg_collection.mp
    wrapped.tp_group = pg_collection.tp
    if onebit:
        inner.attach(model_chunks, _optimizer_param_of(wrapped))
    return ChainedOptimizer([wrapped])


@contextlib.contextmanager
def averaged_weights(optimizer) -> Iterator[None]:
    """Inside: the model (and the optimizer's main parameters) hold Schedule-Free's averaged
    iterate ``x``; afterwards ``y`` again, bit for bit. A no-op for other optimizers. Use it
    around evaluation, checkpoint saving and checkpoint loading. Mixed-precision wrappers
    copy their fp32 main parameters into the bf16/fp16 model weights after each switch."""
    parts = [part for part in megatron_parts(optimizer) if getattr(getattr(part, "optimizer", None), "averages_weights", False)]
    for part in parts:
        part.optimizer.eval()
        _refresh_model_weights(part)
    try:
        yield
    finally:
        for part in parts:
            part.optimizer.train()
            _refresh_model_weights(part)


def _refresh_model_weights(part) -> None:
    copy = getattr(part, "_copy_main_params_to_model_params", None)
    if copy is not None:
        copy()


def lr_for_logging(optimizer) -> float:
    """The learning rate of the next step: megatron's canonical one, or Schedule-Free's with
    its own warm-up applied."""
    for part in megatron_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if getattr(inner, "averages_weights", False):
            return inner.lr_for_logging()
    return get_canonical_lr_for_logging(optimizer.param_groups)
