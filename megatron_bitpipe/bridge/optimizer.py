"""Megatron-Bridge's optimizer and its parameter all-gathers for a plan schedule's chunks.

With ``ddp.use_distributed_optimizer`` Bridge's ``setup_optimizer`` calls megatron-core's
``get_megatron_optimizer`` (imported by name into ``megatron.bridge.training.optim``) once,
over megatron's data-parallel group; a plan schedule's chunk reduces its gradients over its own
grad-sync group (its stage's replicas x data parallel), so :func:`get_megatron_optimizer`
builds one megatron ``DistributedOptimizer`` per chunk over that group, chained in stage order
(:func:`megatron_bitpipe.execution.distributed_optimizer.build_distributed_optimizer`, as on the
Megatron-LM route).

With ``ddp.overlap_param_gather`` each chunk's parameter all-gather starts right after its
optimizer step, asynchronously, in stage order, and the chunk's first forward waits for it
(:class:`~megatron_bitpipe.execution.distributed_optimizer.ChunkDistributedOptimizer`).
Bridge's training loop (``megatron.bridge.training.train``) removes the forward pre-hooks for
its first iteration and around evaluations and forces the gathers before a save
(``disable_forward_pre_hook``, ``enable_forward_pre_hook``, ``force_param_sync``); each walks
the chunks and, where no gather is in flight, gathers again, blocking, over the chunk's
grad-sync group: :func:`in_stage_order` gives them the chunks in stage order, the same on every
rank of a group (the local chunk order is not).

:func:`route_optimizer` puts both where Bridge looks them up; each defers to Bridge's and
megatron's own functions unless the installed schedule runs plans. Local.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from ..execution.distributed_optimizer import build_distributed_optimizer
from ..execution.forward_backward import pipeline_groups_of
from ..execution.replicas import stage_order
from ..plugin import installed_schedule

__all__ = ["PARAM_SYNC_FUNCTIONS", "get_megatron_optimizer", "in_stage_order", "route_optimizer"]

#: Bridge's functions (``megatron.bridge.training.train``, 0.6) that walk the model chunks for
#: ``ddp.overlap_param_gather``: each waits for a chunk's gather in flight, or gathers it, blocking
PARAM_SYNC_FUNCTIONS = ("force_param_sync", "disable_forward_pre_hook", "enable_forward_pre_hook")

_ORIGINAL = "megatron_bitpipe_original"


def _runs_plans() -> bool:
    installed = installed_schedule()
    return installed is not None and installed.run_config is not None and installed.run_config.executes_plan


def get_megatron_optimizer(megatron_fn: Callable, config, model_chunks, *args, **kwargs):
    """megatron-core's ``get_megatron_optimizer(config, model_chunks, ...)`` as Bridge calls it;
    with a plan schedule and ``config.use_distributed_optimizer``, one distributed optimizer per
    chunk (Bridge's ``config_overrides`` kept; module docstring). Collective (its groups' buffers)."""
    if _runs_plans() and config.use_distributed_optimizer:
        chunks = list(model_chunks)
        return build_distributed_optimizer(chunks, pipeline_groups_of(chunks), config, config_overrides=kwargs.get("config_overrides"))
    return megatron_fn(config, model_chunks, *args, **kwargs)


def in_stage_order(megatron_fn: Callable, model, *args, **kwargs):
    """Bridge's ``megatron_fn`` (:data:`PARAM_SYNC_FUNCTIONS`) over a plan schedule's chunks in
    stage order (module docstring); other schedules: unchanged."""
    if _runs_plans():
        chunks = list(model)
        model = [chunks[c] for c in stage_order(pipeline_groups_of(chunks))]
    return megatron_fn(model, *args, **kwargs)


def _wrap(module, name: str, hook: Callable) -> None:
    current = getattr(module, name)
    original = getattr(current, _ORIGINAL, current)
    wrapped = functools.wraps(original)(functools.partial(hook, original))
    setattr(wrapped, _ORIGINAL, original)
    setattr(module, name, wrapped)


def route_optimizer() -> None:
    """Put :func:`get_megatron_optimizer` and :func:`in_stage_order` where Bridge's
    ``setup_optimizer`` and training loop look them up (their modules' namespaces). Local; idempotent."""
    optim = importlib.import_module("megatron.bridge.training.optim")
    train = importlib.import_module("megatron.bridge.training.train")
    _wrap(optim, "get_megatron_optimizer", get_megatron_optimizer)
    for name in PARAM_SYNC_FUNCTIONS:
        _wrap(train, name, in_stage_order)
