"""Megatron-LM's uneven-layout flags on this package's scripts: their rules (one line naming the
flag, before any communication), the layers per stage they give each placement in pipeline
order, and megatron-core's own reading of them on its looped placement (pure Python, no ranks)."""

from __future__ import annotations

import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.model_partition import chunk_specs
from megatron_bitpipe.run_config import RunConfig
from megatron_bitpipe.schedules import ScheduleChoice
from megatron_bitpipe.schedules.layer_split import LayerSplitFlags, StageLayers, parse_layout, split_layers, split_problems
from megatron_bitpipe.schedules.placement import bidirectional, bidirectional_v, looped, v_shape
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.gpt import GPTTask

BASE = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip


def parse(*extra, world_size=2):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=False)


def test_layout_string_repetitions_and_commas():
    assert parse_layout("E|(tt|)*2,t*3L") == ["E", "tt", "tt", "tttL"]
    assert parse_layout("Et*2|(t|)*2,tL") == ["Ett", "t", "t", "tL"]
    assert parse_layout("E(|t)*2") == ["E", "t", "t"]
    assert parse_layout("E||tL") == ["E", "", "tL"]
    with pytest.raises(ValueError, match="'m' .*multi-token prediction.* not supported"):
        parse_layout("Et|m|L")


#: (placement, flags, --num-layers) -> layers per stage in pipeline order
SPLITS = [
    (v_shape(2), LayerSplitFlags(first=1), 7, (1, 2, 2, 2)),
    (v_shape(2), LayerSplitFlags(first=1, last=3), 8, (1, 2, 2, 3)),
    (v_shape(2), LayerSplitFlags(embedding=True, loss=True), 6, (1, 2, 2, 1)),
    (v_shape(2), LayerSplitFlags(embedding=True), 3, (0, 1, 1, 1)),
    (v_shape(2), LayerSplitFlags(layout="E|tt|ttt|tL"), 6, (0, 2, 3, 1)),
    (bidirectional_v(2), LayerSplitFlags(last=1), 7, (2, 2, 2, 1)),
    (bidirectional(4), LayerSplitFlags(first=3, last=3), 8, (3, 1, 1, 3)),
    (looped(4), LayerSplitFlags(), 8, (2, 2, 2, 2)),
    # megatron's interleaved schedule: first/last count the first/last rank's chunks together
    (looped(2, 2), LayerSplitFlags(first=2), 6, (1, 2, 1, 2)),
    (looped(4, 2), LayerSplitFlags(first=2, last=4), 14, (1, 2, 2, 2, 1, 2, 2, 2)),
    (looped(2, 2), LayerSplitFlags(loss=True), 7, (2, 2, 2, 1)),
]


@pytest.mark.parametrize("placement,flags,layers,counts", SPLITS)
def test_flags_split_the_stages_in_pipeline_order(placement, flags, layers, counts):
    split = split_layers(flags, placement, layers)
    assert split.counts == counts and split.num_layers == layers


def test_v_puts_its_first_and_last_stage_on_rank_zero_and_replicas_share_the_split():
    split = StageLayers((1, 2, 2, 3))
    rank0 = chunk_specs(v_shape(2), split, 0)
    assert [(s.stage, s.first_layer, s.num_layers, s.pre_process, s.post_process) for s in rank0] == [
        (0, 0, 1, True, False),
        (3, 5, 3, False, True),
    ]
    specs = [spec for rank in range(2) for spec in chunk_specs(bidirectional_v(2), split, rank)]
    for pipeline in range(2):
        mine = sorted((s.stage, s.first_layer, s.num_layers) for s in specs if s.pipeline == pipeline)
        assert mine == [(0, 0, 1), (1, 1, 2), (2, 3, 2), (3, 5, 3)]
    with pytest.raises(ValueError, match="layers of 3 stages"):
        chunk_specs(v_shape(2), StageLayers((1, 2, 3)), 0)


