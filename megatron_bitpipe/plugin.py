"""Installing a plan-executed schedule where megatron-core and Megatron-LM look it up.

megatron-core's ``get_forward_backward_func`` is a fixed choice between its own schedules
(its arguments: ``pp_size, vp_size``, and since 0.19 ``schedule_pg_collection``), and
Megatron-LM's ``training.py`` and Megatron-Bridge's ``train`` and ``eval`` import it by name.
:func:`register` replaces that function — in ``megatron.core.pipeline_parallel``, its
``schedules`` module and, when imported, those three — with an :class:`InstalledSchedule`: for a schedule this
package's plan executor runs (the registry's
:attr:`~megatron_bitpipe.schedules.ScheduleChoice.plan_executed`, e.g. ``bitpipe``) it returns
the plan's forward_backward function (or the function given to :func:`register`, e.g.
Megatron-LM's variant that hands the loss reports to the last pipeline stage); otherwise it
defers to megatron-core's original. :func:`unregister` restores the original everywhere.

The installed function is also where a run's
:class:`~megatron_bitpipe.run_config.RunConfig` lives on Megatron-LM's route: Megatron-LM calls
the plugin's hooks by name, without a handle to pass, so the one object both already share —
the function installed at megatron-core's lookup point — holds it (:func:`installed_schedule`).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Callable, Optional

from .megatron_args import PIPELINE_SCHEDULES, PLAN_SCHEDULES

if TYPE_CHECKING:
    from .run_config import RunConfig

__all__ = ["InstalledSchedule", "installed_schedule", "register", "unregister"]

_TARGETS = (
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.training.training",
    "megatron.bridge.training.train",  # Megatron-Bridge's training loop and evaluation
    "megatron.bridge.training.eval",
)


class InstalledSchedule:
    """megatron-core's ``get_forward_backward_func`` with ``schedule`` installed.

    Attributes:
        schedule: the ``--pipeline-schedule`` value (``default`` included).
        original: megatron-core's own ``get_forward_backward_func``.
        plan_func: the forward_backward function returned for a plan-executed ``schedule``
            (``None``: megatron-core's functions run it).
        run_config: the run's decisions (Megatron-LM's route), or ``None``.
    """

    def __init__(self, schedule: str, original: Callable, plan_func: Optional[Callable], run_config: Optional["RunConfig"]):
        self.schedule = schedule
        self.original = original
        self.plan_func = plan_func
        self.run_config = run_config

    def __call__(self, *args, **kwargs) -> Callable:
        """The forward_backward function; the arguments go to megatron-core's original unchanged."""
        if self.plan_func is not None:
            return self.plan_func
        return self.original(*args, **kwargs)


def installed_schedule() -> Optional[InstalledSchedule]:
    """What :func:`register` installed last, or ``None`` (not registered, or unregistered)."""
    core = sys.modules.get("megatron.core.pipeline_parallel")
    found = getattr(core, "get_forward_backward_func", None)
    return found if isinstance(found, InstalledSchedule) else None


def register(schedule: str = "bitpipe", *, plan_func: Optional[Callable] = None, run_config: Optional["RunConfig"] = None) -> None:
    """Make megatron's ``get_forward_backward_func`` return ``schedule``'s function.

    ``schedule`` is a ``--pipeline-schedule`` value; ``default`` and the schedules
    megatron-core runs (``1f1b``, ``interleaved``) keep megatron-core's own functions (chosen
    by the vp size as usual). ``plan_func`` replaces the function returned for a
    plan-executed schedule (default: the plan executor's
    :func:`~megatron_bitpipe.execution.forward_backward.plan_forward_backward_func`);
    ``run_config`` is kept on the installed function (:func:`installed_schedule`).
    Idempotent; call again to switch schedules.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--pipeline-schedule: unknown schedule {schedule!r}; choose from {', '.join(PIPELINE_SCHEDULES)}")
    core = importlib.import_module("megatron.core.pipeline_parallel")
    current = installed_schedule()
    original = current.original if current is not None else core.get_forward_backward_func
    if schedule in PLAN_SCHEDULES and plan_func is None:
        from .execution.forward_backward import plan_forward_backward_func

        plan_func = plan_forward_backward_func(schedule)
    installed = InstalledSchedule(schedule, original, plan_func if schedule in PLAN_SCHEDULES else None, run_config)
    for name in _TARGETS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_forward_backward_func"):
            module.get_forward_backward_func = installed


def unregister() -> None:
    """Restore megatron-core's own ``get_forward_backward_func`` everywhere it was replaced."""
    current = installed_schedule()
    if current is None:
        return
    for name in _TARGETS:
        module = sys.modules.get(name)
        if module is not None and isinstance(getattr(module, "get_forward_backward_func", None), InstalledSchedule):
            module.get_forward_backward_func = current.original
