"""What the pretrain scripts log: Megatron-LM's iteration line, the start-up report, the
summary, ``--log-json`` and the model FLOPs behind TFLOP/s (pure Python, but the FLOP count
of a real megatron-core GPT, which runs on one gloo rank)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from megatron_bitpipe.data_parallel_modes import SYNC
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.optimizers import OptimizerChoice
from megatron_bitpipe.run_config import Batches, Logging, ParallelLayout, Precision, RunConfig, TokenizerSettings
from megatron_bitpipe.schedules import ScheduleChoice
from megatron_bitpipe.training.logs import IterationRecord, TrainingLogger
from megatron_bitpipe.training.report import RankReport, model_flops_per_iteration, model_flops_per_sample

TIMESTAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"


def _logger(tmp_path, rank: int = 0, resumed: bool = False, train_iters: int = 4, log_interval: int = 2, fp16: bool = False):
    """The logger of a BitPipe run (PP 2, global batch 16 as 8 micro-batches, padded vocabulary 128)."""
    run = dataclasses.replace(
        _run(), precision=Precision(fp16=fp16), batches=Batches(2, 16, 8), padded_vocab_size=128,
        logging=Logging(log_interval, str(tmp_path / "log.jsonl")),
    )  # fmt: skip
    return TrainingLogger(run, train_iters, rank=rank, resumed=resumed)


def _record(iteration: int, loss: float, skipped: bool = False, tflops=None, memory=100.0) -> IterationRecord:
    return IterationRecord(
        iteration=iteration, consumed_samples=16 * iteration, elapsed_ms=100.0, tokens_per_second=1000.0, lr=1e-3,
        grad_norm=1.0, loss_scale=1024.0, skipped=skipped, losses={"lm loss": loss}, max_memory_mib=memory,
        tflops_per_device=tflops,
    )  # fmt: skip


def _events(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_iteration_line_has_megatron_lms_fields(tmp_path, capsys):
    logger = _logger(tmp_path, fp16=True)
    logger.record(_record(1, float("nan"), skipped=True, tflops=100.0, memory=300.0))
    logger.record(_record(2, 4.0, tflops=300.0, memory=200.0))
    first, line = capsys.readouterr().out.splitlines()
    assert re.match(rf" {TIMESTAMP} iteration        1/       4 \|", first), first  # a run's first iteration
    assert re.match(rf" {TIMESTAMP} iteration        2/       4 \| consumed samples:           32 \|", line), line
    for field in (
        "| throughput per GPU (TFLOP/s/GPU): 150.0 |",  # two iterations of equal FLOPs at 100 and 300: 150 on average
        "| lm loss: 4.000000E+00 |",  # the skipped iteration is left out of the average
        "| loss scale: 1024.0 |",
        "| number of skipped iterations:   1 |",
        "| number of nan iterations:   1 |",
        "| max memory (MiB): 300.0 |",
    ):
        assert field in line, field
    first, second = _events(tmp_path / "log.jsonl")
    assert first["event"] == "iteration" and first["nan"] is True and second["nan"] is False
    assert second["max_memory_mib"] == 200.0 and second["tflops_per_device"] == 300.0
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", second["timestamp"])


@pytest.mark.parametrize("resumed_at", [0, 10])
def test_a_runs_first_iteration_is_logged_and_the_interval_goes_on(tmp_path, capsys, resumed_at):
    """As Megatron-LM: a line after the first iteration of a run (started or resumed), then
    every ``--log-interval`` iterations, each averaging from the first (the first line does
    not end the interval)."""
    logger = _logger(tmp_path, train_iters=40, log_interval=20, resumed=resumed_at > 0)
    for iteration in range(resumed_at + 1, 41):
        logger.record(_record(iteration, float(iteration)))
    lines = capsys.readouterr().out.splitlines()
    shown = [(int(re.search(r"iteration +(\d+)/", line).group(1)), float(re.search(r"lm loss: (\S+) \|", line).group(1)))
             for line in lines]  # fmt: skip
    first = resumed_at + 1
    if resumed_at == 0:
        assert shown == [(1, 1.0), (20, 10.5), (40, 30.5)]
    else:
        assert shown == [(first, float(first)), (20, (first + 20) / 2), (40, 30.5)]
    early = _logger(tmp_path, train_iters=40, log_interval=20)
    early.record(_record(1, 1.0))
    early.finish_interval()  # a run that stops after its first iteration: its line once
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_without_a_gpu_or_fp16_the_line_leaves_out_tflops_and_loss_scale(tmp_path, capsys):
    logger = _logger(tmp_path, log_interval=1)
    logger.record(_record(1, 4.0))
    line = capsys.readouterr().out
    assert "TFLOP/s" not in line and "loss scale" not in line and "number of nan iterations:   0" in line


def test_startup_report_and_summary(tmp_path, capsys):
    logger = _logger(tmp_path)
    ranks = [RankReport(rank, 0, rank, 0, 1000 + rank, 500.0 + rank, 3 + rank) for rank in range(2)]
    label = _run(split=True, costs="costs.json").label
    logger.startup(ranks, "peak resident set size of the process", 1.5e9, label, stage_layers=(1, 2, 3, 1))
    logger.record(_record(1, 4.0, memory=700.0))
    logger.evaluation("iteration 1 on test set", {"lm loss": 3.5})
    logger.summary(1, 1, total_time_s=12.0, train_time_s=10.0, validation={"lm loss": 3.0}, test={"lm loss": 3.5})
    out = capsys.readouterr().out
    assert " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 1000\n" in out
    assert " > number of parameters on (tensor, pipeline) model parallel rank (0, 1): 1001\n" in out
    assert " > memory after setup (MiB, peak resident set size of the process): max 501.0 (rank 1), min 500.0 (rank 0)" in out
    assert " > model FLOPs per iteration: 1.500E+09" in out
    assert " > transformer layers per pipeline stage (pipeline order): 1, 2, 3, 1\n" in out
    assert " validation loss at iteration 1 on test set | lm loss value: 3.500000E+00 | lm loss PPL: " in out
    assert re.search(r"\[after training is done\] datetime: \d{4}-", out)
    assert (
        " training summary | iterations: 1 (1 in this run) | total time (s): 12.0 | training time (s): 10.0 | "
        "validation lm loss: 3.000000E+00 | test lm loss: 3.500000E+00 | max memory (MiB): 700.0 |"
    ) in out
    startup, _, summary = _events(tmp_path / "log.jsonl")
    assert startup["event"] == "startup" and startup["schedule"] == "bitpipe+split-backward (costs from costs.json)"
    assert startup["ranks"][1] == {"rank": 1, "tp_rank": 0, "pp_rank": 1, "dp_rank": 0, "parameters": 1001, "memory_mib": 501.0, "layers": 4}
    assert startup["stage_layers"] == [1, 2, 3, 1]
    assert startup["model_flops_per_iteration"] == 1.5e9
    assert summary == {
        "event": "summary", "timestamp": summary["timestamp"], "iterations": 1, "iterations_this_run": 1, "total_time_s": 12.0,
        "train_time_s": 10.0, "max_memory_mib": 700.0, "validation_lm_loss": 3.0, "test_lm_loss": 3.5,
    }  # fmt: skip


def test_only_rank_0_writes(tmp_path, capsys):
    logger = _logger(tmp_path, rank=1, log_interval=1)
    logger.startup([RankReport(0, 0, 0, 0, 10, 1.0)], "x", 1.0, "bitpipe")
    logger.record(_record(1, 4.0))
    logger.summary(1, 1, 1.0, 1.0, {}, {})
    assert capsys.readouterr().out == "" and not (tmp_path / "log.jsonl").exists()


@pytest.mark.parametrize(
    "overrides,label",
    [
        (dict(), "bitpipe"),
        (dict(split=True), "bitpipe+split-backward"),
        (dict(split=True, costs="costs.json"), "bitpipe+split-backward (costs from costs.json)"),
        (dict(schedule="interleaved"), "interleaved (2 chunks per rank)"),
        (dict(schedule="interleaved", virtual_size=4), "interleaved (4 chunks per rank)"),
        (dict(schedule="1f1b"), "1f1b"),
        (dict(schedule="1f1b", pipeline=1), "no_pipelining"),
    ],
)
def test_schedule_label(overrides, label):
    assert _run(**overrides).label == label


def _run(schedule="bitpipe", split=False, costs=None, virtual_size=None, pipeline=2) -> RunConfig:
    """A run's decisions with the given schedule (the rest as the logger tests' flags)."""
    choice = ScheduleChoice(schedule, split, None, virtual_size)
    virtual = choice.virtual_chunks if schedule == "interleaved" else None
    layout = ParallelLayout(tensor=1, pipeline=pipeline, data=1, virtual=virtual, sequence_parallel=False, tensor_parallel_mode="1d")
    return RunConfig(choice, layout, Precision(), Batches(1, 8, 8), SYNC, OptimizerChoice(), costs)


def _shape_args(**overrides) -> ModelShape:
    settings = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=8,
                    seq_length=32, swiglu=False)  # fmt: skip
    settings.update(overrides)
    return ModelShape(**settings)


def test_model_flops_agree_with_the_cost_model_and_count_each_variant():
    args = _shape_args()
    shape = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=32, micro_batch_size=1, ffn_hidden_size=256)
    full = model_flops_per_sample(args, 0, causal=False)
    assert full == 3 * args.num_layers * shape.layer_forward_flops()  # forward and backward of the layers
    tokens, h, s, L = 32, 64, 32, 4
    assert full - model_flops_per_sample(args, 0, causal=True) == 6 * L * tokens * h * s  # causal: half of 4 s h per token
    assert model_flops_per_sample(args, 128, causal=False) - full == 6 * tokens * h * 128  # logits
    assert model_flops_per_sample(_shape_args(swiglu=True), 0, causal=False) - full == 6 * L * tokens * h * 256  # the gate
    assert full - model_flops_per_sample(_shape_args(num_query_groups=2), 0, causal=False) == 6 * L * tokens * h * 2 * (64 - 16)  # GQA: K, V


def test_an_hfta_arrays_flops_are_all_its_models(tmp_path, capsys):
    """An array of B models does B models' work on every sequence: B times one model's FLOPs,
    and the start-up line says so."""
    args = _shape_args()
    run = dataclasses.replace(_run(), batches=Batches(2, 16, 8), padded_vocab_size=0, model=args)
    one = model_flops_per_iteration(run, causal=True)
    assert one == 16 * model_flops_per_sample(args, 0, causal=True)
    assert model_flops_per_iteration(run, causal=True, models=4) == 4 * one
    logger = _logger(tmp_path)
    logger.startup([RankReport(0, 0, 0, 0, 1000, 500.0)], "peak resident set size of the process", 4 * one, "1f1b", 4)
    assert f" > model FLOPs per iteration: {4 * one:.3E} (matrix products, forward and backward, the 4 models of the array)\n" in (
        capsys.readouterr().out
    )


def _count_megatron_flops(argv):
    """Rank body: FLOPs torch counts in one forward and backward of a megatron-core GPT built as
    the pretrain script builds it, and the logs' model FLOPs of that micro-batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.config import use_global_tp_group
    from megatron_bitpipe.training.data import build_tokenizer, collate
    from megatron_bitpipe.training.gpt import GPTTask, MockGPTDataset
    from megatron_bitpipe.training.model_registry import model_kind_for

    enable_cpu_megatron()
    task = GPTTask()
    args = parse_args(task, argv, world_size=1, cuda_available=False)
    run = RunConfig.from_args(args, build_tokenizer(TokenizerSettings.from_args(args)).vocab_size)
    model = model_kind_for(task.name, run).build_model(run)
    use_global_tp_group(model.groups.tp)
    batch = collate([MockGPTDataset(args.seed, "train", args.seq_length, run.padded_vocab_size)[i] for i in range(args.micro_batch_size)])
    with FlopCounterMode(display=False) as counter:
        losses = model.chunks[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        losses.sum().backward()
    return counter.get_total_flops(), args.micro_batch_size * model_flops_per_sample(run.model, run.padded_vocab_size, causal=False)


@pytest.mark.multirank
def test_model_flops_are_what_torch_counts_in_megatrons_gpt():
    """megatron-core's local attention computes every score (no causal skipping), so torch's
    count equals the non-causal model FLOPs: layers (GQA, SwiGLU) and logits, forward and backward."""
    from megatron_bitpipe.cpu.launcher import launch

    argv = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--swiglu", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1",
        "--lr", "1e-3", "--vocab-size", "127", "--transformer-impl", "local",
    ]  # fmt: skip
    (counted, formula), = launch(_count_megatron_flops, 1, argv, timeout=300)
    assert counted == formula


def test_final_evaluation_states_its_cost(tmp_path, capsys):
    """The evaluation after the last iteration (``--eval-iters`` batches) can outlast a short
    run: the log says what it cost, between the training time and the total time."""
    logger = _logger(tmp_path)
    logger.final_evaluation("validation set", 100, 118.04)
    assert capsys.readouterr().out == " final evaluation on the validation set: 100 iterations (--eval-iters), 118.0 s\n"
    _logger(tmp_path, rank=1).final_evaluation("validation set", 100, 1.0)
    assert capsys.readouterr().out == ""
