"""The schedule generators by name: the one list the schedule command line, the training
flags (``--pipeline-schedule``), the runtime and the docs read.

:data:`REGISTRY` (a :class:`~megatron_bitpipe.registry.Registry`) maps each name to its
:class:`~.generator.ScheduleGenerator` (each generator module's ``GENERATOR``), in the order
listings show them; :func:`register` adds one (a name may be registered once); :func:`generator`
looks one up with a message listing the names.
"""

from __future__ import annotations

from typing import Tuple

from ..registry import Registry
from . import bitpipe, chimera, dualpipe, dualpipev, interleaved, one_f_one_b, zb_h1, zbv
from .errors import ScheduleConfigError
from .generator import PLAN_RUNNER, ScheduleGenerator

__all__ = ["REGISTRY", "generator", "register", "schedule_names", "training_schedules", "plan_executed_schedules"]

#: schedule name -> generator, in listing order
REGISTRY: Registry[ScheduleGenerator] = Registry(
    "a schedule", lambda name, names: ScheduleConfigError(f"--schedule: unknown schedule {name!r}; choose from {names}")
)


#: ``register(schedule)``: add a generator under its name (:class:`ValueError` if the name is taken)
register = REGISTRY.add
#: ``generator(name)``: the generator called ``name`` (:class:`~.errors.ScheduleConfigError` naming the choices)
generator = REGISTRY.lookup
#: ``schedule_names()``: every registered schedule, in listing order
schedule_names = REGISTRY.names


def training_schedules() -> Tuple[str, ...]:
    """The schedules training runs (``--pipeline-schedule`` values besides ``default``)."""
    return tuple(name for name, g in REGISTRY.items() if g.runner is not None)


def plan_executed_schedules() -> Tuple[str, ...]:
    """The training schedules this package's plan executor runs (the others are megatron-core's)."""
    return tuple(name for name, g in REGISTRY.items() if g.runner == PLAN_RUNNER)


for _module in (one_f_one_b, interleaved, chimera, bitpipe, zb_h1, zbv, dualpipe, dualpipev):
    register(_module.GENERATOR)
