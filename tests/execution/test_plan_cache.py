"""The plans of a step function (pure): one per number of micro-batches N, made and validated
once, owned by the step function (a batch-size ramp's steps each find their own N's plan)."""

from __future__ import annotations

import pytest

from megatron_bitpipe.execution.forward_backward import PlanCache, make_step_func
from megatron_bitpipe.schedules import ScheduleChoice, ScheduleConfigError


def test_one_plan_per_number_of_micro_batches():
    plans = PlanCache(ScheduleChoice("bitpipe"))
    ramp = [plans.plan(2, n, False) for n in (2, 2, 4, 6, 6)]
    assert [p.num_microbatches for p in ramp] == [2, 2, 4, 6, 6]
    assert ramp[0] is ramp[1] and ramp[3] is ramp[4] and len(plans) == 3
    assert plans.plan(2, 4, True) is not ramp[2] and len(plans) == 4  # evaluation: forward only
    with pytest.raises(ScheduleConfigError, match="even number of micro-batches"):
        plans.plan(2, 3, False)
    assert len(plans) == 4


def test_each_step_function_owns_its_plans():
    first, second = make_step_func(ScheduleChoice("zbv")), make_step_func(ScheduleChoice("zbv"))
    assert isinstance(first.plans, PlanCache) and first.plans is not second.plans
    first.plans.plan(2, 4, False)
    assert len(first.plans) == 1 and len(second.plans) == 0
