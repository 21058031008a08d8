"""The pretrain scripts' flags, their checks and the mock data (pure Python, no ranks)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.run_config import RunConfig, padded_vocab_size
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.gpt import GPTTask, MockGPTDataset
from megatron_bitpipe.usage import UsageError

BASE = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip


def parse(*extra, world_size=4, cuda=False):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=cuda)


def test_derived_values_follow_megatron():
    args = parse("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2")
    run = RunConfig.from_args(args)
    assert (args.data_parallel_size, args.num_microbatches, run.schedule_name) == (1, 8, "bitpipe")
    assert (run.layout.data, run.batches.num_microbatches, run.executes_plan) == (1, 8, True)
    assert (args.ffn_hidden_size, args.kv_channels, args.max_position_embeddings, args.lr_decay_iters) == (128, 8, 16, 4)
    assert args.distributed_backend == "gloo" and args.use_mock_data
    assert RunConfig.from_args(parse("--pipeline-model-parallel-size", "2", world_size=2)).megatron_schedule == "1f1b"
    interleaved = RunConfig.from_args(
        parse("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", world_size=2)
    )
    assert (interleaved.megatron_schedule, interleaved.layout.virtual, interleaved.label) == ("interleaved", 2, "interleaved (2 chunks per rank)")
    single = RunConfig.from_args(parse(world_size=1))
    assert (single.megatron_schedule, single.schedule.schedule, single.executes_plan) == ("no_pipelining", "1f1b", False)
    assert parse("--global-batch-size", "4", world_size=2).data_parallel_size == 2


BAD = [
    (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "3"], 3, "--pipeline-model-parallel-size must be even"),
    (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--global-batch-size", "4"], 4, "at least --pipeline-model-parallel-size=4 micro-batches"),
    (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--global-batch-size", "6"], 2, "even number of micro-batches"),
    (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--num-layers", "12"], 4, "--num-layers 12 must be divisible by 2 x --pipeline-model-parallel-size"),
    (["--global-batch-size", "15"], 1, "--global-batch-size 15 is not divisible"),
    (["--tensor-parallel-mode", "optimus2d", "--tensor-model-parallel-size", "2"], 2, "--tensor-model-parallel-size 2 is not a square"),
    (["--tensor-parallel-mode", "optimus2d", "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], 8, "optimus2d runs with --pipeline-schedule bitpipe, 1f1b or default"),
    (["--bf16"], 1, "--bf16 needs a CUDA GPU"),
    (["--fp16"], 1, "--fp16 needs a CUDA GPU"),
    (["--distributed-backend", "nccl"], 1, "--distributed-backend nccl needs CUDA GPUs"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 8 must be divisible by --pipeline-model-parallel-size"),
    (["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "12"], 4, "multiple of --pipeline-model-parallel-size 4"),
    (["--virtual-pipeline-model-parallel-size", "2"], 1, "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size >= 2"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], 1, "--overlap-param-gather is only supported with the distributed optimizer: add --use-distributed-optimizer"),
    (["--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-param-gather"], 2,
     "--overlap-param-gather must be used with --overlap-grad-reduce"),
    (["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce", "--hfta-models", "2"], 1, "--overlap-param-gather (a fused array"),
    (["--hidden-size", "30"], 1, "--num-attention-heads 4 must divide --hidden-size 30"),
    (["--max-position-embeddings", "8"], 1, "--max-position-embeddings 8 must be >= --seq-length 16"),
    (["--lr-warmup-iters", "4"], 1, "--lr-warmup-iters 4 must be smaller than --lr-decay-iters 4"),
    (["--save-interval", "2"], 1, "--save-interval needs --save DIR"),
    (["--ckpt-step", "2"], 1, "--ckpt-step needs --load DIR"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 1, "are mutually exclusive"),
    (["--exit-interval", "0"], 1, "--exit-interval must be positive"),
    (["--exit-duration-in-mins", "-1"], 1, "--exit-duration-in-mins must be positive"),
    (["--tokenizer-type", "GPT2BPETokenizer"], 1, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (["--data-path", "corpus_text_document", "--mock-data", "--tokenizer-type", "NullTokenizer"], 1, "--mock-data and --data-path are mutually exclusive"),
    (["--data-path", "corpus_text_document"], 1, "--data-path needs --tokenizer-type"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"], 1, "--recompute-granularity full needs --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], 1, "--recompute-granularity full needs --recompute-num-layers (1 to 8"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"], 1, "--recompute-num-layers 0 must be between 1 and the 8 layers"),
    (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "4"], 2, "--recompute-num-layers 4 must be between 1 and the 2 layers of a model chunk"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"], 2, "--recompute-num-layers 3 must be between 1 and the 2 layers"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"], 1, "--recompute-method uniform needs --recompute-num-layers 3 to divide the 8 layers"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], 1, "--recompute-method applies to --recompute-granularity full only (got selective)"),
    (["--recompute-activations", "--recompute-num-layers", "2"], 1, "--recompute-num-layers applies to --recompute-granularity full only (got selective)"),
    (["--recompute-method", "block"], 1, "--recompute-method applies to --recompute-granularity full only (got no recompute)"),
    (["--recompute-modules", "mlp"], 1, "--recompute-modules applies to --recompute-granularity selective only"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe", "mlp"], 1, "--recompute-modules moe: dense layers recompute core_attn, layernorm, mlp"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], 1, "--recompute-modules mlp needs --disable-bias-linear"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"], 1, "--recompute-modules layernorm needs Transformer Engine"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"], 1, "--recompute-activations means --recompute-granularity selective"),
    (["--data-path", "nowhere/corpus_text_document", "--tokenizer-type", "NullTokenizer"], 1, "--data-path nowhere/corpus_text_document: nowhere/corpus_text_document.bin and nowhere/corpus_text_document.idx not found"),
    (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--global-batch-size", "12"], 8, "the smallest valid --global-batch-size is 16 (4 micro-batches x --micro-batch-size 2 x data-parallel size 2)"),
    (["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "12"], 4, "the smallest valid --global-batch-size is 8 (4 micro-batches x --micro-batch-size 2 x data-parallel size 1); the next valid one above 12 is 16"),
]  # fmt: skip


@pytest.mark.parametrize("extra,world_size,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_flags_name_the_flag(extra, world_size, message):
    with pytest.raises(BitPipeConfigError) as info:
        parse(*extra, world_size=world_size)
    assert message in str(info.value)


def test_exit_flags_take_megatron_lm_spellings():
    args = parse("--exit-signal-handler", "--exit-signal", "SIGUSR1", "--exit-interval", "5", "--exit-duration-in-mins", "0.5")
    assert (args.exit_signal_handler, args.exit_signal, args.exit_interval, args.exit_duration_in_mins) == (True, "SIGUSR1", 5, 0.5)
    assert parse().exit_signal == "SIGTERM" and not parse().exit_signal_handler
    with pytest.raises(UsageError, match="--exit-signal: invalid choice: 'USR1'"):
        parse("--exit-signal", "USR1")


def test_recompute_flags_follow_megatron():
    assert parse(world_size=1).recompute_granularity is None
    selective = parse("--recompute-activations", world_size=1)
    assert (selective.recompute_granularity, selective.recompute_method, selective.recompute_modules) == ("selective", None, None)
    bitpipe = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
    full = parse(*bitpipe, "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2", world_size=2)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 2)
    modules = parse("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "--disable-bias-linear", world_size=1)
    assert modules.recompute_modules == ["core_attn", "mlp"]


def test_mock_data_needs_a_vocabulary():
    with pytest.raises(BitPipeConfigError, match="mock data needs --vocab-size"):
        parse_args(GPTTask(), [a for a in BASE if a not in ("--vocab-size", "127")], world_size=1, cuda_available=False)


def test_leaving_out_the_global_batch_size_names_the_smallest_valid_one():
    at = BASE.index("--global-batch-size")
    args = BASE[:at] + BASE[at + 2 :]
    with pytest.raises(BitPipeConfigError) as info:
        parse_args(GPTTask(), [*args, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4"], world_size=8, cuda_available=False)
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 1, problems  # one message, not one per micro-batch rule
    assert problems[0].startswith("  --global-batch-size is not set, and its default, --micro-batch-size x data-parallel size = 4, gives 1 micro-batch")
    assert problems[0].endswith("the smallest valid --global-batch-size is 16 (4 micro-batches x --micro-batch-size 2 x data-parallel size 2)")
    smallest = parse_args(GPTTask(), [*args, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--global-batch-size", "16"], world_size=8, cuda_available=False)
    assert smallest.num_microbatches == 4


def test_data_path_files_are_checked_with_the_flags(tmp_path):
    """Missing .bin/.idx files fail at parse time, naming the flag and the nearest prefix."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    data = ["--tokenizer-type", "NullTokenizer", "--data-path"]

    def problem(*paths):
        with pytest.raises(BitPipeConfigError) as info:
            parse(*data, *paths, world_size=1)
        return str(info.value)

    assert f"(did you mean {tmp_path / 'corpus_text_document'}?)" in problem(str(tmp_path / "corpus"))
    assert "(give the prefix, without .bin/.idx)" in problem(str(tmp_path / "corpus_text_document.bin"))
    weighted = problem("0.3", str(tmp_path / "corpus_text_document"), "0.7", str(tmp_path / "other_text_document"))
    assert f"--data-path {tmp_path / 'other_text_document'}:" in weighted and "corpus_text_document:" not in weighted
    assert parse(*data, str(tmp_path / "corpus_text_document"), world_size=1).data_path == [str(tmp_path / "corpus_text_document")]


