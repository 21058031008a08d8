"""The pretrain scripts' flags, their checks and the mock data (pure Python, no ranks)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.training.arguments import padded_vocab_size, parse_args
from megatron_bitpipe.training.gpt import GPTTask, MockGPTDataset

BASE = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip


def parse(*extra, world_size=4, cuda=False):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=cuda)


def test_derived_values_follow_megatron():
    args = parse("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2")
    assert (args.data_parallel_size, args.num_microbatches, args.schedule) == (1, 8, "bitpipe")
    assert (args.ffn_hidden_size, args.kv_channels, args.max_position_embeddings, args.lr_decay_iters) == (128, 8, 16, 4)
    assert args.distributed_backend == "gloo" and args.use_mock_data
    assert parse("--pipeline-model-parallel-size", "2", world_size=2).schedule == "1f1b"
    interleaved = parse("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", world_size=2)
    assert interleaved.schedule == "interleaved"
    assert parse(world_size=1).schedule == "no_pipelining"
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
    (["--hidden-size", "30"], 1, "--hidden-size 30 must be divisible by --num-attention-heads 4"),
    (["--max-position-embeddings", "8"], 1, "--max-position-embeddings 8 must be >= --seq-length 16"),
    (["--lr-warmup-iters", "4"], 1, "--lr-warmup-iters 4 must be smaller than --lr-decay-iters 4"),
    (["--save-interval", "2"], 1, "--save-interval needs --save DIR"),
    (["--ckpt-step", "2"], 1, "--ckpt-step needs --load DIR"),
    (["--exit-interval", "0"], 1, "--exit-interval must be positive"),
    (["--exit-duration-in-mins", "-1"], 1, "--exit-duration-in-mins must be positive"),
    (["--tokenizer-type", "GPT2BPETokenizer"], 1, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (["--data-path", "corpus_text_document", "--mock-data", "--tokenizer-type", "NullTokenizer"], 1, "--mock-data and --data-path are mutually exclusive"),
    (["--data-path", "corpus_text_document"], 1, "--data-path needs --tokenizer-type"),
]  # fmt: skip


@pytest.mark.parametrize("extra,world_size,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_flags_name_the_flag(extra, world_size, message):
    with pytest.raises(BitPipeConfigError) as info:
        parse(*extra, world_size=world_size)
    assert message in str(info.value)


def test_exit_flags_take_megatron_lm_spellings(capsys):
    args = parse("--exit-signal-handler", "--exit-signal", "SIGUSR1", "--exit-interval", "5", "--exit-duration-in-mins", "0.5")
    assert (args.exit_signal_handler, args.exit_signal, args.exit_interval, args.exit_duration_in_mins) == (True, "SIGUSR1", 5, 0.5)
    assert parse().exit_signal == "SIGTERM" and not parse().exit_signal_handler
    with pytest.raises(SystemExit):
        parse("--exit-signal", "USR1")
    assert "--exit-signal: invalid choice: 'USR1'" in capsys.readouterr().err


def test_mock_data_needs_a_vocabulary():
    with pytest.raises(BitPipeConfigError, match="mock data needs --vocab-size"):
        parse_args(GPTTask(), [a for a in BASE if a not in ("--vocab-size", "127")], world_size=1, cuda_available=False)


def test_every_problem_is_reported_at_once():
    with pytest.raises(BitPipeConfigError) as info:
        parse("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--num-layers", "12", "--bf16")
    assert "--num-layers 12" in str(info.value) and "--bf16" in str(info.value)


def test_padded_vocabulary_does_not_depend_on_the_tp_size():
    def padded(vocab, tp):
        return padded_vocab_size(vocab, argparse.Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp))

    assert {padded(50257, tp) for tp in (1, 2, 4, 8, 16)} == {50304}
    assert padded(100, 3) == 384


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
    templates = sorted((Path(__file__).resolve().parents[1] / "scripts" / "slurm").glob("*.s*"))
    assert templates
    for template in templates:
        result = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True)
        assert result.returncode == 0, f"{template.name}: {result.stderr}"
