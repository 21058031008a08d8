"""Where the plugin meets Megatron-LM's training code (tag core_v0.16.1).

Megatron-LM needs six things from the plugin; both routes call the same functions here:

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
5. **Optimizer**: :func:`get_megatron_optimizer` — with BitPipe and
   ``--use-distributed-optimizer`` one distributed optimizer per chunk, over the chunk's
   grad-sync group (:mod:`megatron_bitpipe.runtime.distributed_optimizer`); megatron-core's
   ``get_megatron_optimizer`` otherwise.
6. **Loading**: :func:`load_checkpoint` — Megatron-LM's, after the checks of
   :mod:`.checkpointing` (any schedule: never a silent or partial load).

:func:`install` is the runtime route: it wraps Megatron-LM's own functions (``parse_args`` and
``validate_args`` as ``initialize_megatron`` sees them, ``training.get_model``,
``training.get_megatron_optimizer``, ``training.load_checkpoint``,
``utils.get_batch_on_this_tp_rank``) so an unmodified script gets all six. It must run
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
from ..runtime.forward_backward import make_forward_backward_func
from .args import chain_args_provider, layout_independent_init, validate_megatron_lm_args
from .losses import forward_backward_for_megatron_lm

__all__ = [
    "PATCH_MARKER",
    "setup",
    "get_model",
    "broadcast_full_batch",
    "get_megatron_optimizer",
    "load_checkpoint",
    "patched_get_megatron_optimizer",
    "patched_load_checkpoint",
    "install",
]

PATCH_MARKER = "MEGATRON_BITPIPE_PATCHED"
"""Name the patch defines as True in ``megatron.training.training``."""


def setup(args: argparse.Namespace) -> None:
    """Check the parsed flags (:class:`~megatron_bitpipe.megatron_args.BitPipeConfigError`) and
    install ``--pipeline-schedule``'s forward_backward_func. Local: no communication.

    With bitpipe and ``--use-distributed-optimizer`` the optimizer state is checkpointed in
    the ``fully_reshardable`` form, the only one bitpipe's per-chunk optimizers have
    (``--dist-ckpt-optim-fully-reshardable`` is switched on, with a note).
    """
    validate_megatron_lm_args(args)
    bitpipe = getattr(args, "pipeline_schedule", "default") == "bitpipe"
    if bitpipe and args.use_distributed_optimizer and not args.dist_ckpt_optim_fully_reshardable:
        args.dist_ckpt_optim_fully_reshardable = True
        if args.rank == 0:
            print(
                "megatron_bitpipe: --pipeline-schedule bitpipe with --use-distributed-optimizer saves its optimizer "
                "state fully reshardable (--dist-ckpt-optim-fully-reshardable)",
                flush=True,
            )
    bitpipe_func = forward_backward_for_megatron_lm
    if getattr(args, "split_backward", False):
        split = make_forward_backward_func("bitpipe", split_backward=True)
        bitpipe_func = functools.partial(forward_backward_for_megatron_lm, bitpipe_func=split)
    register(getattr(args, "pipeline_schedule", "default"), bitpipe_func=bitpipe_func)


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


def get_megatron_optimizer(megatron_get_megatron_optimizer: Callable, config, model_chunks, *args, **kwargs):
    """Megatron-LM's optimizer (``megatron_get_megatron_optimizer`` is megatron-core's
    ``get_megatron_optimizer``); with bitpipe and the distributed optimizer one per chunk, over
    the chunk's grad-sync group, keeping the ``config_overrides`` Megatron-LM passes."""
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args

    from ..runtime.distributed_optimizer import build_distributed_optimizer

    if getattr(get_args(), "pipeline_schedule", "default") == "bitpipe" and config.use_distributed_optimizer:
        groups = unwrap_model(model_chunks[0]).pipeline_groups
        return build_distributed_optimizer(model_chunks, groups, config, config_overrides=kwargs.get("config_overrides"))
    return megatron_get_megatron_optimizer(config, model_chunks, *args, **kwargs)


def load_checkpoint(megatron_load_checkpoint: Callable, *args, **kwargs):
    """Megatron-LM's ``load_checkpoint`` behind the checks of :mod:`.checkpointing`."""
    from .checkpointing import load_checkpoint as checked_load_checkpoint

    return checked_load_checkpoint(megatron_load_checkpoint, *args, **kwargs)


def patched_get_megatron_optimizer(*args, **kwargs):
    """:func:`get_megatron_optimizer` around megatron-core's own (the patch route's call)."""
    from megatron.core import optimizer

    return get_megatron_optimizer(optimizer.get_megatron_optimizer, *args, **kwargs)


def patched_load_checkpoint(*args, **kwargs):
    """:func:`load_checkpoint` around Megatron-LM's own (the patch route's call)."""
    from megatron.training import checkpointing

    return load_checkpoint(checkpointing.load_checkpoint, *args, **kwargs)


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
    megatron_get_optimizer, megatron_load_checkpoint = training.get_megatron_optimizer, training.load_checkpoint

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

    def get_optimizer_with_plugin(config, model_chunks, *args, **kwargs):
        return get_megatron_optimizer(megatron_get_optimizer, config, model_chunks, *args, **kwargs)

    def load_checkpoint_with_plugin(*args, **kwargs):
        return load_checkpoint(megatron_load_checkpoint, *args, **kwargs)

    initialize.parse_args = _wrap(parse_args, parse_args_with_plugin)
    initialize.validate_args = _wrap(validate_args, validate_args_with_plugin)
    training.get_model = _wrap(megatron_get_model, get_model_with_plugin)
    utils.get_batch_on_this_tp_rank = _wrap(get_batch, get_batch_with_plugin)
    training.get_megatron_optimizer = _wrap(megatron_get_optimizer, get_optimizer_with_plugin)
    training.load_checkpoint = _wrap(megatron_load_checkpoint, load_checkpoint_with_plugin)
