"""Installing the BitPipe schedule where megatron-core and Megatron-LM look it up.

megatron-core's ``get_forward_backward_func`` is a fixed choice between its own schedules
(its arguments: ``pp_size, vp_size``, and since 0.19 ``schedule_pg_collection``), and Megatron-LM's ``training.py`` imports it by name. :func:`register`
replaces that function — in ``megatron.core.pipeline_parallel``, its ``schedules`` module
and, when imported, ``megatron.training.training`` — with one that returns
:func:`~megatron_bitpipe.execution.forward_backward.forward_backward_bitpipe` while the
selected schedule is ``bitpipe`` (or the function given to :func:`register`, e.g. Megatron-LM's
variant that hands the loss reports to the last pipeline stage) and defers to the original
otherwise. :func:`unregister` restores the original everywhere.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional

from .megatron_args import PIPELINE_SCHEDULES

_TARGETS = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules", "megatron.training.training")
_state = {"schedule": None, "original": None, "bitpipe": None}


def _get_forward_backward_func(*args, **kwargs) -> Callable:
    """megatron-core's ``get_forward_backward_func``; the arguments go to the original unchanged."""
    if _state["schedule"] == "bitpipe":
        if _state["bitpipe"] is not None:
            return _state["bitpipe"]
        from .execution.forward_backward import forward_backward_bitpipe

        return forward_backward_bitpipe
    return _state["original"](*args, **kwargs)


def register(schedule: str = "bitpipe", *, bitpipe_func: Optional[Callable] = None) -> None:
    """Make megatron's ``get_forward_backward_func`` return ``schedule``'s function.

    ``schedule`` is a ``--pipeline-schedule`` value; ``default``, ``1f1b`` and
    ``interleaved`` keep megatron-core's own functions (chosen by the vp size as usual).
    ``bitpipe_func`` replaces the function returned for ``bitpipe`` (default
    :func:`~megatron_bitpipe.execution.forward_backward.forward_backward_bitpipe`).
    Idempotent; call again to switch schedules.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--pipeline-schedule: unknown schedule {schedule!r}; choose from {', '.join(PIPELINE_SCHEDULES)}")
    core = importlib.import_module("megatron.core.pipeline_parallel")
    if _state["original"] is None:
        _state["original"] = core.get_forward_backward_func
    _state["schedule"] = schedule
    _state["bitpipe"] = bitpipe_func
    for name in _TARGETS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_forward_backward_func"):
            module.get_forward_backward_func = _get_forward_backward_func


def unregister() -> None:
    """Restore megatron-core's own ``get_forward_backward_func`` everywhere it was replaced."""
    if _state["original"] is None:
        return
    for name in _TARGETS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "get_forward_backward_func", None) is _get_forward_backward_func:
            module.get_forward_backward_func = _state["original"]
    _state["schedule"] = None
    _state["bitpipe"] = None
