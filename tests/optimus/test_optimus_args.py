"""--tensor-parallel-mode flag and Optimus 2D validation (no processes, no communication)."""

from __future__ import annotations

import argparse

import pytest

from megatron_bitpipe.optimus.args import add_optimus_args, validate_optimus_args
from megatron_bitpipe.optimus.validation import check_optimus_model_config
from .optimus_support import tiny_config


def _args(*argv, **megatron_args):
    args = add_optimus_args(argparse.ArgumentParser()).parse_args(list(argv))
    defaults = dict(
        tensor_model_parallel_size=4,
        micro_batch_size=4,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=None,
        sequence_parallel=False,
        context_parallel_size=1,
        padded_vocab_size=64,
    )
    defaults.update(megatron_args)
    for name, value in defaults.items():
        setattr(args, name, value)
    return args


def test_default_mode_is_megatron_1d():
    args = _args(tensor_model_parallel_size=3)
    assert args.tensor_parallel_mode == "1d"
    assert validate_optimus_args(args) is None


def test_valid_optimus_args_give_mesh_side():
    assert validate_optimus_args(_args("--tensor-parallel-mode", "optimus2d")) == 2
    assert (
        validate_optimus_args(
            _args(
                "--tensor-parallel-mode",
                "optimus2d",
                tensor_model_parallel_size=9,
                micro_batch_size=3,
                hidden_size=36,
                num_attention_heads=6,
                padded_vocab_size=81,
            )
        )
        == 3
    )


def test_unknown_mode_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        add_optimus_args(argparse.ArgumentParser()).parse_args(["--tensor-parallel-mode", "2d"])


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(tensor_model_parallel_size=8), "--tensor-model-parallel-size 8"),
        (dict(tensor_model_parallel_size=1), "--tensor-model-parallel-size 1"),
        (dict(micro_batch_size=3), "--micro-batch-size (3)"),
        (dict(hidden_size=15, num_attention_heads=2), "--hidden-size (15)"),
        (dict(num_attention_heads=3, hidden_size=24), "--num-attention-heads (3)"),
        (dict(ffn_hidden_size=31), "--ffn-hidden-size (31)"),
        (dict(padded_vocab_size=66), "padded vocabulary size (66)"),
        (dict(sequence_parallel=True), "--sequence-parallel is not supported"),
        (dict(context_parallel_size=2), "--context-parallel-size > 1 is not supported"),
    ],
)
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError) as error:
        validate_optimus_args(_args("--tensor-parallel-mode", "optimus2d", **overrides))
    assert flag in str(error.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ValueError) as error:
        validate_optimus_args(
            _args("--tensor-parallel-mode", "optimus2d", micro_batch_size=5, ffn_hidden_size=33)
        )
    assert "--micro-batch-size (5)" in str(error.value) and "--ffn-hidden-size (33)" in str(
        error.value
    )


def test_model_config_check():
    config = tiny_config(hidden_size=16, num_attention_heads=4, ffn_hidden_size=64)
    assert check_optimus_model_config(config, 4, vocab_size=32) == 2
    with pytest.raises(ValueError, match="--ffn-hidden-size"):
        check_optimus_model_config(
            tiny_config(hidden_size=16, num_attention_heads=4, ffn_hidden_size=35), 4
        )
    with pytest.raises(ValueError, match="padded vocabulary size"):
        check_optimus_model_config(config, 4, vocab_size=30)
