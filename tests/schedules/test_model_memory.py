"""The simulator's model: parameters, FLOPs and activation bytes of a GPT (model_shape), each
stage's costs from its layers, embedding and head (stage_costs), memory per rank (memory), and
the simulate command's ``stage_layers`` and ``memory_bytes``. Pure Python."""

from __future__ import annotations

import json

import pytest

from megatron_bitpipe.schedules import CostModel, ScheduleChoice
from megatron_bitpipe.schedules.cli import main
from megatron_bitpipe.schedules.layer_split import StageLayers
from megatron_bitpipe.schedules.memory import TrainingMemory, rank_memory, rank_parameters
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.schedules.model_step import simulate_model
from megatron_bitpipe.schedules.simulate import simulate
from megatron_bitpipe.schedules.stage_costs import StageCosts

#: GPT-2 small (124,439,808 parameters with its unpadded vocabulary of 50257, tied)
GPT2 = ModelShape(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257,
                  make_vocab_size_divisible_by=1)  # fmt: skip
SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000, micro_batch_size=2)


def test_gpt2_small_has_its_published_parameter_count():
    total = GPT2.embedding_parameters() + GPT2.num_layers * GPT2.layer_parameters() + GPT2.norm_parameters()
    assert total == 124_439_808
    assert ModelShape(**{**SMALL, "vocab_size": 1000}).padded_vocab_size == 1024


def test_a_plain_layer_is_the_textbook_layer():
    """A plain GPT layer (biases, LayerNorm, f = 4h unless given): the counts analytic_costs and
    scripts/predict_throughput.py use, written out."""
    for (L, h, a, s, b, f) in ((96, 3072, 32, 1024, 1, None), (4, 64, 8, 32, 2, 256)):
        model = ModelShape(L, h, a, s, micro_batch_size=b, ffn_hidden_size=f)
        f = f or 4 * h
        assert model.layer_forward_flops() == 2 * b * s * h * 3 * h + 4 * b * s * s * h + 2 * b * s * h * h + 4 * b * s * h * f
        assert model.layer_parameters() == (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        assert model.message_bytes(2) == 2 * s * b * h


def test_layer_activations_are_korthikantis_formula_for_unfused_bf16_attention_with_dropout():
    shape = ModelShape(**SMALL, attention_backend="unfused")
    s, b, h, a = 32, 2, 64, 4
    assert shape.layer_activation_bytes(2) == s * b * h * (34 + 5 * a * s / h)
    # flash attention keeps no s x s scores, only the log-sum-exp; no dropout, no masks
    flash = ModelShape(**SMALL, hidden_dropout=0.0, attention_dropout=0.0)
    assert flash.layer_activation_bytes(2) == 2 * 16 * s * b * h + 4 * a * s * b
    assert flash.layer_weight_grad_bytes(4) == 4 * 16 * s * b * h


def test_grouped_query_attention_and_swiglu_shrink_and_widen_the_layer():
    plain = ModelShape(**SMALL)
    gqa = ModelShape(**SMALL, num_query_groups=1)
    swiglu = ModelShape(**SMALL, swiglu=True)
    h, d = 64, 16
    assert plain.layer_parameters() - gqa.layer_parameters() == 2 * h * (h - d) + 2 * (h - d)
    assert swiglu.layer_parameters() - plain.layer_parameters() == h * 4 * h + 4 * h
    with pytest.raises(ValueError, match="--num-query-groups 3 must divide --num-attention-heads 4"):
        ModelShape(**SMALL, num_query_groups=3)


def test_uniform_stage_costs_are_the_cost_models_shares():
    plan = ScheduleChoice("bitpipe").plan(4, 8)
    costs = CostModel(t_forward=1.5, t_backward=2.5, t_sync=0.5)
    assert simulate(plan, costs).makespan == simulate(plan, costs, StageCosts.uniform(costs, plan.placement)).makespan


def test_stages_cost_their_layers_the_embedding_and_the_head():
    model = ModelShape(**SMALL, untie_embeddings_and_output_weights=True)
    costs = CostModel(t_forward=2.0, t_backward=4.0, t_weight=1.5)  # per device share: L/D = 2 layers
    stages = StageCosts.for_model(model, StageLayers((1, 3)), costs, 2, 4).stages
    head = 1.0 * model.head_forward_flops() / model.layer_forward_flops()
    assert (stages[0].forward, stages[0].backward, stages[0].weight) == (1.0, 2.0, 0.75)
    assert stages[1].forward == pytest.approx(3.0 + head) and stages[1].backward == pytest.approx(6.0 + 2 * head)
    assert stages[1].input == pytest.approx(3 * 1.25 + head) and stages[1].weight == pytest.approx(3 * 0.75 + head)
    assert (stages[0].activation_shares, stages[1].activation_shares) == (0.5, 1.5)
    assert stages[1].activation_bytes == 3 * model.layer_activation_bytes(4) + model.head_activation_bytes(4)


def test_two_replica_placements_hold_two_stages_weights_per_rank():
    model = ModelShape(**SMALL, untie_embeddings_and_output_weights=True)
    total = model.embedding_parameters() + 4 * model.layer_parameters() + model.norm_parameters() + model.output_layer_parameters()
    bitpipe = ScheduleChoice("bitpipe").placement(2)  # 4 stages of 1 layer, each on both ranks
    per_rank = [sum(chunks) for chunks in rank_parameters(model, bitpipe, StageLayers.even(4, 4))]
    assert per_rank == [total, total]
    zbv = ScheduleChoice("zbv").placement(2)  # one replica: rank 0 holds stages 0 and 3
    per_rank = [sum(chunks) for chunks in rank_parameters(model, zbv, StageLayers((0, 2, 2, 0)))]
    assert per_rank[0] == model.embedding_parameters() + model.norm_parameters() + model.output_layer_parameters()
    assert sum(per_rank) == total


def test_tied_embeddings_share_a_rank_or_copy_across_ranks():
    tied = ModelShape(**SMALL)
    layers = StageLayers.even(4, 2)
    looped = [sum(c) for c in rank_parameters(tied, ScheduleChoice("1f1b").placement(2), layers)]
    assert looped[1] == 2 * tied.layer_parameters() + tied.norm_parameters() + tied.output_layer_parameters()  # the copy
    v = [sum(c) for c in rank_parameters(tied, ScheduleChoice("zbv").placement(2), StageLayers.even(4, 4))]
    assert v[0] == 2 * tied.layer_parameters() + tied.embedding_parameters() + tied.norm_parameters()  # one Parameter
    with pytest.raises(ValueError, match="--untie-embeddings-and-output-weights"):
        rank_parameters(tied, ScheduleChoice("chimera").placement(2), layers)


def test_optimizer_state_and_its_sharding():
    model = ModelShape(**SMALL, untie_embeddings_and_output_weights=True)
    placement, layers = ScheduleChoice("bitpipe").placement(2), StageLayers.even(4, 4)
    params = sum(rank_parameters(model, placement, layers)[0])
    [fp32] = rank_memory(model, placement, layers, TrainingMemory(), [7.0, 7.0])[:1]
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_state, fp32.activations) == (4 * params, 4 * params, 8 * params, 7.0)
    assert fp32.total == 16 * params + 7.0
    # bf16 + distributed optimizer over 2 replicas x 3 data-parallel ranks: 2 + 4 + (8 + 4) / 6 bytes
    [sharded] = rank_memory(model, placement, layers, TrainingMemory(True, "adam", True, 3), [0.0, 0.0])[:1]
    assert (sharded.parameters, sharded.gradients, sharded.optimizer_state) == (2 * params, 4 * params, 2 * params)


