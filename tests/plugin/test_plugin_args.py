"""Registration with megatron-core and the command-line flags' rules."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

import megatron_bitpipe
from megatron_bitpipe.megatron_args import BitPipeConfigError


def parse(*argv, **fields):
    args = megatron_bitpipe.add_bitpipe_args(argparse.ArgumentParser()).parse_args(list(argv))
    defaults = dict(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=4, num_layers=8,
        micro_batch_size=1, global_batch_size=8, virtual_pipeline_model_parallel_size=None,
        hidden_size=32, num_attention_heads=4,
    )
    defaults.update(fields)
    for key, value in defaults.items():
        setattr(args, key, value)
    return args


def test_valid_bitpipe_configuration():
    megatron_bitpipe.validate_bitpipe_args(parse("--pipeline-schedule", "bitpipe"))


@pytest.mark.parametrize(
    "fields,flag",
    [
        (dict(pipeline_model_parallel_size=3, world_size=3, num_layers=6), "--pipeline-model-parallel-size must be even"),
        (dict(num_layers=12), "--num-layers 12 must be divisible by 2 x --pipeline-model-parallel-size = 8"),
        (dict(global_batch_size=5), "even number of micro-batches"),
        (dict(global_batch_size=2), "at least --pipeline-model-parallel-size=4 micro-batches"),
        (dict(global_batch_size=9, micro_batch_size=2), "--global-batch-size 9 is not divisible"),
        (dict(virtual_pipeline_model_parallel_size=2), "--virtual-pipeline-model-parallel-size must not be set"),
        (dict(world_size=6), "world size 6 is not divisible"),
    ],
)
def test_bad_bitpipe_configuration_names_the_flag(fields, flag):
    with pytest.raises(BitPipeConfigError, match=flag.replace("(", r"\(").replace("+", r"\+")):
        megatron_bitpipe.validate_bitpipe_args(parse("--pipeline-schedule", "bitpipe", **fields))


def test_every_problem_is_reported_at_once():
    with pytest.raises(BitPipeConfigError) as info:
        megatron_bitpipe.validate_bitpipe_args(
            parse("--pipeline-schedule", "bitpipe", "--tensor-parallel-mode", "optimus2d",
                  num_layers=12, global_batch_size=5, tensor_model_parallel_size=2, world_size=8)
        )
    text = str(info.value)
    assert "--num-layers" in text and "even number of micro-batches" in text and "--tensor-model-parallel-size" in text


def test_interleaved_needs_virtual_size():
    with pytest.raises(BitPipeConfigError, match="--virtual-pipeline-model-parallel-size >= 2"):
        megatron_bitpipe.validate_bitpipe_args(parse("--pipeline-schedule", "interleaved"))


def test_register_installs_and_restores(monkeypatch):
    import megatron.core.pipeline_parallel as core_pp
    from megatron.core.pipeline_parallel import schedules as core_schedules

    from megatron_bitpipe.execution.forward_backward import forward_backward_bitpipe

    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = core_pp.get_forward_backward_func  # imported by name
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    original = core_pp.get_forward_backward_func
    try:
        megatron_bitpipe.register("bitpipe")
        for module in (core_pp, core_schedules, training):
            assert module.get_forward_backward_func() is forward_backward_bitpipe
        megatron_bitpipe.register("default")
        assert core_pp.get_forward_backward_func(pp_size=1) is core_schedules.forward_backward_no_pipelining
    finally:
        megatron_bitpipe.unregister()
    assert core_pp.get_forward_backward_func is original
    assert training.get_forward_backward_func is original
    with pytest.raises(ValueError, match="--pipeline-schedule"):
        megatron_bitpipe.register("gpipe")


def test_register_installs_a_given_bitpipe_function():
    import megatron.core.pipeline_parallel as core_pp

    from megatron_bitpipe.execution.forward_backward import forward_backward_bitpipe

    def variant(**kwargs):
        return []

    try:
        megatron_bitpipe.register("bitpipe", plan_func=variant)
        assert core_pp.get_forward_backward_func() is variant
        megatron_bitpipe.register("bitpipe")
        assert core_pp.get_forward_backward_func() is forward_backward_bitpipe
    finally:
        megatron_bitpipe.unregister()


def test_split_backward_rules():
    megatron_bitpipe.validate_bitpipe_args(parse("--pipeline-schedule", "bitpipe", "--split-backward"))
    # Transformer Engine defers through its own delay_wgrad_compute: accepted
    megatron_bitpipe.validate_bitpipe_args(
        parse("--pipeline-schedule", "bitpipe", "--split-backward", transformer_impl="transformer_engine")
    )
    with pytest.raises(BitPipeConfigError) as info:
        megatron_bitpipe.validate_bitpipe_args(
            parse("--split-backward", "--tensor-parallel-mode", "optimus2d", transformer_impl="transformer_engine",
                  tensor_model_parallel_size=4, world_size=16)
        )
    text = str(info.value)
    assert "--split-backward needs --pipeline-schedule chimera or bitpipe or zb-h1 or zbv or dualpipe or dualpipev (got default)" in text
    assert "--split-backward is not supported with --tensor-parallel-mode optimus2d" in text and "--transformer-impl" not in text
    with pytest.raises(BitPipeConfigError, match=r"--pipeline-schedule zbv \(its backwards are always split\) is not supported with --tensor-parallel-mode optimus2d"):
        megatron_bitpipe.validate_bitpipe_args(
            parse("--pipeline-schedule", "zbv", "--tensor-parallel-mode", "optimus2d", tensor_model_parallel_size=4,
                  micro_batch_size=2, world_size=16)
        )


def test_schedule_costs_reach_the_schedule_choice(tmp_path):
    """``--schedule-costs`` (the calibration file) is what the split places its W's for."""
    from megatron_bitpipe.megatron_args import schedule_choice
    from megatron_bitpipe.schedules import CostModel, ScheduleChoice

    costs = tmp_path / "costs.json"
    costs.write_text('{"t_forward": 3.0, "t_backward": 7.0, "t_weight": 2.0, "t_p2p": 0.1, "num_layers": 32}')
    args = parse("--pipeline-schedule", "bitpipe", "--split-backward", "--schedule-costs", str(costs))
    megatron_bitpipe.validate_bitpipe_args(args)
    expected = ScheduleChoice("bitpipe", True, CostModel(t_forward=3.0, t_backward=7.0, t_weight=2.0, t_p2p=0.1))
    assert schedule_choice(args) == expected
    assert schedule_choice(parse("--pipeline-schedule", "bitpipe")) == ScheduleChoice("bitpipe")
    assert schedule_choice(parse(virtual_pipeline_model_parallel_size=2)) == ScheduleChoice("interleaved", virtual_size=2)


