"""``CostModel.t_input``: the split backward's measured ``I`` beside ``t_weight`` (``W``).

Defaults keep old cost files and flags meaning what they meant (``I = t_backward - W``, ``W``
half of ``t_backward``); with both given, ``I + W`` may differ from ``t_backward`` (one H100:
B = 1.97 F, I = 1.17 F, W = 0.85 F). Every consumer reads it: the simulator's action times,
the ``W`` placement of the split backward, the simulate CLI's flag and ``--costs`` file, the
emulated layers' ``I`` time.
"""

from __future__ import annotations

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
