"""Where the plugin meets Megatron-LM's training code (tested tags: core_v0.16.1, core_v0.19.0).

Megatron-LM needs six things from the plugin; both routes call the same functions here:

1. **Flags**: :func:`~megatron_bitpipe.megatron_lm.args.chain_args_provider` adds the plugin's
   flags after the script's own ``extra_args_provider``.
2. **Checks, decisions and schedule**: :func:`~megatron_bitpipe.megatron_lm.args.hold_layer_split`
   right before Megatron-LM's ``validate_args`` (a plan schedule splits the layers over its own
   stages: the uneven-layout flags are kept from Megatron-LM's rules), and :func:`setup`, right after it
   and before ``torch.distributed`` starts, checks the flags on every rank, makes the run's
   :class:`~megatron_bitpipe.run_config.RunConfig` from Megatron-LM's namespace, once, and
   installs the schedule where Megatron-LM's ``train`` and ``evaluate`` look it up (for a schedule
   this package's plan executor runs — bitpipe, chimera, zb-h1, zbv, dualpipe, dualpipev: the variant that hands the loss reports to the
   last pipeline stage, :mod:`.losses`). The installed function holds the RunConfig
   (:func:`~megatron_bitpipe.plugin.installed_schedule`): Megatron-LM calls the hooks below by
   name, and they take every decision from it (:func:`run_config`).
3. **Model**: :func:`get_model` builds the plan schedule's chunks (:mod:`.model`) or defers to
   Megatron-LM's own ``get_model``, re-initialising its chunks from the seed with
   ``--layout-independent-init``.
4. **Batch**: :func:`broadcast_full_batch` — with a plan schedule a rank that embeds the
   tokens may compute the loss too (BitPipe's edge ranks, rank 0 of the V schedules), so every
   tensor-parallel rank there needs tokens, labels and loss mask; Megatron-LM's
   ``get_batch_on_this_tp_rank`` broadcasts all of them on its ``mtp_on_this_rank`` path and
   only half of them on a first or last pipeline stage. With ``--context-parallel-size`` the
   script's ``get_batch`` then cuts them for this context-parallel rank itself
   (``get_batch_on_this_cp_rank``, on megatron's context-parallel group, which is the chunks'
   one); the plan executor hands the cut batch to the chunks unchanged.
5. **Optimizers and schedules** (:mod:`megatron_bitpipe.optimizers`):
   :func:`get_megatron_optimizer_config` and :func:`get_megatron_optimizer` build ``--optimizer
   lamb``, ``onebit_lamb`` and ``schedulefree_adamw`` (Megatron-LM's own optimizers otherwise);
   :func:`optimizer_param_scheduler` is Megatron-LM's scheduler class with ``rex`` (and no
   warm-up of its own for Schedule-Free, which warms up itself); :func:`evaluate`,
   :func:`save_checkpoint` and :func:`load_checkpoint` run Megatron-LM's functions with
   Schedule-Free's averaged weights in the model (:func:`~megatron_bitpipe.optimizers.averaged_weights`);
   with ``--overlap-param-gather`` Megatron-LM's loops over the chunks that wait for (or force)
   their parameter all-gathers take a plan schedule's chunks in stage order (:func:`in_stage_order`).
   With a plan schedule and ``--use-distributed-optimizer``, :func:`get_megatron_optimizer` builds one
   distributed optimizer per chunk, over the chunk's grad-sync group
   (:mod:`megatron_bitpipe.execution.distributed_optimizer`).
6. **Checkpoints**: :func:`load_checkpoint` runs the checks of :mod:`.checkpointing` first (any
   schedule: a checkpoint that cannot be loaded completely stops every rank before training).

:func:`setup` puts the functions of 5 and 6 where ``megatron.training.training`` looks them up,
in both routes. :func:`install` is the runtime route: it wraps Megatron-LM's own functions
(``parse_args`` and ``validate_args`` where the checkout defines or imports them,
``training.get_model``, the config container's model builders at core_v0.19.0,
``get_batch_on_this_tp_rank``) so an unmodified script gets all six. It must run before the
script imports ``get_batch_on_this_tp_rank`` by name (``pretrain_gpt.py`` does). The patch
route (``patches/megatron-lm-<tag>.patch``) makes the same calls from Megatron-LM's source; on
a patched checkout :func:`install` does nothing.

With ``--pipeline-schedule default`` (and no ``--layout-independent-init``) Megatron-LM runs
exactly as without the plugin.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

from ..execution.forward_backward import pipeline_groups_of
from ..execution.replicas import stage_order
from ..megatron_args import BitPipeConfigError, resolved_schedule
from ..megatron_compat import enable_moe_without_transformer_engine, megatron_lm_functions, with_keyword
from ..optimizers import OWN_OPTIMIZERS, ParamScheduler, averaged_weights, build_megatron_optimizer
from ..plugin import installed_schedule, register
from ..run_config import RunConfig
from ..schedules import ScheduleChoice
from .args import (
    chain_args_provider,
    configure_optimizer_checkpoints,
    hold_layer_split,
    release_layer_split,
    validate_megatron_lm_args,
)
from .checkout import running_script_refusal
from .losses import make_megatron_lm_forward_backward_func

__all__ = [
    "PATCH_MARKER",
    "hold_layer_split",
    "setup",
    "run_config",
    "get_model",
    "build_distributed_models",
    "broadcast_full_batch",
    "get_megatron_optimizer_config",
    "get_megatron_optimizer",
    "optimizer_param_scheduler",
    "evaluate",
    "save_checkpoint",
    "load_checkpoint",
    "install",
]

_OWN = OWN_OPTIMIZERS  # built here; Megatron-LM builds the others (adam, sgd)
_OPTIMIZER_OF_MODEL = "megatron_bitpipe_optimizer"
"""Attribute of the model chunks naming the optimizer built by :func:`get_megatron_optimizer`
(Megatron-LM's ``evaluate`` receives the model, not the optimizer)."""

PATCH_MARKER = "MEGATRON_BITPIPE_PATCHED"
"""Name the patch defines as True in ``megatron.training.training``."""


def setup(args: argparse.Namespace) -> RunConfig:
    """Check the running script (with a plan schedule: not one :func:`~.checkout.bitpipe_refusal`
    refuses, e.g. a patched ``pretrain_mamba.py``) and the parsed flags
    (:class:`~megatron_bitpipe.megatron_args.BitPipeConfigError`), make
    the run's :class:`RunConfig` and install ``--pipeline-schedule``'s forward_backward_func,
    which holds it. Local: no communication. Returns the RunConfig.

    With ``--num-experts`` megatron-core's MoE utilities get what they read without Transformer
    Engine (:func:`~megatron_bitpipe.megatron_compat.enable_moe_without_transformer_engine`),
    for every schedule.

    Megatron-LM's own namespace is completed before the RunConfig is made (nothing writes to it
    afterwards): with a plan-executed schedule and ``--use-distributed-optimizer`` the optimizer
    state is checkpointed in the ``fully_reshardable`` form, the only one its per-chunk
    optimizers have (:func:`~.args.configure_optimizer_checkpoints`).
    """
    release_layer_split(args)
    schedule = ScheduleChoice(resolved_schedule(args))
    refusal = running_script_refusal(sys.argv[0], schedule=schedule.schedule) if schedule.plan_executed else None
    if refusal is not None:
        raise BitPipeConfigError(refusal)
    validate_megatron_lm_args(args)
    configure_optimizer_checkpoints(args)
    config = RunConfig.from_args(args)
    if config.moe is not None:
        enable_moe_without_transformer_engine()
    if config.stage_layers is not None and not config.stage_layers.is_even and args.rank == 0:
        print(f"megatron_bitpipe: transformer layers per pipeline stage (pipeline order): {config.stage_layers}", flush=True)
    plan_func = make_megatron_lm_forward_backward_func(config.schedule) if config.executes_plan else None
    register(config.schedule.schedule, plan_func=plan_func, run_config=config)
    _route_optimizer_functions(config, args.rex_beta)
    return config


def run_config() -> RunConfig:
    """The decisions :func:`setup` made, held by the installed forward_backward_func (Megatron-LM
    calls the hooks by name: this is the one place they find them)."""
    installed = installed_schedule()
    if installed is None or installed.run_config is None:
        raise RuntimeError("megatron_bitpipe: Megatron-LM's arguments were not set up (megatron_bitpipe.megatron_lm.hooks.setup)")
    return installed.run_config


def _route_optimizer_functions(config: RunConfig, rex_beta: float) -> None:
    """Megatron-LM's optimizer, learning-rate scheduler, evaluation and checkpoint functions,
    looked up in ``megatron.training.training``'s namespace at each call, through this module's
    (both routes; a second call replaces the first one's)."""
    import megatron.training.training as training

    for name, hook in (
        ("get_megatron_optimizer_config", get_megatron_optimizer_config),
        ("get_megatron_optimizer", functools.partial(get_megatron_optimizer, run=config)),
        ("evaluate", evaluate),
        ("save_checkpoint", save_checkpoint),
        ("load_checkpoint", functools.partial(load_checkpoint, run=config)),
        *((name, functools.partial(in_stage_order, run=config)) for name in _PARAM_SYNC_FUNCTIONS),
    ):
        current = getattr(training, name)
        megatron_fn = getattr(current, "megatron_bitpipe_original", current)
        setattr(training, name, _wrap(megatron_fn, functools.partial(hook, megatron_fn)))
    training.OptimizerParamScheduler = optimizer_param_scheduler(config, rex_beta)


def get_model(megatron_get_model: Callable, model_provider_func: Callable, *args, **kwargs) -> list:
    """Megatron-LM's ``get_model(model_provider_func, model_type, wrap_with_ddp, config,
    pg_collection)`` for the selected schedule; ``megatron_get_model`` is Megatron-LM's own."""
    from .model import get_bitpipe_model

    config = run_config()
    if config.executes_plan:
        return get_bitpipe_model(config, model_provider_func, *args, **kwargs)
    return _seed_only(config, megatron_get_model(model_provider_func, *args, **kwargs))


def build_distributed_models(megatron_build: Callable, builder, *args, **kwargs) -> list:
    """A Megatron-LM model builder's ``build_distributed_models(pg_collection, ddp_config, ...,
    wrap_with_ddp, ...)`` (core_v0.19's config container) for the selected schedule;
    ``megatron_build`` is the builder's own method. BitPipe builds GPTModel chunks only."""
    from .model import build_bitpipe_model_with

    config = run_config()
    if config.executes_plan:
        return build_bitpipe_model_with(config, builder, megatron_build, *args, **kwargs)
    return _seed_only(config, megatron_build(*args, **kwargs))


def _seed_only(config: RunConfig, model: list) -> list:
    """``model`` (megatron's own chunks), re-initialised from the seed with ``--layout-independent-init``."""
    from megatron.core import mpu
    from megatron.training import get_args

    from .model import initialize_chunks_from_seed

    if config.layout_independent_init:
        initialize_chunks_from_seed(model, get_args().seed, mpu.get_tensor_model_parallel_group())
    return model


def broadcast_full_batch(mtp_on_this_rank: bool) -> bool:
    """The ``mtp_on_this_rank`` to give ``get_batch_on_this_tp_rank``: true when this package's
    plan executor runs the schedule (its chunks embed and compute the loss wherever the placement
    puts a pipeline's first and last stages: BitPipe's edge ranks hold both)."""
    return mtp_on_this_rank or run_config().executes_plan


def get_megatron_optimizer_config(megatron_fn: Callable, args) -> tuple:
    """Megatron-LM's ``get_megatron_optimizer_config(args)``; for this package's optimizers
    the Adam config (they read lr, betas, eps, weight decay, clipping and precision from it)."""
    if args.optimizer not in _OWN:
        return megatron_fn(args)
    name = args.optimizer
    args.optimizer = "adam"
    try:
        return megatron_fn(args)
    finally:
        args.optimizer = name


def get_megatron_optimizer(megatron_fn: Callable, config, model_chunks, *args, run: RunConfig, **kwargs):
    """``megatron.core.optimizer.get_megatron_optimizer`` as Megatron-LM calls it (``config``:
    megatron's ``OptimizerConfig``), for the run's decisions ``run``; builds ``--optimizer lamb |
    onebit_lamb | schedulefree_adamw`` with
    :func:`~megatron_bitpipe.optimizers.build_megatron_optimizer` and records it on the model
    chunks for :func:`evaluate`; with a plan-executed schedule and ``--use-distributed-optimizer``,
    one distributed optimizer per chunk (Megatron-LM's ``config_overrides`` kept)."""
    from megatron.core.utils import unwrap_model

    from ..execution.distributed_optimizer import build_distributed_optimizer

    if run.executes_plan and config.use_distributed_optimizer:
        groups = unwrap_model(model_chunks[0]).pipeline_groups
        return build_distributed_optimizer(model_chunks, groups, config, config_overrides=kwargs.get("config_overrides"))
    if run.optimizer.name not in _OWN:
        return megatron_fn(config, model_chunks, *args, **kwargs)
    optimizer = build_megatron_optimizer(config, run.optimizer, list(model_chunks), config_overrides=kwargs.get("config_overrides"))
    for chunk in model_chunks:
        setattr(chunk, _OPTIMIZER_OF_MODEL, optimizer)
    return optimizer


def optimizer_param_scheduler(config: RunConfig, rex_beta: float) -> Callable:
    """The class Megatron-LM's ``get_optimizer_param_scheduler`` instantiates: megatron's
    scheduler with ``rex`` (``--rex-beta``); without warm-up for Schedule-Free AdamW, whose
    warm-up is its own (``--lr-warmup-iters``)."""

    def build(optimizer, **kwargs):
        if config.optimizer.name == "schedulefree_adamw":
            kwargs["lr_warmup_steps"] = 0
        return ParamScheduler(optimizer, rex_beta=rex_beta, **kwargs)

    return build


#: Megatron-LM's functions (core_v0.16.1, core_v0.19.0) that walk the model chunks for
#: ``--overlap-param-gather``: each waits for a chunk's gather in flight, or gathers it, blocking
_PARAM_SYNC_FUNCTIONS = ("force_param_sync", "disable_forward_pre_hook", "enable_forward_pre_hook")


def in_stage_order(megatron_fn: Callable, model_chunks, *args, run: RunConfig, **kwargs):
    """Megatron-LM's ``megatron_fn`` (:data:`_PARAM_SYNC_FUNCTIONS`) over the chunks of a
    plan-executed schedule in stage order
    (:func:`~megatron_bitpipe.execution.replicas.stage_order`). Where no gather is in flight
    (its forward waited for it already) megatron's ``start_param_sync(force_sync=True)``
    gathers again, a blocking collective over the chunk's grad-sync group: it must come in the
    same order on every rank, which the chunks' list order is not. Other schedules: unchanged."""
    if run.executes_plan:
        chunks = list(model_chunks)
        model_chunks = [chunks[c] for c in stage_order(pipeline_groups_of(chunks))]
    return megatron_fn(model_chunks, *args, **kwargs)


def evaluate(megatron_evaluate: Callable, forward_step_func, data_iterator, model, *args, **kwargs):
    """Megatron-LM's ``evaluate`` on Schedule-Free's averaged weights (others: unchanged)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    with averaged_weights(getattr(chunks[0], _OPTIMIZER_OF_MODEL, None)):
        return megatron_evaluate(forward_step_func, data_iterator, model, *args, **kwargs)


def save_checkpoint(megatron_save: Callable, iteration, model, optimizer, *args, **kwargs):
    """Megatron-LM's ``save_checkpoint`` with Schedule-Free's averaged weights in the model
    (its training weights travel as optimizer state ``y``)."""
    with averaged_weights(optimizer):
        return megatron_save(iteration, model, optimizer, *args, **kwargs)


def load_checkpoint(megatron_load: Callable, model, optimizer, *args, run: RunConfig, **kwargs):
    """Megatron-LM's ``load_checkpoint`` after the checks of :mod:`.checkpointing` (a checkpoint
    that cannot be loaded completely: one error, status 1 on every rank), in Schedule-Free's
    eval mode (so its training weights come back exactly). Megatron-LM's checkpoints hold one data-parallel rank's optimizer
    state, so 1-bit LAMB's per-rank error feedback restarts from zero with data parallelism."""
    from megatron.core import mpu

    from .checkpointing import check_or_exit

    check_or_exit(run, model, kwargs.get("load_arg", args[1] if len(args) > 1 else "load"))
    with averaged_weights(optimizer):
        result = megatron_load(model, optimizer, *args, **kwargs)
    if optimizer is not None and mpu.get_data_parallel_world_size() > 1:
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(getattr(part, "optimizer", None), "load_error_feedback_state"):
                part.optimizer.load_error_feedback_state(None)
    return result


