"""``python -m megatron_bitpipe.schedules recommend``: every training schedule for one D and N,
ranked by the simulator's step time, the refused ones with their rules' messages, and flags
that the training scripts accept."""

from __future__ import annotations

import json

import pytest

from megatron_bitpipe.megatron_args import BitPipeConfigError, validate_bitpipe_args
from megatron_bitpipe.schedules import CostModel, ScheduleChoice, simulate
from megatron_bitpipe.schedules.cli import main
from megatron_bitpipe.schedules.recommend import Budget, recommend, training_flags, training_variants
from megatron_bitpipe.schedules.registry import training_schedules
from ..plugin.test_plugin_args import parse

#: flags of Megatron's own parser that recommend prints: set as namespace fields, not parsed
_MEGATRON_FLAGS = {"--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", None),
                   "--virtual-pipeline-model-parallel-size": ("virtual_pipeline_model_parallel_size", int)}


def training_namespace(flags, **fields):
    """The training scripts' namespace for ``flags`` (the plugin's parsed, Megatron's set)."""
    argv, flags = [], list(flags)
    while flags:
        flag = flags.pop(0)
        if flag in _MEGATRON_FLAGS:
            name, kind = _MEGATRON_FLAGS[flag]
            fields[name] = True if kind is None else kind(flags.pop(0))
        else:
            argv.append(flag)
    return parse(*argv, **fields)


def test_every_training_variant_is_ranked_or_refused():
    labels = [c.label for c in training_variants()]
    assert labels == ["1f1b", "interleaved", "chimera", "chimera+split-backward", "bitpipe", "bitpipe+split-backward",
                      "zb-h1", "zbv", "dualpipe", "dualpipev"]
    assert {c.schedule for c in training_variants()} == set(training_schedules())
    for D, N in ((4, 8), (3, 6), (4, 4), (2, 1)):
        result = recommend(D, N)
        assert sorted([c.choice.label for c in result.candidates] + [r.label for r in result.refused]) == sorted(labels)


@pytest.mark.parametrize("costs", [CostModel(), CostModel(t_p2p=0.1, t_sync=0.5), CostModel(t_weight=0.7, t_p2p=0.3)])
def test_ranking_is_the_simulators_step_time(costs):
    result = recommend(4, 8, costs)
    assert len(result.candidates) == 10  # D=4, N=8: every schedule's rules hold
    for candidate in result.candidates:
        simulated = simulate(candidate.choice.plan(4, 8), costs)
        assert candidate.makespan == simulated.makespan and candidate.bubble_ratio == simulated.bubble_ratio
        assert candidate.peak_activations == max(simulated.peak_activations)
        assert candidate.weight_copies == candidate.choice.weight_replicas(4)
    times = [c.makespan for c in result.candidates]
    assert times == sorted(times) and len(set(times)) > 1


def test_weight_copies_of_the_placements():
    copies = {c.choice.schedule: c.weight_copies for c in recommend(4, 8).candidates}
    assert copies == {"1f1b": 1, "interleaved": 1, "chimera": 2, "bitpipe": 2, "zb-h1": 1, "zbv": 1, "dualpipe": 2, "dualpipev": 1}


def test_refused_schedules_are_listed_with_their_rules():
    odd = {r.label: r.problems for r in recommend(3, 6).refused}
    assert set(odd) == {"chimera", "chimera+split-backward", "bitpipe", "bitpipe+split-backward", "dualpipe"}
    assert all(any("--pipeline-model-parallel-size must be even" in p for p in problems) for problems in odd.values())
    few = {r.label: r.problems for r in recommend(4, 4).refused}
    assert set(few) == {"dualpipe", "dualpipev"}
    assert few["dualpipev"] == ("--num-microbatches = 4: dualpipev needs at least 2 x --pipeline-model-parallel-size = 8 micro-batches",)
    layers = {r.label: r.problems for r in recommend(4, 8, num_layers=4).refused}
    assert "1f1b" not in layers and "zbv" in layers and "--num-layers 4 must be divisible" in layers["zbv"][0]


def test_budget_marks_what_fits_and_the_fastest_that_does():
    free = recommend(4, 8, CostModel(t_p2p=0.1))
    assert all(c.fits for c in free.candidates) and free.best is free.candidates[0]
    budget = Budget(max_activations=4, max_weight_copies=1)
    tight = recommend(4, 8, CostModel(t_p2p=0.1), budget)
    for candidate in tight.candidates:
        assert candidate.fits == (candidate.peak_activations <= 4 and candidate.weight_copies == 1)
    assert tight.best is next(c for c in tight.candidates if c.fits) and tight.best.weight_copies == 1
    assert not all(c.fits for c in tight.candidates)
    assert recommend(4, 8, budget=Budget(max_activations=1)).best is None