def _megatron_counts(pp, vp, layers, **uneven):
    """Layers per stage (vp stage x pp rank, megatron's pipeline order) as megatron-core builds them."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, pipeline_dtype=torch.float32, **uneven,
    )  # fmt: skip
    stages = [(v, r) for v in range(vp or 1) for r in range(pp)]
    counts = [get_num_layers_to_build(config, vp_stage=v if vp else None, pp_rank=r) for v, r in stages]
    offsets = [get_transformer_layer_offset(config, vp_stage=v if vp else None, pp_rank=r) for v, r in stages]
    return tuple(counts), tuple(offsets)


MEGATRON = [
    (4, None, 10, dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)),
    (4, 2, 16, dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=6)),
    (2, 2, 6, dict(num_layers_in_first_pipeline_stage=2)),
    (4, None, 6, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (4, 2, 14, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (4, None, 3, dict(account_for_embedding_in_pipeline_split=True)),
]


@pytest.mark.parametrize("pp,vp,layers,uneven", MEGATRON)
def test_looped_placement_splits_as_megatron_core_does(pp, vp, layers, uneven):
    flags = LayerSplitFlags(
        first=uneven.get("num_layers_in_first_pipeline_stage"),
        last=uneven.get("num_layers_in_last_pipeline_stage"),
        embedding=uneven.get("account_for_embedding_in_pipeline_split", False),
        loss=uneven.get("account_for_loss_in_pipeline_split", False),
    )
    split = split_layers(flags, looped(pp, vp or 1), layers)
    counts, offsets = _megatron_counts(pp, vp, layers, **uneven)
    assert split.counts == counts
    assert tuple(split.first_layer(s) for s in range(split.num_stages)) == offsets


def test_layout_reads_as_megatron_core_reads_it():
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    text, pp = "Et|(tt|)*2,t|ttt|tt|t,tt|tL", 4
    table = PipelineParallelLayerLayout(text, pp).layout  # [pp rank][vp stage]
    megatron = tuple(table[s % pp][s // pp].count(LayerType.decoder) for s in range(2 * pp))
    assert split_layers(LayerSplitFlags(layout=text), looped(pp, 2), 15).counts == megatron


#: extra flags -> world size, the one line naming the flag and the rule
BAD = [
    (["--decoder-first-pipeline-num-layers", "0"], "--decoder-first-pipeline-num-layers must be >= 1 (got 0)"),
    (["--decoder-first-pipeline-num-layers", "3"], "--decoder-first-pipeline-num-layers 3 = 3 must be less than --num-layers 8, leaving a multiple of 3 layers for the 3 middle stages"),
    (["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "5"], "= 7 must be less than --num-layers 8, leaving a multiple of 2"),
    (["--decoder-last-pipeline-num-layers", "2", "--account-for-embedding-in-pipeline-split"], "--decoder-last-pipeline-num-layers cannot be combined with --account-for-embedding-in-pipeline-split"),
    (["--account-for-embedding-in-pipeline-split"], "--num-layers 8 + 1 (--account-for-embedding-in-pipeline-split) = 9 must be divisible by the stages"),
    (["--pipeline-model-parallel-layout", "Ett|tt|tt|ttL", "--account-for-loss-in-pipeline-split"], "--pipeline-model-parallel-layout gives every stage's layers: it cannot be combined with --account-for-loss-in-pipeline-split"),
    (["--pipeline-model-parallel-layout", "Ett|tt|ttttL"], "--pipeline-model-parallel-layout has 3 stages, but the v placement runs 2 x --pipeline-model-parallel-size = 4 stages"),
    (["--pipeline-model-parallel-layout", "Ett|tt|tt|tL"], "--pipeline-model-parallel-layout holds 7 transformer layers (t), --num-layers 8"),
    (["--pipeline-model-parallel-layout", "tt|Ett|tt|ttL"], "E (the embedding) must open the first stage, once"),
    (["--pipeline-model-parallel-layout", "Ett|ttL|tt|tt"], "L (the loss) must close the last stage, once"),
    (["--pipeline-model-parallel-layout", "Ett|tx|tt|ttL"], "unknown characters 'x'"),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_bad_split_is_one_line_naming_the_flag(extra, message):
    with pytest.raises(BitPipeConfigError) as error:
        parse("--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "2", *extra)
    lines = str(error.value).splitlines()[1:]
    assert len(lines) == 1 and message in lines[0], str(error.value)


def test_interleaved_first_rank_layers_divide_into_its_chunks():
    with pytest.raises(BitPipeConfigError, match="--decoder-first-pipeline-num-layers 3 must be divisible by --virtual-pipeline-model-parallel-size 2"):
        parse("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3", "--global-batch-size", "8")


def test_uneven_flags_lift_the_equal_stage_rule_and_reach_run_config():
    args = parse("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--num-layers", "6", "--decoder-first-pipeline-num-layers", "3")
    assert RunConfig.from_args(args).stage_layers == StageLayers((3, 1, 1, 1))
    even = RunConfig.from_args(parse("--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "2"))
    assert even.stage_layers == StageLayers((2, 2, 2, 2))
    one_f_one_b = parse("--pipeline-model-parallel-size", "2", "--num-layers", "6", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
    assert RunConfig.from_args(one_f_one_b).stage_layers == StageLayers((3, 3))


def test_recompute_rules_hold_for_every_chunk_size():
    with pytest.raises(BitPipeConfigError, match="--recompute-num-layers 2 must be between 1 and the 1 layers of a model chunk"):
        parse(
            "--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
            "--decoder-last-pipeline-num-layers", "2", "--num-layers", "6", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "2",
        )  # fmt: skip


def test_split_problems_without_flags_is_the_equal_stage_rule():
    placement = ScheduleChoice("bitpipe").placement(4)
    assert split_problems(LayerSplitFlags(), placement, 12) == [placement.layer_problem(12)] != [None]
    assert split_problems(LayerSplitFlags(), placement, 16) == []


def _megatron_lm_fields(**fields):
    unset = dict(decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None, pipeline_model_parallel_layout=None,
                 account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
    return {**unset, **fields}


def test_megatron_lm_route_holds_the_flags_for_plan_schedules():
    """A plan schedule splits over its own stages: the flags leave Megatron-LM's fields (its rules
    count pipeline ranks, its TransformerConfig would split again) for the held copy the checks
    and the RunConfig read, as plain values (Megatron-LM pickles its namespace into checkpoints)."""
    from ..megatron_lm.test_megatron_lm_errors import megatron_lm_args
    from megatron_bitpipe.megatron_lm.args import hold_layer_split, release_layer_split, validate_megatron_lm_args
    from megatron_bitpipe.schedules.layer_split import HELD_ATTRIBUTE

    args = megatron_lm_args("--pipeline-schedule", "zbv", **_megatron_lm_fields(pipeline_model_parallel_layout="E|tt|t|t|t|t|t|tL"))
    hold_layer_split(args)
    assert args.pipeline_model_parallel_layout is None and args.decoder_first_pipeline_num_layers is None  # 8 layers divide pp 4
    held = getattr(args, HELD_ATTRIBUTE)
    assert all(isinstance(value, (bool, int, str, type(None))) for value in held.values())
    assert LayerSplitFlags.from_args(args) == LayerSplitFlags(layout="E|tt|t|t|t|t|t|tL")
    release_layer_split(args)
    validate_megatron_lm_args(args)


def test_megatron_lm_route_lends_megatron_a_first_stage_count_where_its_equal_split_check_would_fail():
    from ..megatron_lm.test_megatron_lm_errors import megatron_lm_args
    from megatron_bitpipe.megatron_lm.args import hold_layer_split, release_layer_split, validate_megatron_lm_args

    args = megatron_lm_args("--pipeline-schedule", "bitpipe", **_megatron_lm_fields(account_for_embedding_in_pipeline_split=True),
                            num_layers=7, pipeline_model_parallel_size=2, world_size=2)
    hold_layer_split(args)
    assert not args.account_for_embedding_in_pipeline_split and args.decoder_first_pipeline_num_layers == 1  # stages 1,2,2,2
    release_layer_split(args)
    assert args.decoder_first_pipeline_num_layers is None
    validate_megatron_lm_args(args)


def test_megatron_lm_route_refuses_a_bad_split_before_megatron_lm_checks_it():
    from ..megatron_lm.test_megatron_lm_errors import megatron_lm_args
    from megatron_bitpipe.megatron_lm.args import hold_layer_split

    args = megatron_lm_args("--pipeline-schedule", "zbv", **_megatron_lm_fields(pipeline_model_parallel_layout="E|tt|ttt|tttL"))
    with pytest.raises(BitPipeConfigError) as error:
        hold_layer_split(args)
    assert "--pipeline-model-parallel-layout has 4 stages, but the" in str(error.value)


def test_megatron_lm_route_leaves_the_flags_to_megatron_with_its_own_schedules():
    from ..megatron_lm.test_megatron_lm_errors import megatron_lm_args
    from megatron_bitpipe.megatron_lm.args import hold_layer_split
    from megatron_bitpipe.schedules.layer_split import HELD_ATTRIBUTE

    args = megatron_lm_args(**_megatron_lm_fields(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1))
    hold_layer_split(args)
    assert args.decoder_first_pipeline_num_layers == 1 and not hasattr(args, HELD_ATTRIBUTE)

