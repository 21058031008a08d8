"""A user's mistakes on the command line: one message, once for the job, the closest flag,
exit status 2, before anything heavy happens; ``--help`` before torch and megatron-core."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_bitpipe.training import script
from megatron_bitpipe.training.bert_args import BertArguments
from megatron_bitpipe.training.script import run_script
from megatron_bitpipe.training.task import TaskArguments
from megatron_bitpipe.usage import FlagParser, UsageError, closest_flag

from ..pretrain_support import REPO

MODEL = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "127", "--train-iters", "2", "--lr", "1e-3",
]  # fmt: skip


def _never_loaded():
    raise AssertionError("the task (and megatron-core) must not be imported for a user error")


@pytest.fixture
def rank(monkeypatch):
    """Sets this process's torchrun rank (and whether torchrun runs it)."""

    def set_rank(rank: int, torchrun: bool = False) -> None:
        monkeypatch.setenv("RANK", str(rank))
        if torchrun:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        else:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    set_rank(0)
    return set_rank


def test_closest_flag():
    flags = ["--pipeline-schedule", "--pipeline-model-parallel-size", "--num-layers"]
    assert closest_flag("--pipeline-schedual", flags) == "--pipeline-schedule"
    assert closest_flag("--num-layer=4", flags) == "--num-layers"
    assert closest_flag("--seed", flags) is None


def test_parser_errors_are_one_line_without_the_usage_block(capsys):
    parser = FlagParser(prog="tool")
    parser.add_argument("--num-layers", type=int, required=True)
    with pytest.raises(UsageError) as info:
        parser.parse_args(["--num-layers", "2", "--num-layer", "3"])
    assert str(info.value) == "tool: error: unrecognized arguments: --num-layer 3 (did you mean --num-layers?)"
    with pytest.raises(UsageError) as info:  # the misspelling is why the required flag is missing
        parser.parse_args(["--num-layer", "3"])
    assert str(info.value) == (
        "tool: error: unrecognized arguments: --num-layer (did you mean --num-layers?); "
        "the following arguments are required: --num-layers"
    )
    with pytest.raises(UsageError, match=r"unrecognized arguments: --zzz \(tool --help lists the flags\)"):
        parser.parse_args(["--num-layers", "2", "--zzz"])
    assert capsys.readouterr().err == ""


def test_misspelled_flag_is_reported_once_with_the_closest_flag(rank, capsys):
    argv = [*MODEL, "--pipeline-schedual", "bitpipe"]
    assert run_script(TaskArguments(), _never_loaded, argv, prog="pretrain_gpt.py") == 2
    assert capsys.readouterr().err == (
        "pretrain_gpt.py: error: unrecognized arguments: --pipeline-schedual bitpipe (did you mean --pipeline-schedule?)\n"
    )
    rank(1)  # the other ranks find the same error and stay quiet
    assert run_script(TaskArguments(), _never_loaded, argv, prog="pretrain_gpt.py") == 2
    assert capsys.readouterr().err == ""


def test_under_torchrun_other_ranks_wait_for_rank_0s_report(rank, capsys, monkeypatch):
    """torchrun ends them during the wait once rank 0 has exited; a rank that outlives it
    found an error rank 0 did not, and reports it itself."""
    waits = []
    monkeypatch.setattr(script.time, "sleep", waits.append)
    rank(3, torchrun=True)
    assert run_script(BertArguments(), _never_loaded, [*MODEL, "--mask-prob", "2"], prog="pretrain_bert.py") == 2
    assert waits == [script.PEER_REPORT_WAIT_S]
    assert capsys.readouterr().err.startswith("[rank 3] pretrain_bert.py: error: invalid arguments:\n  --mask-prob must be in (0, 1)")


def test_missing_data_is_refused_before_the_model_is_built(rank, capsys, tmp_path):
    """The task — model, datasets, megatron-core — is never loaded: the files are checked with the flags."""
    argv = [*MODEL, "--tokenizer-type", "NullTokenizer", "--data-path", str(tmp_path / "corpus_text_document")]
    assert run_script(TaskArguments(), _never_loaded, argv, prog="pretrain_gpt.py") == 2
    (first, problem) = capsys.readouterr().err.splitlines()
    assert first == "pretrain_gpt.py: error: invalid arguments:"
    assert problem.startswith(f"  --data-path {tmp_path / 'corpus_text_document'}: {tmp_path / 'corpus_text_document.bin'} and ")