@pytest.mark.parametrize("D,N", [(2, 2), (4, 8), (4, 16)])
def test_the_flags_printed_pass_the_training_checks(D, N, tmp_path):
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(json.dumps({"t_forward": 1.0, "t_backward": 2.2, "t_weight": 0.9}))
    result = recommend(D, N, cost_file=str(costs_file), planning_costs=CostModel(t_forward=1.0, t_backward=2.2, t_weight=0.9))
    assert result.candidates
    fields = dict(world_size=D, pipeline_model_parallel_size=D, num_layers=8 * D, global_batch_size=N)
    for candidate in result.candidates:
        validate_bitpipe_args(training_namespace(candidate.flags, **fields))
        if "--untie-embeddings-and-output-weights" in candidate.flags:  # needed, not decoration
            with pytest.raises(BitPipeConfigError, match="--untie-embeddings-and-output-weights"):
                tied = [f for f in candidate.flags if f != "--untie-embeddings-and-output-weights"]
                validate_bitpipe_args(training_namespace(tied, **fields))
    flags = {c.choice.label: c.flags for c in result.candidates}
    assert flags["zbv"] == ("--pipeline-schedule", "zbv", "--schedule-costs", str(costs_file))
    assert flags["bitpipe+split-backward"][-2:] == ("--schedule-costs", str(costs_file))
    assert "--schedule-costs" not in flags["bitpipe"] + flags["zb-h1"] + flags["1f1b"]
    assert flags["chimera"] == ("--pipeline-schedule", "chimera", "--untie-embeddings-and-output-weights")


def test_cost_planned_plans_are_the_ones_training_runs():
    planning = CostModel(t_weight=0.5)
    result = recommend(4, 8, CostModel(t_p2p=0.2), planning_costs=planning, cost_file="costs.json")
    by_label = {c.choice.label: c.choice for c in result.candidates}
    assert by_label["zbv"].costs == planning and by_label["bitpipe+split-backward"].costs == planning
    assert by_label["bitpipe"].costs is None and by_label["dualpipe"].costs is None
    assert training_flags(ScheduleChoice("zbv"), 4) == ("--pipeline-schedule", "zbv")  # no file: training's defaults


def test_command_line_prints_the_table_and_json(capsys, tmp_path):
    assert main(["recommend", "-D", "4", "-N", "8", "--t-p2p", "0.1", "--max-activations", "4"]) == 0
    text = capsys.readouterr().out
    ranked = recommend(4, 8, CostModel(t_p2p=0.1), Budget(max_activations=4))
    rows = [line.split()[1] for line in text.splitlines()[2:2 + len(ranked.candidates)]]
    assert rows == [c.choice.label for c in ranked.candidates]
    assert f"fastest within the budget: {ranked.best.choice.label}" in text
    assert main(["recommend", "-D", "4", "--global-batch-size", "32", "--micro-batch-size", "2", "--data-parallel-size", "2",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == json.loads(json.dumps(recommend(4, 8, CostModel(data_parallel_size=2)).summary()))
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(json.dumps({"t_forward": 2.0, "t_backward": 4.0}))
    assert main(["recommend", "-D", "4", "-N", "8", "--costs", str(costs_file), "--json"]) == 0
    zbv = next(s for s in json.loads(capsys.readouterr().out)["schedules"] if s["label"] == "zbv")
    assert zbv["flags"] == ["--pipeline-schedule", "zbv", "--schedule-costs", str(costs_file)]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-D", "4", "--global-batch-size", "7", "--data-parallel-size", "2"], "--global-batch-size 7 must be a positive multiple"),
        (["-D", "0", "-N", "8"], "--pipeline-model-parallel-size must be >= 1"),
        (["-D", "4", "-N", "0"], "--num-microbatches must be >= 1"),
        (["-D", "4", "-N", "8", "--t-p2p", "-1"], "--t-p2p"),
        (["-D", "4", "-N", "8", "--max-weight-copies", "3"], "--max-weight-copies"),
        (["-D", "4", "-N", "8", "--global-batch-size", "8"], "--global-batch-size"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, message, capsys):
    assert main(["recommend", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_refusals_name_the_batch_flags_when_n_comes_from_them(capsys):
    assert main(["recommend", "-D", "4", "--global-batch-size", "8", "--data-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "dualpipev: micro-batches per data-parallel rank (--global-batch-size / (--micro-batch-size x --data-parallel-size)) = 4" in text
