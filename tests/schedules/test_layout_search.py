"""The layout search: the flags it prints select the split it found, it beats equal stages where
the head weighs on the last stage, it keeps within the memory budget, and its command line.
Pure Python."""

from __future__ import annotations

import json

import pytest

from megatron_bitpipe.schedules import CostModel, ScheduleChoice
from megatron_bitpipe.schedules.cli import main
from megatron_bitpipe.schedules.layer_split import LayerSplitFlags, StageLayers, split_layers
from megatron_bitpipe.schedules.layout_search import candidate_splits, layout_flags, search_layouts
from megatron_bitpipe.schedules.memory import TrainingMemory
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.schedules.model_step import simulate_model

#: a large vocabulary: the head costs about 2.3 layers' time and the embedding and head 1 GiB of weights
BIG_VOCAB = ModelShape(num_layers=16, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=131072,
                       untie_embeddings_and_output_weights=True)  # fmt: skip
TRAINING = TrainingMemory(bf16=True)


def _parsed(flags, placement, num_layers):
    """The split Megatron-LM's flags (as printed) select."""
    values = dict(zip(flags[::2], flags[1::2]))
    switches = set(flags)
    split = LayerSplitFlags(
        first=int(values["--decoder-first-pipeline-num-layers"]) if "--decoder-first-pipeline-num-layers" in values else None,
        last=int(values["--decoder-last-pipeline-num-layers"]) if "--decoder-last-pipeline-num-layers" in values else None,
        embedding="--account-for-embedding-in-pipeline-split" in switches,
        loss="--account-for-loss-in-pipeline-split" in switches,
        layout=values.get("--pipeline-model-parallel-layout"),
    )
    return split_layers(split, placement, num_layers)


@pytest.mark.parametrize("schedule, counts, flags", [
    ("zbv", (2, 2, 2, 2), ()),
    ("zbv", (1, 2, 2, 2), ("--account-for-embedding-in-pipeline-split",)),
    ("zbv", (2, 2, 2, 1), ("--account-for-loss-in-pipeline-split",)),
    ("bitpipe", (3, 2, 2, 1), ("--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1")),
    ("zbv", (0, 3, 4, 1), ("--pipeline-model-parallel-layout", "E|t*3|t*4|tL")),
])  # fmt: skip
def test_layout_flags_select_the_split(schedule, counts, flags):
    placement = ScheduleChoice(schedule).placement(2)
    layers = StageLayers(counts)
    assert layout_flags(layers, placement) == flags
    assert _parsed(flags, placement, layers.num_layers) == layers


def test_every_candidate_prints_flags_that_select_it():
    placement = ScheduleChoice("bitpipe").placement(2)
    candidates = candidate_splits(BIG_VOCAB, placement, CostModel(), 2)
    assert len({c.counts for c in candidates}) == len(candidates) > 10
    for layers in candidates:
        assert layers.num_layers == 16 and layers.num_stages == 4
        assert _parsed(layout_flags(layers, placement), placement, 16) == layers


@pytest.mark.parametrize("schedule", ["bitpipe", "zbv", "1f1b"])
def test_search_beats_equal_stages_when_the_head_is_heavy(schedule):
    plan = ScheduleChoice(schedule).plan(4, 8)
    search = search_layouts(plan, CostModel(), BIG_VOCAB, TRAINING)
    assert search.even is not None and search.even.step.stage_layers == StageLayers.even(16, plan.placement.num_stages)
    assert search.best.step.makespan < search.even.step.makespan
    again = simulate_model(plan, CostModel(), BIG_VOCAB, TRAINING, search.best.step.stage_layers)
    assert again.makespan == search.best.step.makespan
    assert search.tried >= 10


def test_search_keeps_within_the_memory_budget():
    plan = ScheduleChoice("zbv").plan(4, 8)
    unlimited = search_layouts(plan, CostModel(), BIG_VOCAB, TRAINING)
    budget = 0.98 * unlimited.best.step.peak_memory  # the fastest no longer fits
    limited = search_layouts(plan, CostModel(), BIG_VOCAB, TRAINING, budget)
    assert limited.best.step.peak_memory <= budget and limited.best.fits
    assert limited.best.step.makespan >= unlimited.best.step.makespan
    assert search_layouts(plan, CostModel(), BIG_VOCAB, TRAINING, 1.0).best is None


MODEL = ["--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
         "--vocab-size", "131072", "--untie-embeddings-and-output-weights", "--bf16"]  # fmt: skip


def test_layout_search_command(capsys):
    assert main(["layout-search", "--schedule", "zbv", "-D", "4", "-N", "8", *MODEL, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["even"]["stage_layers"] == [2] * 8 and found["best"]["makespan"] < found["even"]["makespan"]
    assert len(found["best"]["memory_bytes"]) == 4 and found["best"]["flags"]
    assert main(["layout-search", "--schedule", "zbv", "-D", "4", "-N", "8", *MODEL]) == 0
    text = capsys.readouterr().out
    assert "equal stages: layers per stage 2,2,2,2,2,2,2,2" in text and "fastest within the budget" in text
    assert main(["layout-search", "--schedule", "zbv", "-D", "4", "-N", "8", *MODEL, "--max-memory", "1"]) == 1
    assert "no split fits the budget" in capsys.readouterr().out
    assert main(["layout-search", "--schedule", "zbv", "-D", "4", "-N", "8"]) == 2
    assert "layout-search needs the model" in capsys.readouterr().err
    assert main(["layout-search", "--schedule", "zbv", "-D", "4", "-N", "8", *MODEL, "--costs", "/nonexistent/costs.json"]) == 2
    assert "/nonexistent/costs.json" in capsys.readouterr().err
