"""The NCCL model (megatron_bitpipe.schedules.nccl): every generator's plans are deadlock-free
as the runtime issues them, and the model catches the orders that hang on NCCL."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_bitpipe.schedules import REGISTRY, PlanError, ScheduleChoice, schedule_names, validate_plan
from megatron_bitpipe.schedules.actions import Action, ActionType
from megatron_bitpipe.schedules.comm import channel_group_key
from megatron_bitpipe.schedules.nccl import LAZY_UNBATCHED_RULES, RUNTIME_RULES, IssueRules, check_nccl

SCHEDULES = schedule_names()
#: the peers whose own order splits every backward
ALWAYS_SPLIT = tuple(s for s in SCHEDULES if REGISTRY[s].always_split)

VARIANTS = [
    ScheduleChoice(schedule, split).label
    for schedule in SCHEDULES
    for split in ((False,) if schedule in ALWAYS_SPLIT else (False, True))
]
PIPELINE_SIZES = (2, 4, 6, 8, 12, 16)
#: one communicator for the whole pipeline, every operation issued on its own (unbatched)
ONE_COMMUNICATOR = IssueRules("one communicator per pipeline, unbatched", lambda transfer: ("pipeline",))


#: up to this pipeline size every N up to 4D is checked; above it every N up to 2D, then 3D and 4D
#: (a longer steady phase repeats the same pattern; at D = 16 the whole range took a minute of CI)
EVERY_N_UP_TO_D = 8


def plans(label: str, D: int):
    """The plans of ``label`` at ``D`` ranks from its smallest N (none if D is refused): every N
    up to 4D where D <= EVERY_N_UP_TO_D, else every N up to 2D, then 3D and 4D."""
    choice = ScheduleChoice.from_label(label)
    if choice.problems(D):
        return
    for N in range(choice.smallest_num_microbatches(D), 4 * D + 1):
        thinned = D > EVERY_N_UP_TO_D and N > 2 * D and N not in (3 * D, 4 * D)
        if not thinned and not choice.problems(D, N):
            yield choice.plan(D, N)


@pytest.mark.plan_sweep
@pytest.mark.parametrize("D", PIPELINE_SIZES)
@pytest.mark.parametrize("label", VARIANTS)
def test_every_plan_is_deadlock_free_under_nccl_rules_as_the_runtime_issues_it(label, D):
    checked = 0
    for plan in plans(label, D):
        report = check_nccl(plan, RUNTIME_RULES)
        assert report.ok, f"{label} D={D} N={plan.num_microbatches}:\n{report.message()}"
        checked += 1
    assert checked or ScheduleChoice.from_label(label).problems(D), f"{label} D={D}: no plan checked"


def test_the_runtime_pattern_before_this_model_deadlocks_bitpipe():
    """Unbatched isend/irecv on the channel groups (torch then creates a pair communicator on
    first use, a blocking rendezvous) hung BitPipe on a GPU; the model finds the cycle, and the
    same rules leave 1F1B alone (its links are created in a consistent order)."""
    report = check_nccl(ScheduleChoice("bitpipe").plan(4, 4), LAZY_UNBATCHED_RULES)
    assert not report.deadlock_free
    assert report.cycle and all("creates communicator" in link for link in report.cycle)
    assert "pair 1-2" in report.message()
    assert check_nccl(ScheduleChoice("1f1b").plan(4, 8), LAZY_UNBATCHED_RULES).ok


def test_a_bad_posting_order_is_caught_though_buffered_p2p_runs_it():
    """Both ranks send before they receive, unbatched on one communicator: gloo (and the
    validator's buffered simulation) runs it, NCCL cannot."""
    plan = ScheduleChoice("1f1b").plan(2, 2)
    validate_plan(plan)
    report = check_nccl(plan, ONE_COMMUNICATOR)
    assert not report.deadlock_free
    text = report.message()
    assert "rank 0's SEND_F0.1 needs rank 1's RECV_F0.1" in text
    assert "rank 1's RECV_F0.1 is queued behind SEND_B0.0 to rank 0" in text


def test_messages_matched_across_streams_on_one_communicator_are_reported():
    """On one communicator messages between two ranks are matched by order alone: DualPipeV's
    activations and gradients between ranks 1 and 2 cross (wrong data, as megatron's interleaved
    schedule with batched p2p at pp 2 gave measurably wrong gradients)."""
    report = check_nccl(ScheduleChoice("dualpipev").plan(4, 8), ONE_COMMUNICATOR)
    assert report.mismatches[0] == (
        "message 5 from rank 1 to rank 2 on communicator (pipeline): rank 1 sends it for SEND_F0.5, "
        "rank 2 receives it as RECV_B1.0"
    )
    assert check_nccl(ScheduleChoice("dualpipev").plan(4, 8), RUNTIME_RULES).mismatches == []
    assert not report.ok


def test_a_receive_never_posted_is_named():
    plan = ScheduleChoice("1f1b").plan(2, 2)
    dropped = Action(ActionType.RECV_GRADIENT, 0, 1)
    actions = tuple(tuple(a for a in rank if a != dropped) for rank in plan.actions)
    broken = type(plan)(**{**plan.__dict__, "actions": actions})
    report = check_nccl(broken, RUNTIME_RULES)
    assert not report.deadlock_free
    assert any("never matched" in link for link in report.cycle), report.message()


def test_validate_plan_includes_the_nccl_check(monkeypatch):
    import megatron_bitpipe.schedules.validate as validate

    plan = ScheduleChoice("bitpipe").plan(4, 4)
    monkeypatch.setattr(validate, "check_nccl", lambda p: check_nccl(p, LAZY_UNBATCHED_RULES))
    with pytest.raises(PlanError, match="NCCL deadlock"):
        validate.validate_plan(plan)


def test_runtime_rules_use_the_runtime_channel_groups():
    assert RUNTIME_RULES.communicator is channel_group_key
    assert not (RUNTIME_RULES.lazy_communicators or RUNTIME_RULES.pair_communicators)


@pytest.mark.multirank
def test_simulate_cli_reports_nccl_deadlock_freedom():
    args = [sys.executable, "-m", "megatron_bitpipe.schedules", "simulate", "--schedule", "bitpipe",
            "--pipeline-model-parallel-size", "4", "--num-microbatches", "8"]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["nccl_deadlock_free"] is True
    text = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert "NCCL deadlock-free" in text.stdout
