"""Context parallelism in the cost and memory model (hand-computed numbers) and the direction of
the pipeline-against-context-parallel choice (``--weigh-context-parallel``)."""

from dataclasses import replace

import pytest

from megatron_bitpipe.schedules import ScheduleChoice
from megatron_bitpipe.schedules.cli import main
from megatron_bitpipe.schedules.context_layouts import ContextLayout, context_layouts, weigh_layouts
from megatron_bitpipe.schedules.costs import CostModel, Hardware, analytic_costs
from megatron_bitpipe.schedules.layer_split import StageLayers
from megatron_bitpipe.schedules.memory import TrainingMemory
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.schedules.model_step import simulate_model
from megatron_bitpipe.schedules.stage_costs import StageCosts

GIB = 2**30
# s = 16, h = 8, a = 2 (d = 4, g = 2: g d = 8), f = 32, b = 1, fp32
SMALL = dict(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=16, vocab_size=128,
             attention_backend="sdpa", attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip


def test_tokens_pairs_and_exchange_by_hand():
    one, two, four = (ModelShape(**SMALL, context_parallel_size=cp) for cp in (1, 2, 4))
    assert (one.attention_pairs, two.attention_pairs, four.attention_pairs) == (256, 5 * 4 * 4, 9 * 2 * 2)
    assert one.context_exchange_bytes(4) == 0
    assert two.context_exchange_bytes(4) == 2 * (1 / 2) * 16 * 8 * 4  # 2 (CP-1)/CP s b g d e
    assert four.context_exchange_bytes(2) == 2 * (3 / 4) * 16 * 8 * 2
    # QKV 2 t h (h + 2gd) + scores and context 4 b h pairs + projection 2 t h^2 + MLP 2 t h f 2, t = 8 tokens
    assert two.layer_forward_flops() == 2 * 8 * 8 * 24 + 4 * 8 * 80 + 2 * 8 * 64 + 2 * 8 * 8 * 32 * 2
    assert one.layer_forward_flops() == 2 * 16 * 8 * 24 + 4 * 8 * 256 + 2 * 16 * 64 + 2 * 16 * 8 * 32 * 2
    assert two.message_bytes(4) == 8 * 8 * 4 and four.message_bytes(4) == 4 * 8 * 4


def test_activations_per_rank_by_hand():
    # linears t (6h + 2gd + 2f) elements, the fused attention's fp32 log-sum-exp a t, and under CP the
    # other ranks' gathered keys and values 2 g d (s - t)
    for cp in (1, 2, 4):
        t = 16 // cp
        expected = 4 * t * (6 * 8 + 2 * 8 + 2 * 32) + 4 * 2 * t + 4 * 2 * 8 * (16 - t)
        assert ModelShape(**SMALL, context_parallel_size=cp).layer_activation_bytes(4) == expected
    assert ModelShape(**SMALL, context_parallel_size=2).layer_weight_grad_bytes(4) == 4 * 8 * (6 * 8 + 2 * 8 + 2 * 32)


def test_rules():
    with pytest.raises(ValueError, match="--context-parallel-size 3 needs --seq-length 16 divisible by 2 x 3"):
        ModelShape(**SMALL, context_parallel_size=3)
    with pytest.raises(ValueError, match="--context-parallel-size must be >= 1"):
        ModelShape(**SMALL, context_parallel_size=0)
    assert [(l.pipeline, l.context) for l in context_layouts(4)] == [(4, 1), (2, 2), (1, 4)]
    model = ModelShape(**SMALL)
    assert ContextLayout(2, 2).problems(model, ScheduleChoice("bitpipe")) == []
    assert "plan-executed" in ContextLayout(2, 2).problems(model, ScheduleChoice("1f1b"))[0]
    assert "plan-executed" in ContextLayout(1, 4).problems(model, ScheduleChoice("bitpipe"))[0]
    assert ContextLayout(2, 2, data=3).world == 12


def test_exchange_in_f_b_i_not_w():
    model = ModelShape(**SMALL, context_parallel_size=2)
    bandwidth = 64.0  # bytes per time unit
    costs = CostModel(t_cp=0.25, cp_bandwidth=bandwidth)
    exchange = 0.25 + 512 / bandwidth
    base = StageCosts.for_model(replace(model, context_parallel_size=1), StageLayers((1, 1)), costs, 2, 4).stages[0]
    stage = StageCosts.for_model(model, StageLayers((1, 1)), costs, 2, 4).stages[0]
    assert stage.forward == pytest.approx(base.forward + exchange)
    assert stage.backward == pytest.approx(base.backward + exchange)
    assert stage.input == pytest.approx(base.input + exchange)
    assert stage.weight == base.weight


def test_gradient_sync_group_and_sharding_span_cp():
    model = ModelShape(**SMALL, context_parallel_size=2)
    costs = CostModel(grad_bytes=100.0, sync_bandwidth=10.0)
    plan = ScheduleChoice("1f1b").plan(2, 2)
    training = TrainingMemory(distributed_optimizer=True)
    step = simulate_model(plan, costs, model, training, StageLayers((1, 1)))
    flat = simulate_model(plan, costs, replace(model, context_parallel_size=1), training, StageLayers((1, 1)))
    sync = [e.end - e.start for e in step.result.sync_events]
    # one slot per stage x CP 2: ring all-reduce of a group of 2, 2 (g-1)/g x bytes / bandwidth
    assert sync and all(d == pytest.approx(1 * 100 / 10 * step.result.stage_costs.stages[e.rank].sync_weight)
                        for d, e in zip(sync, step.result.sync_events))  # fmt: skip
    assert all(e.end == e.start for e in flat.result.sync_events)  # a group of one: no ring
    assert step.memory[0].optimizer_state == pytest.approx(flat.memory[0].optimizer_state / 2)


def _weighed(seq_length: int):
    model = ModelShape(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=seq_length, vocab_size=32000,
                       attention_backend="sdpa", attention_dropout=0.0)  # fmt: skip
    training = TrainingMemory(bf16=True, distributed_optimizer=True)
    choices = [ScheduleChoice("bitpipe")]
    steps, _ = weigh_layouts(model, Hardware(achieved_tflops=400), 4, 32, training, choices, max_memory=40 * GIB)
    return {(s.layout.pipeline, s.layout.context): s for s in steps}, steps[0]


def test_cp_wins_at_32k_within_memory_not_at_2k():
    long, best_long = _weighed(32768)
    assert (best_long.layout.pipeline, best_long.layout.context) == (2, 2) and best_long.fits
    assert not long[(4, 1)].fits  # deeper PP holds every in-flight micro-batch's whole sequence
    short, best_short = _weighed(2048)
    assert (best_short.layout.pipeline, best_short.layout.context) == (4, 1)
    assert short[(2, 2)].fits and short[(2, 2)].step.makespan > short[(4, 1)].step.makespan
    # activations per rank: PP 2 x CP 2 holds half the tokens of twice the layers per micro-batch
    cp2 = max(m.activations for m in long[(2, 2)].step.memory)
    pp4 = max(m.activations for m in long[(4, 1)].step.memory)
    assert cp2 < 0.6 * pp4


def test_analytic_costs_carry_cp_links():
    model = ModelShape(**SMALL, context_parallel_size=2)
    costs = analytic_costs(model, 2, Hardware(achieved_tflops=1.0, cp_latency_ms=0.5, cp_bandwidth_gbs=2.0))
    assert (costs.t_cp, costs.cp_bandwidth, costs.p2p_bytes) == (0.5, 2e6, 8 * 8 * 2)
    assert costs.context_exchange_time(model.context_exchange_bytes(2)) == pytest.approx(0.5 + 256 / 2e6)


MODEL_FLAGS = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--vocab-size", "32000",
               "--attention-backend", "sdpa", "--attention-dropout", "0", "--bf16", "--use-distributed-optimizer"]  # fmt: skip


