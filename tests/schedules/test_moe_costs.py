"""The simulator's mixture-of-experts layers: parameters, FLOPs, activations and all-to-all bytes
of an MoE layer (model_shape, moe_shape), their times in each stage's F, B, I and W
(stage_costs), the experts' memory per rank (memory), and the MoE flags of simulate and
layout-search. Pure Python."""

from __future__ import annotations

import json

import pytest

from megatron_bitpipe.schedules import CostModel, ScheduleChoice
from megatron_bitpipe.schedules.cli import main
from megatron_bitpipe.schedules.layer_split import StageLayers
from megatron_bitpipe.schedules.memory import TrainingMemory, rank_memory, rank_parameters
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.schedules.moe_shape import MoEShape
from megatron_bitpipe.schedules.stage_costs import StageCosts

SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000, micro_batch_size=2,
             untie_embeddings_and_output_weights=True)  # fmt: skip
TOKENS, H = 32 * 2, 64


def _model(**moe) -> ModelShape:
    return ModelShape(**SMALL, moe=MoEShape(**{"num_experts": 4, **moe}))


def test_one_expert_taking_every_token_is_the_dense_mlp_plus_its_router():
    dense = ModelShape(**SMALL)
    one = _model(num_experts=1, moe_router_topk=1)
    assert one.layer_parameters(moe=True) == dense.layer_parameters() + H  # the router's 1 x h
    assert one.layer_forward_flops(moe=True) == dense.layer_forward_flops() + 2 * TOKENS * H
    assert one.layer_weight_grad_bytes(4, moe=True) == dense.layer_weight_grad_bytes(4) + 4 * TOKENS * (H + 1)


def test_experts_top_k_and_the_shared_expert_scale_parameters_and_flops():
    dense = ModelShape(**SMALL)
    mlp = 2 * H * 4 * H + 4 * H + H  # two linears of 4h with their biases
    assert dense.layer_parameters() - mlp == _model().layer_parameters(moe=True) - 4 * mlp - 4 * H
    # four experts over two expert-parallel ranks: two each
    assert _model(expert_model_parallel_size=2).expert_parameters() == 2 * mlp
    assert _model(moe_shared_expert_intermediate_size=4 * H).layer_parameters(moe=True) == _model().layer_parameters(moe=True) + mlp
    # each token through k experts of width m: 2 (s b k) h m x 2
    top1, top2 = _model(moe_router_topk=1), _model(moe_router_topk=2)
    assert top2.layer_forward_flops(moe=True) - top1.layer_forward_flops(moe=True) == 2 * TOKENS * H * 4 * H * 2
    narrow = _model(moe_ffn_hidden_size=H)
    assert top2.layer_forward_flops(moe=True) - narrow.layer_forward_flops(moe=True) == 2 * 2 * TOKENS * H * 3 * H * 2


def test_all_to_all_bytes_are_the_dispatched_tokens_that_leave_the_rank():
    # s b k h e x (EP - 1) / EP
    assert _model(expert_model_parallel_size=4).all_to_all_bytes(2) == TOKENS * 2 * H * 2 * 3 / 4
    assert _model().all_to_all_bytes(2) == 0  # EP 1: nothing leaves the rank
    assert ModelShape(**SMALL).all_to_all_bytes(2) == 0


def test_a_capacity_factor_below_one_drops_tokens_and_above_one_changes_nothing():
    dropless, half, double = _model(expert_model_parallel_size=2), _model(expert_model_parallel_size=2, moe_expert_capacity_factor=0.5), \
        _model(expert_model_parallel_size=2, moe_expert_capacity_factor=2.0)  # fmt: skip
    assert half.all_to_all_bytes(2) == dropless.all_to_all_bytes(2) / 2
    expert_flops = 2 * TOKENS * 2 * H * 4 * H * 2
    assert dropless.layer_forward_flops(moe=True) - half.layer_forward_flops(moe=True) == expert_flops / 2
    assert double.layer_forward_flops(moe=True) == dropless.layer_forward_flops(moe=True)