def test_help_is_printed_by_rank_0_only(rank, capsys):
    with pytest.raises(SystemExit) as info:
        run_script(BertArguments(), _never_loaded, ["--help"], prog="pretrain_bert.py")
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage: pretrain_bert.py [-h] --num-layers NUM_LAYERS")
    rank(1)
    with pytest.raises(SystemExit):
        run_script(BertArguments(), _never_loaded, ["--help"], prog="pretrain_bert.py")
    assert capsys.readouterr().out == ""


def _run(command, timeout=300):
    # OMP_NUM_THREADS set: torchrun prints no banner about it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env, cwd=REPO)


TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d")


@pytest.mark.multirank
def test_misspelled_flag_under_torchrun_is_one_line_before_torchruns_report_and_its_last():
    result = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "scripts/pretrain_gpt.py",
         *MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedual", "bitpipe"]
    )  # fmt: skip
    lines = result.stdout.splitlines()
    report = next(i for i, line in enumerate(lines) if line.startswith("Traceback"))  # torchrun's own report
    ours = [line for line in lines[:report] if not TORCHRUN_LOG.match(line)]
    assert ours == [
        "pretrain_gpt.py: error: unrecognized arguments: --pipeline-schedual bitpipe (did you mean --pipeline-schedule?)"
    ], result.stdout
    assert sum("error: unrecognized arguments" in line for line in lines) == 2  # ours, and in torchrun's report
    root_cause = result.stdout[result.stdout.index("Root Cause") :]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 2 ", root_cause), root_cause
    assert result.returncode == 1  # torchrun's own status for any failed rank (README.md, "Exit status")
    # torchrun's report ends with our line (its error file), not a link to torch's documentation
    assert lines[-2:] == [
        "  traceback : pretrain_gpt.py: error: unrecognized arguments: --pipeline-schedual bitpipe (did you mean --pipeline-schedule?)",
        "=" * 60,
    ], lines[-8:]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "command",
    [
        ["scripts/pretrain_gpt.py", "--help"],
        ["scripts/pretrain_bert.py", "--help"],
        ["scripts/preprocess_data.py", "--help"],
        ["-m", "megatron_bitpipe.schedules", "simulate", "--help"],
    ],
    ids=["pretrain_gpt", "pretrain_bert", "preprocess_data", "schedules"],
)
def test_help_comes_before_torch_and_megatron_core(command):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *command], capture_output=True, text=True, timeout=300, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])),
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("usage: "), result.stdout + result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "megatron.core", "numpy"} & imported


@pytest.mark.timeout(300)
def test_a_split_without_data_is_left_out_or_named(tmp_path):
    """megatron-core's builder loops forever on a split with a share but no data: on a small
    corpus the default --split leaves the test set out, or, for a validation set that
    evaluation needs, the flag is named."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    from megatron_bitpipe.megatron_args import BitPipeConfigError
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.gpt import GPTTask

    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    for length in range(20, 40):  # 20 documents
        builder.add_document(torch.arange(length, dtype=torch.int32) % 100, [length])
    builder.finalize(get_idx_path(prefix))

    def datasets(*flags):
        argv = [*MODEL, "--vocab-size", "100", "--tokenizer-type", "NullTokenizer", "--data-path", prefix,
                "--data-cache-path", str(tmp_path / "cache"), "--eval-iters", "1", *flags]  # fmt: skip
        args = parse_args(GPTTask(), argv, world_size=1, cuda_available=False)
        tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
        return GPTTask().build_datasets(RunConfig.from_args(args, tokenizer.vocab_size), tokenizer)

    train, valid, test = datasets("--split", "80,10,10")
    assert train is not None and valid is not None and test is not None
    assert datasets("--split", "90,10,0")[2] is None
    train, valid, test = datasets()  # the default --split 969, 30, 1: the test set's 0.001 x 20 documents round to none
    assert valid is not None and test is None
    with pytest.raises(BitPipeConfigError, match=r"--split 98,1,1: the validation set gets no data of .*tiny_text_document; give it a larger share or set --eval-iters 0"):
        datasets("--split", "98,1,1")
    assert datasets("--split", "98,1,1", "--eval-iters", "0")[1:] == (None, None)