def _wrap(original: Callable, replacement: Callable) -> Callable:
    wrapper = functools.wraps(original)(replacement)
    wrapper.megatron_bitpipe_original = original
    return wrapper


def install() -> None:
    """Route Megatron-LM's functions through this module (the runtime route). Idempotent.

    Wraps them where the checkout's training code looks them up
    (:func:`~megatron_bitpipe.megatron_compat.megatron_lm_functions`).
    """
    functions = megatron_lm_functions()
    training = functions.training
    if hasattr(training.get_model, "megatron_bitpipe_original") or getattr(training, PATCH_MARKER, False):
        return  # installed already, or the checkout carries the patch route's calls
    module = functions.argument_modules[0]
    parse_args, validate_args = module.parse_args, module.validate_args
    megatron_get_model = training.get_model
    get_batch = functions.batch_modules[0].get_batch_on_this_tp_rank

    def parse_args_with_plugin(extra_args_provider=None, ignore_unknown_args=False):
        return parse_args(chain_args_provider(extra_args_provider), ignore_unknown_args)

    def validate_args_with_plugin(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        hold_layer_split(args)
        args = validate_args(args, defaults)
        setup(args)
        return args

    def get_model_with_plugin(model_provider_func, *args, **kwargs):
        return get_model(megatron_get_model, model_provider_func, *args, **kwargs)

    def get_batch_with_plugin(*args, **kwargs):
        args, kwargs = with_keyword(get_batch, "mtp_on_this_rank", args, kwargs, broadcast_full_batch)
        return get_batch(*args, **kwargs)

    # Megatron-LM's in-process-restart check pre-parses the command line through
    # megatron.training.arguments' own parse_args: the plugin's flags and choices are known there too.
    for module in functions.argument_modules:
        module.parse_args = _wrap(parse_args, parse_args_with_plugin)
        module.validate_args = _wrap(validate_args, validate_args_with_plugin)
    training.get_model = _wrap(megatron_get_model, get_model_with_plugin)
    for module in functions.batch_modules:
        module.get_batch_on_this_tp_rank = _wrap(get_batch, get_batch_with_plugin)
    for builder_class in functions.model_builders:
        megatron_build = builder_class.build_distributed_models

        def build_with_plugin(builder, *args, _megatron_build=megatron_build, **kwargs):
            return build_distributed_models(functools.partial(_megatron_build, builder), builder, *args, **kwargs)

        builder_class.build_distributed_models = _wrap(megatron_build, build_with_plugin)