def test_peak_activation_bytes_follow_the_schedule():
    """1F1B on 2 ranks: rank 0 holds 2 micro-batches' forwards before its first backward, rank 1
    one; a split backward (ZB-H1) keeps each I's weight-gradient inputs until its W."""
    model = ModelShape(**SMALL, hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True)
    layers, training = StageLayers((1, 3)), TrainingMemory()
    step = simulate_model(ScheduleChoice("1f1b").plan(2, 4), CostModel(), model, training, layers)
    first = model.layer_activation_bytes(4) + model.embedding_activation_bytes()
    last = 3 * model.layer_activation_bytes(4) + model.head_activation_bytes(4)
    assert step.result.peak_activation_bytes == [2 * first, last]
    assert [m.activations for m in step.memory] == [2 * first, last]
    split = simulate_model(ScheduleChoice("zb-h1").plan(2, 4), CostModel(), model, training, layers)
    kept = 3 * model.layer_weight_grad_bytes(4) + model.head_weight_grad_bytes(4)
    assert last <= split.result.peak_activation_bytes[1] <= last + 3 * kept
    assert split.result.peak_activation_bytes[1] in {last + k * kept for k in range(4)}


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


MODEL_FLAGS = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--vocab-size", "1000", "--untie-embeddings-and-output-weights"]  # fmt: skip


def test_simulate_reports_stage_layers_and_memory_per_rank(capsys):
    uneven = _json(capsys, "simulate", "--schedule", "zbv", "-D", "2", "-N", "4", *MODEL_FLAGS, "--json",
                   "--pipeline-model-parallel-layout", "E|tt|ttt|tL")  # fmt: skip
    assert uneven["stage_layers"] == [0, 2, 3, 1]
    assert len(uneven["memory_bytes"]) == 2
    for rank in uneven["memory_bytes"]:
        assert rank["total"] == pytest.approx(rank["parameters"] + rank["gradients"] + rank["optimizer_state"] + rank["activations"])
    even = _json(capsys, "simulate", "--schedule", "zbv", "-D", "2", "-N", "4", *MODEL_FLAGS[:1], "8", *MODEL_FLAGS[2:], "--json")
    assert even["stage_layers"] == [2, 2, 2, 2]
    plain = _json(capsys, "simulate", "--schedule", "zbv", "-D", "2", "-N", "4", "--json")
    assert "stage_layers" not in plain and "memory_bytes" not in plain
    assert main(["simulate", "--schedule", "bitpipe", "-D", "2", "-N", "4", *MODEL_FLAGS, "--decoder-first-pipeline-num-layers", "3"]) == 0
    assert "memory per rank (GiB)" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--decoder-first-pipeline-num-layers", "0"], "--decoder-first-pipeline-num-layers must be >= 1"),
    (["--pipeline-model-parallel-layout", "E|t|t|L"], "--pipeline-model-parallel-layout holds 2 transformer layers"),
    (["--num-attention-heads", "5"], "--num-attention-heads 5 must divide --hidden-size 64"),
])  # fmt: skip
def test_bad_model_flags_are_one_line_naming_the_flag(capsys, extra, message):
    assert main(["simulate", "--schedule", "zbv", "-D", "2", "-N", "4", *MODEL_FLAGS, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_model_flags_need_num_layers(capsys):
    assert main(["simulate", "--schedule", "zbv", "-D", "2", "-N", "4", "--hidden-size", "64"]) == 2
    assert "--hidden-size: the model's flags need --num-layers" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "zbv", "-D", "2", "-N", "4", *MODEL_FLAGS, "--forward-only"]) == 2
    assert "--forward-only: the model's flags cost a training step" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "zbv", "-D", "2", "-N", "4", "--num-layers", "4"]) == 2
    assert "--num-layers needs --hidden-size, --num-attention-heads, --seq-length, --vocab-size too" in capsys.readouterr().err
