"""Where the plugin meets Megatron-LM's training code (tag core_v0.16.1).

Megatron-LM needs four things from the plugin; both routes call the same functions here:

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

:func:`install` is the runtime route: it wraps Megatron-LM's own functions (``parse_args`` and
``validate_args`` as ``initialize_megatron`` sees them, ``training.get_model``,
``utils.get_batch_on_this_tp_rank``) so an unmodified script gets all four. It must run
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

from ..plugin import register
from ..megatron_args import schedule_choice
from .args import chain_args_provider, layout_independent_init, validate_megatron_lm_args
from .losses import make_megatron_lm_forward_backward_func

__all__ = ["PATCH_MARKER", "setup", "get_model", "broadcast_full_batch", "install"]

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


def _wrap(original: Callable, replacement: Callable) -> Callable:
    wrapper = functools.wraps(original)(replacement)
    wrapper.megatron_bitpipe_original = original
    return wrapper


def install() -> None:
    """Route Megatron-LM's functions through this module (the runtime route). Idempotent."""
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    import megatron.training.utils as utils

    if hasattr(initialize.parse_args, "megatron_bitpipe_original") or getattr(training, PATCH_MARKER, False):
        return  # installed already, or the checkout carries the patch route's calls
    parse_args, validate_args = initialize.parse_args, initialize.validate_args
    megatron_get_model, get_batch = training.get_model, utils.get_batch_on_this_tp_rank

    def parse_args_with_plugin(extra_args_provider=None, ignore_unknown_args=False):
        return parse_args(chain_args_provider(extra_args_provider), ignore_unknown_args)

    def validate_args_with_plugin(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        args = validate_args(args, defaults)
        setup(args)
        return args

    def get_model_with_plugin(model_provider_func, *args, **kwargs):
        return get_model(megatron_get_model, model_provider_func, *args, **kwargs)

    def get_batch_with_plugin(data_iterator, mtp_on_this_rank=False):
        return get_batch(data_iterator, mtp_on_this_rank=broadcast_full_batch(mtp_on_this_rank))

    initialize.parse_args = _wrap(parse_args, parse_args_with_plugin)
    initialize.validate_args = _wrap(validate_args, validate_args_with_plugin)
    training.get_model = _wrap(megatron_get_model, get_model_with_plugin)
    utils.get_batch_on_this_tp_rank = _wrap(get_batch, get_batch_with_plugin)