def test_recommend_and_layout_search_cli(capsys):
    argv = ["recommend", "-D", "2", "--context-parallel-size", "2", "-N", "8", "--seq-length", "32768", *MODEL_FLAGS,
            "--weigh-context-parallel", "--achieved-tflops", "400", "--max-memory", "40"]  # fmt: skip
    assert main(argv, prog="bitpipe-schedule") == 0
    assert "fastest within the budget: PP 2 x CP 2" in capsys.readouterr().out
    assert main(argv[:-4] + ["--max-memory", "40"], prog="bitpipe-schedule") == 2
    assert "--weigh-context-parallel needs --achieved-tflops" in capsys.readouterr().err
    bad = ["recommend", "-D", "2", "-N", "8", "--context-parallel-size", "3", "--seq-length", "32768", *MODEL_FLAGS,
           "--weigh-context-parallel", "--achieved-tflops", "400"]  # fmt: skip
    assert main(bad, prog="bitpipe-schedule") == 2
    assert "--context-parallel-size 3 needs --seq-length 32768 divisible by 2 x 3" in capsys.readouterr().err
    search = ["layout-search", "--schedule", "bitpipe", "-D", "2", "-N", "8", "--context-parallel-size", "2", "--seq-length", "4096",
              *MODEL_FLAGS, "--weigh-context-parallel", "--achieved-tflops", "400"]  # fmt: skip
    assert main(search, prog="bitpipe-schedule") == 0
    out = capsys.readouterr().out
    assert "PP 2 x CP 2 (--pipeline-model-parallel-size 2 --context-parallel-size 2)" in out and "PP 1 x CP 4" in out
