"""Pipeline schedules as data: plans, placements, generators, validation, simulation.

Nothing in this package needs ``torch.distributed``. A :class:`~.choice.ScheduleChoice`
(schedule, split backward, costs, virtual size) states the rules of a selection
(:meth:`~.choice.ScheduleChoice.problems`) and makes its plans: a generator returns a
compute-only :class:`~.actions.SchedulePlan` (per-rank ordered actions plus the placement that
implies all communication), :func:`~.lower.lower` writes that communication into the plan as
``SEND`` / ``RECV`` actions; :func:`~.validate.validate_plan` checks it,
:func:`~.simulate.simulate` times it under a :class:`~.costs.CostModel`, :mod:`.render`
draws it and the runtime executes it.

:func:`generate` is the short form ``ScheduleChoice(...).plan(D, N)`` (lowered plans;
``plan.compute_only()`` is the generator's order);
``split_backward=True`` runs every backward as an input-gradient and a later
weight-gradient action (:mod:`.split_backward`; BitPipe's is ordered for the cost model,
:mod:`.list_scheduling`). The zero-bubble and DualPipe peers (``zb-h1``, ``zbv``,
``dualpipe``, ``dualpipev``) always split their backwards.

For a model's shape (:class:`~.model_shape.ModelShape`, mixture-of-experts layers included:
:class:`~.moe_shape.MoEShape`), :func:`~.model_step.simulate_model`
costs each stage from its own layers, the embedding and the head (:mod:`.stage_costs`) and
reports every rank's memory (:mod:`.memory`); :mod:`.layout_search` finds the fastest split of the
layers within a memory budget per rank.
"""

from __future__ import annotations

from typing import Optional

from .actions import Action, ActionType, SchedulePlan
from .choice import ScheduleChoice
from .generator import ScheduleGenerator
from .errors import PlanError, ScheduleConfigError
from .lower import lower
from .placement import Placement, StageLocation
from .registry import REGISTRY, register, schedule_names
from .costs import CostModel
from .simulate import SimulationResult, simulate
from .split_backward import SPLIT_BACKWARD_SUFFIX
from .validate import validate_plan


def generate(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_size: Optional[int] = None,
    forward_only: bool = False,
    split_backward: bool = False,
    costs: Optional[CostModel] = None,
) -> SchedulePlan:
    """Plan of ``schedule`` for ``num_ranks`` pipeline ranks and ``num_microbatches``:
    ``ScheduleChoice(schedule, split_backward, costs, virtual_size).plan(num_ranks,
    num_microbatches, forward_only)``. Raises :class:`ScheduleConfigError` naming the flags."""
    return ScheduleChoice(schedule, split_backward, costs, virtual_size).plan(num_ranks, num_microbatches, forward_only)


__all__ = [
    "Action",
    "ActionType",
    "CostModel",
    "Placement",
    "PlanError",
    "REGISTRY",
    "SPLIT_BACKWARD_SUFFIX",
    "ScheduleChoice",
    "ScheduleConfigError",
    "ScheduleGenerator",
    "SchedulePlan",
    "SimulationResult",
    "StageLocation",
    "generate",
    "lower",
    "register",
    "schedule_names",
    "simulate",
    "validate_plan",
]
