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
    assert "--split-backward needs --pipeline-schedule bitpipe (got default)" in text
    assert "--tensor-parallel-mode optimus2d" in text and "--transformer-impl" not in text


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


def test_schedule_costs_need_the_split(tmp_path):
    with pytest.raises(BitPipeConfigError, match="--schedule-costs places the weight-gradient steps of --split-backward"):
        megatron_bitpipe.validate_bitpipe_args(parse("--pipeline-schedule", "bitpipe", "--schedule-costs", str(tmp_path)))
