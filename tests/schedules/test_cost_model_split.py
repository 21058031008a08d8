"""``CostModel.t_input``: the split backward's measured ``I`` beside ``t_weight`` (``W``).

Defaults keep old cost files and flags meaning what they meant (``I = t_backward - W``, ``W``
half of ``t_backward``); with both given, ``I + W`` may differ from ``t_backward`` (one H100:
B = 1.97 F, I = 1.17 F, W = 0.85 F). Every consumer reads it: the simulator's action times,
the ``W`` placement of the split backward, the simulate CLI's flag and ``--costs`` file, the
emulated layers' ``I`` time.

``CostModel.t_forward_deferring`` (``F_d``, the forward while the linears defer): every forward
of a split-backward plan takes it, and a whole ``B`` in such a plan takes I + W (the executor
runs it as ``I`` then ``W``); plans without a split keep ``F`` and ``B``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_bitpipe.schedules import CostModel, generate, simulate
from megatron_bitpipe.schedules.actions import Action, ActionType

H100 = CostModel(t_forward=1.0, t_backward=1.97, t_weight=0.85, t_input=1.17)


def _time(costs: CostModel, kind: ActionType) -> float:
    return costs.compute_time(Action(kind, 0, 0), 1.0)


def test_defaults_are_unchanged_and_either_part_completes_the_other():
    assert (CostModel().input_time, CostModel().weight_time) == (1.0, 1.0)
    assert (CostModel(t_weight=0.5).input_time, CostModel(t_weight=0.5).weight_time) == (1.5, 0.5)
    assert (CostModel(t_input=1.2).input_time, CostModel(t_input=1.2).weight_time) == pytest.approx((1.2, 0.8))
    assert (_time(H100, ActionType.BACKWARD), _time(H100, ActionType.BACKWARD_INPUT),
            _time(H100, ActionType.BACKWARD_WEIGHT)) == (1.97, 1.17, 0.85)


def test_t_input_is_validated():
    with pytest.raises(ValueError, match="t_input"):
        CostModel(t_input=-0.1)
    with pytest.raises(ValueError, match="t_input .* without t_weight"):
        CostModel(t_backward=2.0, t_input=2.5)
    assert CostModel(t_backward=1.0, t_weight=0.5, t_input=1.1).input_time == 1.1  # measured noise: I > B is carried


def test_split_plans_are_timed_and_ordered_with_the_measured_input_pass():
    plan = generate("bitpipe", 8, 16, split_backward=True, costs=H100)
    result = simulate(plan, H100)
    inputs = [e.end - e.start for e in result.events if e.action.type is ActionType.BACKWARD_INPUT]
    weights = [e.end - e.start for e in result.events if e.action.type is ActionType.BACKWARD_WEIGHT]
    assert set(round(t, 9) for t in inputs) == {round(1.17 * plan.placement.stage_weight, 9)}
    assert set(round(t, 9) for t in weights) == {round(0.85 * plan.placement.stage_weight, 9)}
    closest = CostModel(t_forward=1.0, t_backward=1.97, t_weight=0.85)  # I = 1.12: the split looks cheaper
    assert simulate(generate("bitpipe", 8, 16, split_backward=True, costs=closest), closest).makespan < result.makespan


def test_simulate_cli_reads_t_input_from_flag_and_file(tmp_path, capsys):
    from megatron_bitpipe.schedules.cli import main

    base = ["simulate", "--schedule", "zbv", "-D", "4", "-N", "8", "--json"]
    assert main([*base, "--t-backward", "1.97", "--t-weight", "0.85", "--t-input", "1.17"]) == 0
    from_flags = json.loads(capsys.readouterr().out)
    assert from_flags["costs"]["t_input"] == 1.17
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"t_forward": 1.0, "t_backward": 1.97, "t_weight": 0.85, "t_input": 1.17}))
    assert main([*base, "--costs", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == from_flags["makespan"]
    assert main([*base, "--t-backward", "2", "--t-input", "3"]) == 2
    assert "--t-input" in capsys.readouterr().err


def test_emulated_layer_takes_the_input_pass_time():
    from megatron_bitpipe.benchmarking.emulation import emulated_layer_spec

    assert emulated_layer_spec(1.0, 1.97, 0.85, 1.17).params["input_seconds"] == 1.17
    assert emulated_layer_spec(1.0, 2.0, 0.5).params["input_seconds"] == 1.5
    assert emulated_layer_spec(1.0, 2.0, None, 1.2).params["weight_seconds"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        emulated_layer_spec(1.0, 2.0, None, -1.0)


def test_forward_deferring_defaults_to_the_forward_and_is_validated():
    assert CostModel().forward_deferring_time == 1.0 and CostModel(t_forward=2.0).forward_deferring_time == 2.0
    assert CostModel(t_forward_deferring=1.1).forward_deferring_time == 1.1
    with pytest.raises(ValueError, match="t_forward_deferring"):
        CostModel(t_forward_deferring=-1.0)
    assert CostModel().as_split() == CostModel(t_weight=1.0, t_input=1.0)  # the same times as the defaults
    split = CostModel(t_forward=1.0, t_backward=1.97, t_weight=0.85, t_input=1.17, t_forward_deferring=1.05).as_split()
    assert (split.t_forward, split.t_backward, split.input_time, split.weight_time) == (1.05, pytest.approx(2.02), 1.17, 0.85)


def _durations(result, kind: ActionType):
    return {round(e.end - e.start, 9) for e in result.events for part in e.action.parts if part.type is kind}


def test_split_plans_run_forwards_at_f_d_and_whole_backwards_as_i_then_w():
    """Every forward of a split-backward plan is timed at ``t_forward_deferring``; a whole ``B``
    in one (DualPipe's overlapped pairs, on chunks whose linears defer) at I + W; plans without
    a split keep F and B."""
    costs = CostModel(t_forward=1.0, t_backward=1.97, t_weight=0.85, t_input=1.17, t_forward_deferring=1.1)
    split = simulate(generate("bitpipe", 4, 8, split_backward=True, costs=costs), costs)
    weight = split.plan.placement.stage_weight
    assert _durations(split, ActionType.FORWARD) == {round(1.1 * weight, 9)}
    whole = simulate(generate("bitpipe", 4, 8), costs)
    assert _durations(whole, ActionType.FORWARD) == {round(1.0 * weight, 9)}
    assert _durations(whole, ActionType.BACKWARD) == {round(1.97 * weight, 9)}
    dualpipe = simulate(generate("dualpipe", 4, 8, costs=costs), costs)
    assert dualpipe.plan.split_backward and any(a.type is ActionType.BACKWARD for _, act in dualpipe.plan for a in act.parts)
    pairs = [e for e in dualpipe.events if e.action.type is ActionType.OVERLAP_F_B]
    stage = dualpipe.plan.placement.stage_weight
    assert pairs and {round(e.end - e.start, 9) for e in pairs} == {round((1.1 + 1.17 + 0.85) * stage, 9)}
    slower_forward = dataclasses.replace(costs, t_forward_deferring=1.3)
    assert simulate(generate("bitpipe", 4, 8, split_backward=True, costs=costs), slower_forward).makespan > split.makespan


def test_simulate_cli_reads_t_forward_deferring(tmp_path, capsys):
    from megatron_bitpipe.schedules.cli import main

    base = ["simulate", "--schedule", "bitpipe", "--split-backward", "-D", "4", "-N", "8", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--t-forward-deferring", "1.2"]) == 0
    deferring = json.loads(capsys.readouterr().out)
    assert deferring["costs"]["t_forward_deferring"] == 1.2 and deferring["makespan"] > plain["makespan"]
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"t_forward": 1.0, "t_backward": 2.0, "t_forward_deferring": 1.2}))
    assert main([*base, "--costs", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == deferring["makespan"]