def test_expert_activations_are_top_k_mlps_and_the_routers_fp32_probabilities():
    dense, moe = ModelShape(**SMALL), _model(moe_router_topk=2)
    mlp = TOKENS * (2 * 4 * H)  # a dense MLP's first-linear output and second-linear input (its input is counted once)
    experts = 2 * TOKENS * (H + 2 * 4 * H)
    assert moe.layer_activation_bytes(2, moe=True) == dense.layer_activation_bytes(2) - 2 * mlp + 2 * experts + 4 * TOKENS * 4


def test_layer_frequency_int_and_list():
    every_other = ModelShape(**SMALL, moe=MoEShape(4, moe_layer_freq=2))
    assert [every_other.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert every_other.moe_layer_count(1, 3) == 1
    listed = ModelShape(**SMALL, moe=MoEShape(4, moe_layer_freq=(0, 0, 1, 1)))
    assert listed.moe_layer_count(0, 2) == 0 and listed.moe_layer_count(2, 2) == 2
    with pytest.raises(ValueError, match="the list holds 3 entries, one per layer of --num-layers 4"):
        ModelShape(**SMALL, moe=MoEShape(4, moe_layer_freq=(1, 0, 1)))


@pytest.mark.parametrize("moe, message", [
    (dict(num_experts=0), "--num-experts must be >= 1"),
    (dict(moe_router_topk=5), "--moe-router-topk must be in [1, --num-experts 4]"),
    (dict(expert_model_parallel_size=3), "--expert-model-parallel-size 3 must be >= 1 and divide --num-experts 4"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0"),
    (dict(moe_layer_freq=0), "--moe-layer-freq must be >= 1"),
])  # fmt: skip
def test_bad_moe_shapes_name_the_flag(moe, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MoEShape(**{"num_experts": 4, **moe})


def test_stages_pay_the_all_to_all_in_f_b_and_i_but_not_w():
    """Stage 0 holds layers 0 (MoE) and 1 (dense); stage 1 holds layers 2 (MoE) and 3 (dense)."""
    model = ModelShape(**SMALL, moe=MoEShape(4, moe_layer_freq=2, expert_model_parallel_size=2))
    layers, element = StageLayers((2, 2)), 2
    quiet = StageCosts.for_model(model, layers, CostModel(), 2, element).stages
    a2a = CostModel(t_a2a=0.25, a2a_bandwidth=1e4)
    loud = StageCosts.for_model(model, layers, a2a, 2, element).stages
    one = 0.25 + model.all_to_all_bytes(element) / 1e4
    for q, l in zip(quiet, loud):
        assert l.forward - q.forward == pytest.approx(2 * one)  # dispatch + combine
        assert l.backward - q.backward == pytest.approx(2 * one)
        assert l.input - q.input == pytest.approx(2 * one) and l.weight == q.weight
    # compute: the MoE layer costs the dense layer's time times their FLOP ratio
    ratio = model.layer_forward_flops(moe=True) / model.layer_forward_flops()
    assert quiet[0].forward == pytest.approx(0.5 * (1 + ratio))  # t_F = 1 per device share of 2 layers
    # no all-to-all at EP 1, whatever the latency
    ep1 = ModelShape(**SMALL, moe=MoEShape(4, moe_layer_freq=2))
    assert StageCosts.for_model(ep1, layers, a2a, 2, element).stages == StageCosts.for_model(ep1, layers, CostModel(), 2, element).stages


def test_experts_are_held_per_expert_parallel_rank_and_their_state_sharded_over_fewer_ranks():
    model = _model(expert_model_parallel_size=2)  # every layer MoE, 2 of 4 experts per rank
    placement, layers = ScheduleChoice("1f1b").placement(2), StageLayers.even(4, 2)
    params = rank_parameters(model, placement, layers)
    experts = 2 * model.expert_parameters()  # two MoE layers per rank
    assert params[1] == [2 * model.layer_parameters(moe=True) + model.norm_parameters() + model.output_layer_parameters()]
    # distributed optimizer over 4 data-parallel ranks: the experts' Adam state over 4 / EP = 2
    [_, last] = rank_memory(model, placement, layers, TrainingMemory(False, "adam", True, 4), [0.0, 0.0])
    assert last.optimizer_state == pytest.approx(8 * ((params[1][0] - experts) / 4 + experts / 2))
    assert last.parameters == 4 * params[1][0]
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 must divide --data-parallel-size 3"):
        rank_memory(model, placement, layers, TrainingMemory(data_parallel_size=3), [0.0, 0.0])


MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--vocab-size", "1000", "--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
               "--data-parallel-size", "2"]  # fmt: skip
MOE_FLAGS = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-layer-freq", "[1,0,1,0]", "--a2a-bandwidth", "1000"]


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("schedule", ["bitpipe", "dualpipev"])
def test_simulate_and_layout_search_cost_the_experts(capsys, schedule):
    plan = ["--schedule", schedule, "-D", "2", "-N", "4"]
    dense = _json(capsys, "simulate", *plan, *MODEL_FLAGS, "--json")
    moe = _json(capsys, "simulate", *plan, *MODEL_FLAGS, *MOE_FLAGS, "--json")
    assert moe["makespan"] > dense["makespan"]
    assert "moe_layers" not in dense
    # 4 stages of one layer; --moe-layer-freq [1,0,1,0]; fp32: s b k h 4 (EP - 1) / EP bytes, over 1000 bytes per TIME
    assert moe["moe_layers"] == [1, 0, 1, 0]
    assert moe["all_to_all_bytes"] == 32 * 1 * 2 * 64 * 4 / 2 and moe["all_to_all_time"] == pytest.approx(moe["all_to_all_bytes"] / 1000)
    for d, m in zip(dense["memory_bytes"], moe["memory_bytes"]):
        assert m["parameters"] > d["parameters"] and m["activations"] > d["activations"]
    search = _json(capsys, "layout-search", *plan, *MODEL_FLAGS, *MOE_FLAGS, "--json")
    assert search["best"]["peak_memory_bytes"] == max(r["total"] for r in search["best"]["memory_bytes"])
    best = search["best"]
    assert sum(best["moe_layers"]) == 2 and len(best["moe_layers"]) == len(best["stage_layers"])


@pytest.mark.parametrize("extra, message", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size: the MoE flags need --num-experts"),
    (["--num-experts", "8", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size 4 must divide --data-parallel-size 2"),
    (["--num-experts", "8", "--moe-layer-freq", "[1,0]"], "--moe-layer-freq: the list holds 2 entries"),
    (["--num-experts", "8", "--moe-layer-freq", "([1]*3+[0])*2"], "--moe-layer-freq: the list holds 8 entries"),
    (["--num-experts", "8", "--moe-layer-freq", "foo"], "argument --moe-layer-freq: 'foo' is neither an integer nor a list"),
])  # fmt: skip
def test_bad_moe_flags_are_one_line_naming_the_flag(capsys, extra, message):
    assert main(["simulate", "--schedule", "bitpipe", "-D", "2", "-N", "4", *MODEL_FLAGS, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


MIXTRAL = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups", "8",
           "--ffn-hidden-size", "14336", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--seq-length", "4096", "--vocab-size", "32000",
           "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--data-parallel-size", "8", "--num-experts", "8", "--moe-router-topk", "2",
           "--expert-model-parallel-size", "8", "--t-forward", "41.6", "--t-backward", "83.2", "--a2a-bandwidth", "5e7"]  # fmt: skip


@pytest.mark.parametrize("schedule, makespan, largest_gib", [("bitpipe", 4186, 67.4), ("dualpipe", 4235, 74.8), ("dualpipev", 4366, 61.6)])
def test_the_documented_mixtral_example(capsys, schedule, makespan, largest_gib):
    """docs/balanced_stages.md's mixture-of-experts table, 50 GB/s column."""
    step = _json(capsys, "simulate", "--schedule", schedule, "-D", "4", "-N", "16", *MIXTRAL, "--json")
    assert round(step["makespan"]) == makespan
    assert round(max(m["total"] for m in step["memory_bytes"]) / 2**30, 1) == largest_gib
    assert step["all_to_all_bytes"] == 4096 * 2 * 4096 * 2 * 7 / 8 and round(step["all_to_all_time"], 2) == 1.17
