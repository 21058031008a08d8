"""The mixture-of-experts flags of scripts/pretrain_gpt.py: Megatron-LM's names and defaults,
the run's decisions, the model kind they choose and the refusals (pure Python, no ranks)."""

from __future__ import annotations

import argparse

import pytest

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.moe_settings import add_moe_args, parse_moe_layer_freq
from megatron_bitpipe.run_config import RunConfig
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.bert import BertTask
from megatron_bitpipe.training.gpt import GPTTask
from megatron_bitpipe.training.model_registry import model_kind_for
from megatron_bitpipe.usage import UsageError

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip
MOE = ["--num-experts", "4", "--disable-bias-linear"]
BITPIPE_PP2 = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]


def parse(*extra, world_size=4):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=False)


def test_defaults_are_megatron_lms():
    """Megatron-LM core_v0.16.1's defaults (its TransformerConfig-derived flags and _add_moe_args)."""
    parser = argparse.ArgumentParser()
    add_moe_args(parser)
    defaults = vars(parser.parse_args([]))
    assert defaults == dict(
        num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_layer_freq=1,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None, moe_shared_expert_intermediate_size=None, moe_expert_capacity_factor=None,
        expert_model_parallel_size=1, expert_tensor_parallel_size=None,
    )  # fmt: skip
    assert RunConfig.from_args(parse()).moe is None


def test_decisions_of_an_moe_run():
    run = RunConfig.from_args(parse(*MOE, *BITPIPE_PP2, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"))
    assert run.layout.expert == 2 and run.layout.data == 2
    moe = run.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size, moe.dispatcher, moe.expert_tensor_parallel) == (4, 2, 128, "alltoall", 1)
    assert moe.dropless and moe.logged_losses == ("load_balancing_loss",)
    fields = moe.transformer_fields()
    assert fields["num_moe_experts"] == 4 and fields["expert_model_parallel_size"] == 2 and fields["moe_expert_capacity_factor"] is None
    assert model_kind_for("gpt", run).name == "moe-gpt"
    assert model_kind_for("gpt", RunConfig.from_args(parse())).name == "gpt"


def test_lists_follow_megatron_lm():
    """One value of an ``nargs='+'`` flag is that value; several stay a list, one per loss."""
    args = parse(*MOE, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2", "1e-3",
                 "--moe-z-loss-coeff", "1e-3", world_size=1)  # fmt: skip
    moe = RunConfig.from_args(args).moe
    assert moe.load_balancing_type == ("aux_loss", "seq_aux_loss") and moe.aux_loss_coeff == (1e-2, 1e-3)
    assert moe.logged_losses == ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
    assert moe.transformer_fields()["moe_aux_loss_coeff"] == [1e-2, 1e-3]


def test_layer_frequency():
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("([1]*1+[0]*1)*2") == [1, 0, 1, 0]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_moe_layer_freq("__import__('os')")
    with pytest.raises(UsageError):
        parse(*MOE, "--moe-layer-freq", "[2]", world_size=1)
    moe = RunConfig.from_args(parse(*MOE, "--moe-layer-freq", "[1,0,1,0]", world_size=1)).moe
    assert moe.layer_freq == (1, 0, 1, 0) and moe.num_moe_layers(4) == 2
    assert RunConfig.from_args(parse(*MOE, "--moe-layer-freq", "3", world_size=1)).moe.num_moe_layers(4) == 2


BAD = [
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs --num-experts"),
    ([*MOE, "--expert-model-parallel-size", "3"], 3, "--num-experts 4 must be a multiple of --expert-model-parallel-size 3"),
    ([*MOE, *BITPIPE_PP2, "--expert-model-parallel-size", "4"], 4, "--expert-model-parallel-size 4 must divide the data-parallel size 2"),
    ([*MOE, "--expert-tensor-parallel-size", "2"], 1, "--expert-tensor-parallel-size 2 must equal --tensor-model-parallel-size 1"),
    ([*MOE, "--moe-router-topk", "5"], 1, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    ([*MOE, "--moe-token-dispatcher-type", "flex"], 1, "--moe-token-dispatcher-type flex needs DeepEP"),
    ([*MOE, "--moe-router-load-balancing-type", "global_aux_loss"], 1, "global_aux_loss is not supported"),
    ([*MOE, "--moe-expert-capacity-factor", "1.0", "--moe-router-load-balancing-type", "sinkhorn"], 1, "--moe-expert-capacity-factor works with"),
    ([*MOE, "--tensor-parallel-mode", "optimus2d", "--tensor-model-parallel-size", "4"], 4, "--num-experts needs --tensor-parallel-mode 1d"),
    ([*MOE, "--hfta-models", "2"], 1, "--num-experts cannot be combined with --hfta-models"),
    ([*MOE, "--data-parallel-mode", "abs-sgd"], 2, "--num-experts trains with --data-parallel-mode sync"),
    ([*MOE, "--transformer-impl", "transformer_engine"], 1, "drop --transformer-impl transformer_engine"),
    (["--num-experts", "4"], 1, "--num-experts needs --disable-bias-linear"),  # the experts' in-place bias add
]


@pytest.mark.parametrize("flags, world_size, message", BAD, ids=[m for _, _, m in BAD])
def test_refused_with_one_line_naming_the_flag(flags, world_size, message):
    with pytest.raises(BitPipeConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(*flags, world_size=world_size)


def test_bert_has_no_experts():
    with pytest.raises(UsageError, match="--num-experts"):
        parse_args(BertTask(), [*BASE, *MOE], world_size=1, cuda_available=False)