def test_every_problem_is_reported_at_once():
    with pytest.raises(BitPipeConfigError) as info:
        parse("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--num-layers", "12", "--bf16")
    assert "--num-layers 12" in str(info.value) and "--bf16" in str(info.value)


def test_padded_vocabulary_does_not_depend_on_the_tp_size():
    def padded(vocab, tp):
        return padded_vocab_size(vocab, argparse.Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp))

    assert {padded(50257, tp) for tp in (1, 2, 4, 8, 16)} == {50304}
    assert padded(100, 3) == 384


def test_the_run_config_holds_the_padded_vocabulary_and_the_flags_do_not():
    """The padded vocabulary is decided once, from the tokenizer's size, in the RunConfig; the
    checked flags never carry it (nothing writes it into them)."""
    args = parse("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64", "--save", "ckpt", "--log-interval", "3")
    before = dict(vars(args))
    run = RunConfig.from_args(args, 1000)
    assert run.padded_vocab_size == 1024 and RunConfig.from_args(args).padded_vocab_size is None
    assert (run.checkpointing.save, run.logging.interval, run.batches.seq_length) == ("ckpt", 3, args.seq_length)
    assert (run.distributed_backend, run.kernels.attention_backend) == ("gloo", "auto")
    assert vars(args) == before and not hasattr(args, "padded_vocab_size")