def test_schedule_costs_wait_for_the_all_to_alls_of_moe_layers(tmp_path):
    """With Megatron-LM's MoE flags, a share's F, B and I wait two all-to-alls per MoE layer:
    (EP - 1) / EP x s b K h e bytes over the file's a2a_bandwidth, plus its t_a2a."""
    from megatron_bitpipe.megatron_args import schedule_choice
    from megatron_bitpipe.schedules import CostModel

    costs = tmp_path / "costs.json"
    costs.write_text('{"t_forward": 3.0, "t_backward": 7.0, "t_weight": 2.0, "t_a2a": 0.01, "a2a_bandwidth": 1e6}')
    moe = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=None, moe_layer_freq=[1, 0] * 4,
               moe_shared_expert_intermediate_size=None, moe_expert_capacity_factor=None, expert_model_parallel_size=4,
               seq_length=64, micro_batch_size=2, bf16=True)  # fmt: skip
    args = parse("--pipeline-schedule", "bitpipe", "--split-backward", "--schedule-costs", str(costs), **moe)
    one = 0.01 + 3 / 4 * 64 * 2 * 2 * 32 * 2 / 1e6  # 8 layers, 4 MoE, over 4 ranks: 1 MoE layer per share
    planned = schedule_choice(args).costs
    assert planned == CostModel(t_forward=3.0 + 2 * one, t_backward=7.0 + 2 * one, t_weight=2.0, t_input=5.0 + 2 * one,
                                t_a2a=0.01, a2a_bandwidth=1e6)  # fmt: skip
    dense = schedule_choice(parse("--pipeline-schedule", "bitpipe", "--split-backward", "--schedule-costs", str(costs))).costs
    assert (dense.t_forward, dense.t_backward) == (3.0, 7.0)
    with pytest.raises(BitPipeConfigError, match="--moe-layer-freq: the list holds 3 entries"):
        schedule_choice(parse("--pipeline-schedule", "bitpipe", "--split-backward", "--schedule-costs", str(costs),
                              **{**moe, "moe_layer_freq": [1, 0, 1]}))  # fmt: skip


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "--schedule-costs {path}: "),
        ("not json", "--schedule-costs {path}: "),
        ('{"t_forward": -1}', "--schedule-costs {path}: cost t_forward must be >= 0"),
    ],
)
def test_bad_schedule_cost_file_names_the_flag(tmp_path, content, message):
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BitPipeConfigError, match=message.format(path=path)):
        megatron_bitpipe.validate_bitpipe_args(
            parse("--pipeline-schedule", "bitpipe", "--split-backward", "--schedule-costs", str(path))
        )


