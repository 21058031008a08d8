"""Split backward (I + W) in plans, validation, simulation and the placement of W's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_bitpipe.schedules import REGISTRY, CostModel, PlanError, generate, schedule_names, simulate, validate_plan
from megatron_bitpipe.schedules.actions import Action, ActionType, make_plan
from megatron_bitpipe.schedules.placement import looped
from megatron_bitpipe.schedules.split_backward import split_backward

SCHEDULES = schedule_names()
#: the peers whose own order splits every backward
ALWAYS_SPLIT = tuple(s for s in SCHEDULES if REGISTRY[s].always_split)

F, B, I, W, SYNC = (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT,
                    ActionType.BACKWARD_WEIGHT, ActionType.SYNC)
GRID = [(2, 2), (2, 6), (4, 4), (4, 6), (4, 8), (4, 16), (8, 8), (8, 12), (8, 32)]  # even N >= D


def parse(line: str):
    return [Action.parse(token) for token in line.split()]


def two_rank_plan(rank0: str, rank1: str):
    """1F1B placement, 2 ranks, 2 micro-batches, hand-written action lists."""
    return make_plan("manual", looped(2), 2, [0, 0], [parse(rank0), parse(rank1)])


@pytest.mark.parametrize(
    "schedule,D,N",
    [(s, D, N) for s in SCHEDULES if s not in ALWAYS_SPLIT  # the peers split their own way
     for D, N in GRID if s != "interleaved" or N % D == 0],  # interleaved: N = kD
)
def test_split_plans_are_valid_and_keep_the_forward_and_input_gradient_order(schedule, D, N):
    plan = generate(schedule, D, N)
    split = generate(schedule, D, N, split_backward=True)
    validate_plan(split)
    assert split.split_backward and split.name == f"{schedule}+split-backward"
    for whole, parts in zip(plan.actions, split.actions):
        assert [a.comm_key for a in parts if a.type in (F, I)] == [a for a in whole if a.type in (F, B)]
        assert not any(a.type is B for a in parts)
    unsplit, result = simulate(plan), simulate(split)
    assert result.makespan <= unsplit.makespan + 1e-9
    assert max(result.peak_activations) <= max(unsplit.peak_activations) + 1e-9
    assert sum(result.busy) == pytest.approx(sum(unsplit.busy))  # same work, only reordered


@pytest.mark.parametrize("D,N", [(4, 4), (4, 16), (8, 8), (8, 16), (8, 32)])
def test_bitpipe_with_split_backward_is_the_fastest_plan(D, N):
    ours = simulate(generate("bitpipe", D, N, split_backward=True)).makespan
    for schedule in SCHEDULES:
        if schedule.startswith("dualpipe") and N < 2 * D:
            continue
        for split in (False, True):
            if (schedule, split) != ("bitpipe", True):
                assert ours < simulate(generate(schedule, D, N, split_backward=split)).makespan


def test_bitpipe_split_beats_interleaved_by_more_than_the_unsplit_bound_at_n_equal_d():
    # Unsplit, 34.5 / 30 = 1.15 is the most any order on BitPipe's placement reaches at D = N = 8.
    interleaved = simulate(generate("interleaved", 8, 8)).makespan
    assert interleaved / simulate(generate("bitpipe", 8, 8)).makespan == pytest.approx(1.15)
    assert interleaved / simulate(generate("bitpipe", 8, 8, split_backward=True)).makespan > 1.3


def test_simulator_costs_and_memory_of_a_split_backward():
    plan = two_rank_plan("F0.0 F0.1 I0.0 I0.1 W0.0 W0.1 S0", "F0.0 I0.0 F0.1 I0.1 W0.0 W0.1 S0")
    validate_plan(plan)
    result = simulate(plan, CostModel(t_forward=2, t_backward=3, t_weight=1))
    starts = {(e.rank, str(e.action)): (e.start, e.end) for e in result.events}
    assert starts[(1, "I0.0")] == (4, 6)  # I costs t_B - t_W
    assert starts[(0, "I0.0")] == (6, 8)  # waits for rank 1's input gradient
    assert starts[(1, "W0.0")] == (10, 11)  # W costs t_W, needs nothing from other ranks
    assert starts[(1, "W0.1")] == (11, 12)
    assert starts[(0, "W0.1")] == (13, 14)
    assert result.peak_activations == [2, 2]  # counted until W, not I
    half = simulate(plan, CostModel(t_forward=2, t_backward=3))
    assert {e.end - e.start for e in half.events if e.action.type is W} == {1.5}


@pytest.mark.parametrize(
    "rank0,message",
    [
        ("F0.0 F0.1 B0.0 I0.0 W0.0 I0.1 W0.1 S0", "B0.0 and a split backward"),
        ("F0.0 F0.1 W0.0 I0.0 I0.1 W0.1 S0", "W0.0 at position 2 runs before I0.0"),
        ("F0.0 F0.1 I0.0 I0.1 W0.1 S0", "missing W0.0"),
        ("F0.0 F0.1 I0.0 I0.1 W0.0 S0 W0.1", "S0 issued before the chunk's last backward"),
        ("F0.0 F0.1 I0.0 I0.1 W0.1 W0.0 S0", r"W's run in micro-batch order \[1, 0\] but the I's in \[0, 1\]"),
    ],
)
def test_validation_names_a_broken_split(rank0, message):
    plan = two_rank_plan(rank0, "F0.0 I0.0 W0.0 F0.1 I0.1 W0.1 S0")
    with pytest.raises(PlanError, match=message):
        validate_plan(plan)


def test_activation_limit_and_cost_ratios_shape_the_placement():
    plan = generate("1f1b", 4, 8)
    own_peaks = simulate(plan).peak_activations  # [4, 3, 2, 1]: the forward order is kept
    for limit in (3, 2):
        tight = split_backward(plan, activation_limit=limit)
        validate_plan(tight)
        assert all(p <= max(limit, own) for p, own in zip(simulate(tight).peak_activations, own_peaks))
    assert max(simulate(split_backward(plan, activation_limit=100)).peak_activations) == 8  # W's all deferred
    # all weight gradient (t_weight = t_backward): W's still land in the bubbles
    heavy = CostModel(t_forward=1, t_backward=2, t_weight=2)
    assert simulate(split_backward(plan, heavy), heavy).makespan <= simulate(plan, heavy).makespan
    with pytest.raises(PlanError, match="no whole backward"):
        split_backward(generate("bitpipe", 4, 4, forward_only=True))
    assert not generate("bitpipe", 4, 4, forward_only=True, split_backward=True).split_backward


def test_cost_model_rejects_a_weight_part_larger_than_the_backward():
    with pytest.raises(ValueError, match="t_weight"):
        CostModel(t_backward=2, t_weight=3)


@pytest.mark.multirank
def test_cli_split_backward(tmp_path):
    run = [sys.executable, "-m", "megatron_bitpipe.schedules"]
    out = subprocess.run(
        run + ["simulate", "--schedule", "bitpipe", "-D", "4", "-N", "8", "--split-backward", "--t-weight", "0.5",
               "--json", "--trace", str(tmp_path / "t.json")],
        capture_output=True, text=True, check=True,
    )
    summary = json.loads(out.stdout)
    assert summary["schedule"] == "bitpipe+split-backward" and summary["costs"]["t_weight"] == 0.5 and summary["valid"]
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("cat") == "backward_weight" for e in trace["traceEvents"])
    bad = subprocess.run(run + ["simulate", "--schedule", "bitpipe", "-D", "4", "-N", "4", "--t-weight", "3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--t-weight" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    listing = subprocess.run(run + ["plan", "--schedule", "1f1b", "-D", "2", "-N", "2", "--split-backward"],
                             capture_output=True, text=True, check=True).stdout
    assert "I0.0" in listing and "W0.0" in listing and "B0.0" not in listing