def test_mock_data_is_a_function_of_seed_split_and_index():
    data = MockGPTDataset(1234, "train", 16, 128)
    first = data[5]
    assert torch.equal(first["tokens"], MockGPTDataset(1234, "train", 16, 128)[5]["tokens"])
    assert torch.equal(first["tokens"][1:], first["labels"][:-1])  # next-token labels
    assert first["tokens"].shape == (16,) and int(first["tokens"].max()) < 128 and int(first["tokens"].min()) >= 0
    assert not torch.equal(first["tokens"], data[6]["tokens"])
    assert not torch.equal(first["tokens"], MockGPTDataset(1235, "train", 16, 128)[5]["tokens"])
    assert not torch.equal(first["tokens"], MockGPTDataset(1234, "valid", 16, 128)[5]["tokens"])
    assert torch.equal(first["position_ids"], torch.arange(16)) and bool((first["loss_mask"] == 1).all())


@pytest.mark.multirank
def test_slurm_templates_parse():
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    templates = sorted((Path(__file__).resolve().parents[2] / "scripts" / "slurm").glob("*.s*"))
    assert templates
    for template in templates:
        result = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True)
        assert result.returncode == 0, f"{template.name}: {result.stderr}"


def test_help_names_the_defaults():
    """``--help`` says what a flag left out means: its default where it has one, once (help
    that already speaks of its default is left alone); switches get none."""
    from megatron_bitpipe.training.arguments import build_parser

    import re

    raw = build_parser(GPTTask(), prog="pretrain_gpt.py").format_help()
    text = " ".join(raw.split())
    for flag, default in (("--eval-iters EVAL_ITERS", "100"), ("--eval-interval EVAL_INTERVAL", "1000"),
                          ("--seed SEED", "1234"), ("--split SPLIT", "969, 30, 1"), ("--tensor-parallel-mode {1d,optimus2d}", "1d")):
        entry = " ".join(re.search(rf"^  {re.escape(flag)}(.*?)(?=^  -|\Z)", raw, re.M | re.S).group(1).split())
        assert f"(default: {default})" in entry, (flag, entry)
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "default 4 x --hidden-size" in text and "(default: 4 x" not in text