def test_schedule_costs_need_a_plan_that_uses_them(tmp_path):
    """``--schedule-costs`` is refused where no plan reads it; ZB-V plans its order for it."""
    with pytest.raises(BitPipeConfigError, match="--schedule-costs: bitpipe plans nothing for costs .* add --split-backward"):
        megatron_bitpipe.validate_bitpipe_args(parse("--pipeline-schedule", "bitpipe", "--schedule-costs", str(tmp_path)))
    costs = tmp_path / "costs.json"
    costs.write_text('{"t_forward": 3.0, "t_backward": 7.0, "t_weight": 2.0}')
    args = parse("--pipeline-schedule", "zbv", "--schedule-costs", str(costs))
    megatron_bitpipe.validate_bitpipe_args(args)
    assert megatron_bitpipe.megatron_args.schedule_choice(args).costs.t_backward == 7.0


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev", "dualpipe", "chimera"])
def test_every_plan_schedule_is_a_pipeline_schedule(schedule):
    """The zero-bubble family, DualPipe and Chimera are --pipeline-schedule values the plan
    executor runs; the two-replica placements whose pipelines end away from their start need
    untied embeddings, said before any communication with the flag to add."""
    from megatron_bitpipe.megatron_args import PIPELINE_SCHEDULES, schedule_choice

    assert schedule in PIPELINE_SCHEDULES and schedule in megatron_bitpipe.megatron_args.PLAN_SCHEDULES
    untied = parse("--pipeline-schedule", schedule, untie_embeddings_and_output_weights=True)
    megatron_bitpipe.validate_bitpipe_args(untied)
    assert schedule_choice(untied).plan_executed
    tied = parse("--pipeline-schedule", schedule)
    if schedule in ("dualpipe", "chimera"):
        with pytest.raises(BitPipeConfigError, match=f"--pipeline-schedule {schedule} puts a pipeline's embedding and "
                           "output layer on different ranks .*: add --untie-embeddings-and-output-weights"):
            megatron_bitpipe.validate_bitpipe_args(tied)
    else:
        megatron_bitpipe.validate_bitpipe_args(tied)


@pytest.mark.parametrize(
    "schedule, pp, global_batch, message",
    [
        ("zb-h1", 4, 3, "zb-h1 needs at least --pipeline-model-parallel-size=4 micro-batches"),
        ("zbv", 4, 3, "zbv needs at least --pipeline-model-parallel-size=4 micro-batches"),
        ("dualpipev", 4, 4, "dualpipev needs at least 2 x --pipeline-model-parallel-size = 8 micro-batches"),
        ("dualpipe", 3, 12, "--pipeline-model-parallel-size must be even and >= 2 for dualpipe (got 3)"),
        ("chimera", 3, 12, "--pipeline-model-parallel-size must be even and >= 2 for chimera (got 3)"),
    ],
)
def test_plan_schedule_rules_name_the_flag(schedule, pp, global_batch, message):
    """Each schedule's rules of the pipeline size and the micro-batches, before any communication,
    with the nearest valid global batch where the micro-batches are too few."""
    args = parse("--pipeline-schedule", schedule, pipeline_model_parallel_size=pp, world_size=pp, num_layers=24,
                 global_batch_size=global_batch, untie_embeddings_and_output_weights=True)
    with pytest.raises(BitPipeConfigError) as info:
        megatron_bitpipe.validate_bitpipe_args(args)
    assert message in str(info.value)
    if "micro-batches" in message:
        smallest = megatron_bitpipe.schedules.ScheduleChoice(schedule).smallest_num_microbatches(pp)
        assert f"the smallest valid --global-batch-size is {smallest}" in str(info.value)
