"""Where the plugin meets Megatron-LM's training code (tag core_v0.16.1).

Megatron-LM needs five things from the plugin; both routes call the same functions here:

1. **Flags**: :func:`~megatron_bitpipe.megatron_lm.args.chain_args_provider` adds the plugin's
   flags after the script's own ``extra_args_provider``.
2. **Checks and schedule**: :func:`setup`, right after Megatron-LM's ``validate_args`` and before
   ``torch.distributed`` starts, checks the flags on every rank and installs the schedule where
   Megatron-LM's ``train`` and ``evaluate`` look it up (for ``bitpipe``: the variant that hands
   the loss reports to the last pipeline stage, :mod:`.losses`).
3. **Model**: :func:`get_model` builds BitPipe's V chunks (:mod:`.model`) or defers to
   Megatron-LM's own ``get_model``, re-initialising its chunks from the seed with
   ``--layout-independent-init``.
4. **Batch**: :func:`broadcast_full_batch` — with BitPipe each edge rank embeds the tokens
   *and* computes the loss, so every tensor-parallel rank there needs tokens, labels and loss
   mask; Megatron-LM's ``get_batch_on_this_tp_rank`` broadcasts all of them on its
   ``mtp_on_this_rank`` path and only half of them on a first or last pipeline stage.
5. **Optimizers and schedules** (:mod:`megatron_bitpipe.optimizers`):
   :func:`get_megatron_optimizer_config` and :func:`get_megatron_optimizer` build ``--optimizer
   lamb``, ``onebit_lamb`` and ``schedulefree_adamw`` (Megatron-LM's own optimizers otherwise);
   :func:`optimizer_param_scheduler` is Megatron-LM's scheduler class with ``rex`` (and no
   warm-up of its own for Schedule-Free, which warms up itself); :func:`evaluate`,
   :func:`save_checkpoint` and :func:`load_checkpoint` run Megatron-LM's functions with
   Schedule-Free's averaged weights in the model (:func:`~megatron_bitpipe.optimizers.averaged_weights`).

:func:`install` is the runtime route: it wraps Megatron-LM's own functions (``parse_args`` and
``validate_args`` as ``initialize_megatron`` sees them, ``arguments.parse_args``, ``training.get_model``,
``utils.get_batch_on_this_tp_rank``, and in ``training`` the optimizer, scheduler, evaluation
and checkpoint functions) so an unmodified script gets all five. It must run
before the script imports ``get_batch_on_this_tp_rank`` by name (``pretrain_gpt.py`` does).
The patch route (``patches/megatron-lm-core_v0.16.1.patch``) makes the same calls from
Megatron-LM's source; on a patched checkout :func:`install` does nothing.

Everything is decided at call time from the parsed arguments: with ``--pipeline-schedule``
``default`` (and no ``--layout-independent-init``) Megatron-LM runs exactly as without the
plugin.
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable

from ..optimizers import OPTIMIZERS, OptimizerChoice, ParamScheduler, averaged_weights, build_megatron_optimizer
from ..plugin import register
from ..megatron_args import schedule_choice
from .args import chain_args_provider, layout_independent_init, validate_megatron_lm_args
from .losses import make_megatron_lm_forward_backward_func

__all__ = [
    "PATCH_MARKER",
    "setup",
    "get_model",
    "broadcast_full_batch",
    "get_megatron_optimizer_config",
    "get_megatron_optimizer",
    "optimizer_param_scheduler",
    "evaluate",
    "save_checkpoint",
    "load_checkpoint",
    "install",
]

_OWN = OPTIMIZERS[1:]  # built here; Megatron-LM builds the others
_OPTIMIZER_OF_MODEL = "megatron_bitpipe_optimizer"
"""Attribute of the model chunks naming the optimizer built by :func:`get_megatron_optimizer`
(Megatron-LM's ``evaluate`` receives the model, not the optimizer)."""

PATCH_MARKER = "MEGATRON_BITPIPE_PATCHED"
"""Name the patch defines as True in ``megatron.training.training``."""


def setup(args: argparse.Namespace) -> None:
    """Check the parsed flags (:class:`~megatron_bitpipe.megatron_args.BitPipeConfigError`) and
    install ``--pipeline-schedule``'s forward_backward_func. Local: no communication."""
    validate_megatron_lm_args(args)
    schedule = getattr(args, "pipeline_schedule", "default")
    bitpipe_func = make_megatron_lm_forward_backward_func(schedule_choice(args)) if schedule == "bitpipe" else None
    register(schedule, bitpipe_func=bitpipe_func)


def get_model(megatron_get_model: Callable, model_provider_func: Callable, *args, **kwargs) -> list:
    """Megatron-LM's ``get_model(model_provider_func, model_type, wrap_with_ddp, config,
    pg_collection)`` for the selected schedule; ``megatron_get_model`` is Megatron-LM's own."""
    from megatron.core import mpu
    from megatron.training import get_args

    from .model import get_bitpipe_model, initialize_chunks_from_seed

    megatron_args = get_args()
    if getattr(megatron_args, "pipeline_schedule", "default") == "bitpipe":
        return get_bitpipe_model(model_provider_func, *args, **kwargs)
    model = megatron_get_model(model_provider_func, *args, **kwargs)
    if layout_independent_init(megatron_args):
        initialize_chunks_from_seed(model, megatron_args.seed, mpu.get_tensor_model_parallel_group())
    return model


def broadcast_full_batch(mtp_on_this_rank: bool) -> bool:
    """The ``mtp_on_this_rank`` to give ``get_batch_on_this_tp_rank``: true with BitPipe."""
    from megatron.training import get_args

    return mtp_on_this_rank or getattr(get_args(), "pipeline_schedule", "default") == "bitpipe"


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


def get_megatron_optimizer(megatron_fn: Callable, config, model_chunks, *args, **kwargs):
    """``megatron.core.optimizer.get_megatron_optimizer`` as Megatron-LM calls it; builds
    ``--optimizer lamb | onebit_lamb | schedulefree_adamw`` with
    :func:`~megatron_bitpipe.optimizers.build_megatron_optimizer` and records it on the model
    chunks for :func:`evaluate`."""
    from megatron.training import get_args

    megatron_args = get_args()
    if megatron_args.optimizer not in _OWN:
        return megatron_fn(config, model_chunks, *args, **kwargs)
    optimizer = build_megatron_optimizer(
        config, OptimizerChoice.from_args(megatron_args), list(model_chunks), config_overrides=kwargs.get("config_overrides")
    )
    for chunk in model_chunks:
        setattr(chunk, _OPTIMIZER_OF_MODEL, optimizer)
    return optimizer


def optimizer_param_scheduler(args) -> Callable:
    """The class Megatron-LM's ``get_optimizer_param_scheduler`` instantiates: megatron's
    scheduler with ``rex`` (``--rex-beta``); without warm-up for Schedule-Free AdamW, whose
    warm-up is its own (``--lr-warmup-iters``)."""

    def build(optimizer, **kwargs):
        if args.optimizer == "schedulefree_adamw":
            kwargs["lr_warmup_steps"] = 0
        return ParamScheduler(optimizer, rex_beta=args.rex_beta, **kwargs)

    return build


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


def load_checkpoint(megatron_load: Callable, model, optimizer, *args, **kwargs):
    """Megatron-LM's ``load_checkpoint`` in Schedule-Free's eval mode (so its training weights
    come back exactly). Megatron-LM's checkpoints hold one data-parallel rank's optimizer
    state, so 1-bit LAMB's per-rank error feedback restarts from zero with data parallelism."""
    from megatron.core import mpu

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
    """Route Megatron-LM's functions through this module (the runtime route). Idempotent."""
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    import megatron.training.utils as utils
    import megatron.training.arguments as arguments

    if hasattr(initialize.parse_args, "megatron_bitpipe_original") or getattr(training, PATCH_MARKER, False):
        return  # installed already, or the checkout carries the patch route's calls
    parse_args, validate_args = initialize.parse_args, initialize.validate_args
    megatron_get_model, get_batch = training.get_model, utils.get_batch_on_this_tp_rank
    originals = {
        name: getattr(training, name)
        for name in ("get_megatron_optimizer_config", "get_megatron_optimizer", "evaluate", "save_checkpoint", "load_checkpoint")
    }

    def parse_args_with_plugin(extra_args_provider=None, ignore_unknown_args=False):
        return parse_args(chain_args_provider(extra_args_provider), ignore_unknown_args)

    def validate_args_with_plugin(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        args = validate_args(args, defaults)
        setup(args)
        training.OptimizerParamScheduler = optimizer_param_scheduler(args)
        return args

    def get_model_with_plugin(model_provider_func, *args, **kwargs):
        return get_model(megatron_get_model, model_provider_func, *args, **kwargs)

    def get_batch_with_plugin(data_iterator, mtp_on_this_rank=False):
        return get_batch(data_iterator, mtp_on_this_rank=broadcast_full_batch(mtp_on_this_rank))

    replacements = {
        "get_megatron_optimizer_config": lambda args: get_megatron_optimizer_config(originals["get_megatron_optimizer_config"], args),
        "get_megatron_optimizer": lambda *a, **k: get_megatron_optimizer(originals["get_megatron_optimizer"], *a, **k),
        "evaluate": lambda *a, **k: evaluate(originals["evaluate"], *a, **k),
        "save_checkpoint": lambda *a, **k: save_checkpoint(originals["save_checkpoint"], *a, **k),
        "load_checkpoint": lambda *a, **k: load_checkpoint(originals["load_checkpoint"], *a, **k),
    }
    for name, replacement in replacements.items():
        setattr(training, name, _wrap(originals[name], replacement))
    initialize.parse_args = _wrap(parse_args, parse_args_with_plugin)
    # Megatron-LM's in-process-restart check pre-parses the command line through the module's
    # own parse_args; the plugin's flags and choices must be known there too.
    arguments.parse_args = _wrap(arguments.parse_args, parse_args_with_plugin)
    initialize.validate_args = _wrap(validate_args, validate_args_with_plugin)
    training.get_model = _wrap(megatron_get_model, get_model_with_plugin)
    utils.get_batch_on_this_tp_rank = _wrap(get_batch, get_batch_with_plugin)
