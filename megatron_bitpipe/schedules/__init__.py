"""Pipeline schedules as data: plans, placements, generators, validation, simulation.

Nothing in this package needs ``torch.distributed``. A generator returns a
:class:`~.actions.SchedulePlan` (per-rank ordered actions plus the placement that
implies all communication); :func:`~.validate.validate_plan` checks it,
:func:`~.simulate.simulate` times it under a :class:`~.simulate.CostModel`,
:mod:`.render` draws it and the runtime executes it.

``generate(name, D, N, ...)`` is the one entry point that the command line, the
benchmarks and the runtime use; ``split_backward=True`` runs every backward as an
input-gradient and a later weight-gradient action (:mod:`.split_backward`; BitPipe's is
ordered for the cost model, :mod:`.list_scheduling`). The zero-bubble and DualPipe peers
(``zb-h1``, ``zbv``, ``dualpipe``, ``dualpipev``) always split their backwards.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from . import bitpipe, chimera, dualpipe, dualpipev, interleaved, one_f_one_b, zb_h1, zbv
from .split_backward import split_backward as _split_backward
from .actions import Action, ActionType, SchedulePlan
from .errors import PlanError, ScheduleConfigError
from .placement import Placement, StageLocation
from .simulate import CostModel, SimulationResult, simulate
from .validate import validate_plan

GENERATORS: Dict[str, Callable[..., SchedulePlan]] = {
    "1f1b": one_f_one_b.generate,
    "interleaved": interleaved.generate,
    "chimera": chimera.generate,
    "bitpipe": bitpipe.generate,
    "zb-h1": zb_h1.generate,
    "zbv": zbv.generate,
    "dualpipe": dualpipe.generate,
    "dualpipev": dualpipev.generate,
}
SCHEDULES = tuple(GENERATORS)
ALWAYS_SPLIT = ("zb-h1", "zbv", "dualpipe", "dualpipev")  #: schedules whose own order splits backwards


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
    to a forward-only plan, and the :data:`ALWAYS_SPLIT` schedules split either way
    (``zbv`` orders for ``costs`` too). Raises :class:`ScheduleConfigError` naming the
    offending flag.
    """
    plan = _generate(schedule, num_ranks, num_microbatches, virtual_size, forward_only, costs)
    if not split_backward or forward_only or schedule in ALWAYS_SPLIT:
        return plan
    if schedule == "bitpipe":
        return bitpipe.with_split_backward(plan, costs)
    return _split_backward(plan, costs)


def _generate(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_size: Optional[int],
    forward_only: bool,
    costs: Optional[CostModel],
) -> SchedulePlan:
    if schedule not in GENERATORS:
        raise ScheduleConfigError(f"--schedule: unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if schedule == "interleaved":
        return interleaved.generate(num_ranks, num_microbatches, 2 if virtual_size is None else virtual_size, forward_only)
    if virtual_size not in (None, 1):
        raise ScheduleConfigError(
            f"--virtual-pipeline-model-parallel-size: {schedule} has a fixed number of chunks per rank"
        )
    if schedule == "zbv":
        return zbv.generate(num_ranks, num_microbatches, forward_only, costs)
    return GENERATORS[schedule](num_ranks, num_microbatches, forward_only)


__all__ = [
    "ALWAYS_SPLIT",
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
    "simulate",
    "validate_plan",
]
