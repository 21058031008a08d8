"""Installing a container's schedule where Megatron-Bridge looks it up, and its forward step.

Bridge's ``train`` and ``eval`` modules import megatron-core's ``get_forward_backward_func`` by
name; :func:`megatron_bitpipe.plugin.register` replaces it there too, whichever was imported
first (before Bridge: Bridge's import takes the installed function; after: the modules are
patched). :func:`install` checks the container (:mod:`.fields`: the Megatron-LM route's rules,
in Bridge's field names), makes its :class:`~megatron_bitpipe.run_config.RunConfig` and
registers the schedule with the Megatron-LM route's forward_backward function, whose loss
reports end on the last pipeline stage, where Bridge's ``train_step`` and ``evaluate`` average
them; Bridge's optimizer build and parameter-gather loops take the plan schedule's chunks
(:mod:`.optimizer`: one distributed optimizer per chunk). Local: call on every rank before
``pretrain``.

:func:`forward_step` is Bridge's GPT forward step with the batch the plan schedules need:
a pipeline rank that embeds a pipeline's first stage or computes a pipeline's loss gets
tokens, positions, labels and loss mask (BitPipe's edge ranks do both; Bridge's own batch gives
the first pipeline rank only the inputs and the last only the labels). Other ranks, and
megatron's own schedules, get Bridge's batch.
"""

from __future__ import annotations

import os
from typing import FrozenSet

from ..megatron_compat import enable_moe_without_transformer_engine
from ..megatron_lm.losses import make_megatron_lm_forward_backward_func
from ..plugin import installed_schedule, register
from ..run_config import RunConfig
from ..schedules.placement import Placement
from .builder import BitPipeGPTModelConfig
from .fields import checked_namespace
from .optimizer import route_optimizer
from .provider import BitPipeGPTModelProvider

__all__ = ["forward_step", "install"]


def install(cfg) -> RunConfig:
    """Check the container ``cfg`` (:class:`~megatron_bitpipe.megatron_args.BitPipeConfigError`
    naming each offending Bridge field), and install its schedule for Bridge's training and
    evaluation. Returns the run's RunConfig. Local; idempotent."""
    if not isinstance(cfg.model, (BitPipeGPTModelProvider, BitPipeGPTModelConfig)):
        raise TypeError(
            f"cfg.model is a {type(cfg.model).__name__}: use megatron_bitpipe.bridge.BitPipeGPTModelProvider "
            "(BitPipeGPTModelProvider.from_provider(cfg.model, pipeline_schedule=...)) or, for a GPTModelConfig, "
            "megatron_bitpipe.bridge.BitPipeGPTModelConfig (BitPipeGPTModelConfig.from_config(cfg.model, "
            "pipeline_schedule=...)) to choose a pipeline schedule"
        )
    args = checked_namespace(cfg)
    config = RunConfig.from_args(args)
    _optimizer_checkpoints(cfg, config)
    if config.moe is not None:
        enable_moe_without_transformer_engine()
    plan_func = make_megatron_lm_forward_backward_func(config.schedule) if config.executes_plan else None
    register(config.schedule.schedule, plan_func=plan_func, run_config=config)
    route_optimizer()
    cfg.model._bitpipe_args = args
    return config


def _optimizer_checkpoints(cfg, config: RunConfig) -> None:
    """``checkpoint.dist_ckpt_optim_fully_reshardable`` switched on (and said on rank 0) for a
    plan schedule with the distributed optimizer: its per-chunk optimizers save that form only,
    which any schedule and layout loads (as the Megatron-LM route's
    :func:`~megatron_bitpipe.megatron_lm.args.configure_optimizer_checkpoints`)."""
    if not (config.executes_plan and config.distributed_optimizer) or cfg.checkpoint.dist_ckpt_optim_fully_reshardable:
        return
    cfg.checkpoint.dist_ckpt_optim_fully_reshardable = True
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"megatron_bitpipe: model.pipeline_schedule {config.schedule_name} with ddp.use_distributed_optimizer saves its "
            "optimizer state fully reshardable (checkpoint.dist_ckpt_optim_fully_reshardable)",
            flush=True,
        )


def _data_ranks(placement: Placement) -> FrozenSet[int]:
    """Pipeline ranks holding some pipeline's first stage (embedding) or last stage (loss)."""
    ends = (0, placement.num_stages - 1)
    return frozenset(placement.location(p, s).rank for p in range(placement.num_pipelines) for s in ends)


def _batch(data_iterator, cfg, use_mtp: bool = False, *, pg_collection, vp_stage=None):
    """Bridge's ``get_batch``, with the whole batch on the plan schedule's data ranks."""
    from megatron.bridge.training import gpt_step

    installed = installed_schedule()
    run_config = installed.run_config if installed is not None else None
    if run_config is None or not run_config.executes_plan or pg_collection.pp.rank() not in _data_ranks(run_config.placement):
        return gpt_step.get_batch(data_iterator, cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage)
    batch = gpt_step.get_batch_from_iterator(
        data_iterator,
        use_mtp,
        getattr(cfg.dataset, "skip_getting_attention_mask_from_dataset", True),
        is_first_pp_stage=True,
        is_last_pp_stage=True,
        include_full_batch_fields=True,
    )
    if any(batch.get(key) is not None for key in ("cu_seqlens", "cu_seqlens_q")):
        raise ValueError(f"packed sequences are not supported with pipeline_schedule {run_config.schedule.schedule!r}")
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"], None


def forward_step(state, data_iterator, model, return_schedule_plan: bool = False):
    """Bridge's GPT ``forward_step`` (same arguments and result) with :func:`_batch`."""
    from megatron.bridge.training import gpt_step

    output, loss_mask = gpt_step._forward_step_common(state, data_iterator, model, return_schedule_plan, _get_batch_fn=_batch)
    checks = state.cfg.rerun_state_machine
    return output, gpt_step._create_loss_function(
        loss_mask, check_for_nan_in_loss=checks.check_for_nan_in_loss, check_for_spiky_loss=checks.check_for_spiky_loss
    )
