"""Pipeline schedules as data: plans, placements, generators, validation, simulation.

Nothing in this package needs ``torch.distributed``. A generator returns a compute-only
:class:`~.actions.SchedulePlan` (per-rank ordered actions plus the placement that
implies all communication); :func:`~.lower.lower` writes that communication into the
plan as ``SEND`` / ``RECV`` actions; :func:`~.validate.validate_plan` checks it,
:func:`~.simulate.simulate` times it under a :class:`~.simulate.CostModel`,
:mod:`.render` draws it and the runtime executes it.

``generate(name, D, N, ...)`` is the one entry point that the command line, the
benchmarks and the runtime use; it returns lowered plans. ``split_backward=True`` runs
every backward as an input-gradient and a later weight-gradient action
(:mod:`.split_backward`).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from . import bitpipe, chimera, interleaved, one_f_one_b
from .split_backward import split_backward as _split_backward
from .actions import Action, ActionType, SchedulePlan
from .errors import PlanError, ScheduleConfigError
from .lower import lower
from .placement import Placement, StageLocation
from .simulate import CostModel, SimulationResult, simulate
from .validate import validate_plan

GENERATORS: Dict[str, Callable[..., SchedulePlan]] = {
    "1f1b": one_f_one_b.generate,
    "interleaved": interleaved.generate,
    "chimera": chimera.generate,
    "bitpipe": bitpipe.generate,
}
SCHEDULES = tuple(GENERATORS)


def generate(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_size: Optional[int] = None,
    forward_only: bool = False,
    split_backward: bool = False,
    costs: Optional[CostModel] = None,
) -> SchedulePlan:
    """Plan of ``schedule`` for ``num_ranks`` pipeline ranks and ``num_microbatches``.

    ``virtual_size`` (chunks per rank) applies to ``interleaved`` only (default 2).
    ``split_backward`` places weight-gradient actions for ``costs`` (default
    :class:`CostModel`: ``t_B = 2 t_F``, half of it weight gradients); it does nothing
    to a forward-only plan. The plan is lowered (:func:`lower`: explicit ``SEND`` /
    ``RECV`` actions, each receive posted right before its consumer); ``plan.compute_only()``
    is the generator's order. Raises :class:`ScheduleConfigError` naming the offending flag.
    """
    plan = _generate(schedule, num_ranks, num_microbatches, virtual_size, forward_only)
    plan = _split_backward(plan, costs) if split_backward and not forward_only else plan
    return lower(plan)


def _generate(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_size: Optional[int], forward_only: bool
) -> SchedulePlan:
    if schedule not in GENERATORS:
        raise ScheduleConfigError(f"--schedule: unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if schedule == "interleaved":
        return interleaved.generate(num_ranks, num_microbatches, 2 if virtual_size is None else virtual_size, forward_only)
    if virtual_size not in (None, 1):
        raise ScheduleConfigError(
            f"--virtual-pipeline-model-parallel-size: {schedule} has a fixed number of chunks per rank"
        )
    return GENERATORS[schedule](num_ranks, num_microbatches, forward_only)


__all__ = [
    "Action",
    "ActionType",
    "CostModel",
    "GENERATORS",
    "Placement",
    "PlanError",
    "SCHEDULES",
    "ScheduleConfigError",
    "SchedulePlan",
    "SimulationResult",
    "StageLocation",
    "generate",
    "lower",
    "simulate",
    "validate_plan",
]
