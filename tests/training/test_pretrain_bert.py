"""scripts/pretrain_bert.py end to end on CPU ranks (gloo).

* The same tiny BERT (seed-only initial weights, mock data with padding and a different number
  of masked tokens per micro-batch) trained with BitPipe on 2 ranks, with megatron-core's 1F1B
  at TP 2 (sequence parallel) x PP 2 and in a single process (the script run with ``python``)
  logs the same per-iteration lm and sop losses, grad norms, learning rates and validation
  losses (rtol 1e-5, from ``--log-json``).
* A checkpoint saved by the BitPipe run at iteration 2 continues in a single process exactly
  like the uninterrupted run; a checkpoint of a model without the binary head is refused
  naming ``--bert-no-binary-head``.
* Without the binary head only ``lm loss`` is reported; megatron-core's BERT dataset over a
  Megatron indexed dataset of sentences trains (a stand-in WordPiece tokenizer: megatron's
  needs ``transformers``).
* Bad flags fail on every rank before any communication, naming the flag.

The multi-rank runs, the resumes and the bad-flag check use the in-process launcher (same code,
no interpreter start-up per rank).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import assert_same_records, checked, main_in_process, records, run_script, train_in_process

ITERS, SAVE_AT = 3, 2
MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--train-iters", str(ITERS),
    "--adam-eps", "1e-4",  # bounds Adam's amplification of rounding noise in exactly-zero gradients
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
]  # fmt: skip
KEYS = ("lm_loss", "sop_loss", "grad_norm", "lr", "validation_lm_loss", "validation_sop_loss", "consumed_samples")

pytestmark = pytest.mark.timeout(600)


class WordPieceStub:
    """What megatron's BERT dataset reads of a tokenizer: ids 0-3 [PAD] [CLS] [SEP] [MASK],
    then words (every third a ``##`` continuation, for whole-word masking)."""

    def __init__(self, vocab_size: int):
        words = [f"##w{i}" if i % 3 == 0 else f"w{i}" for i in range(4, vocab_size)]
        self.inv_vocab = dict(enumerate(["[PAD]", "[CLS]", "[SEP]", "[MASK]", *words]))
        self.vocab_size = vocab_size
        self.pad, self.cls, self.sep, self.mask = 0, 1, 2, 3
        self.unique_identifiers = {"class": "WordPieceStub", "vocab_size": vocab_size}


def _train_with_stub_tokenizer(argv: List[str]):
    """Rank body: :func:`pretrain_support.train_in_process` with :class:`WordPieceStub` as the
    tokenizer of ``--vocab-size`` tokens."""
    from megatron_bitpipe.training import loop

    loop.build_tokenizer = lambda settings: WordPieceStub(settings.vocab_size)
    return train_in_process("bert", argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every training run, once: name -> {iteration: JSON record}."""
    out = tmp_path_factory.mktemp("pretrain_bert")
    ckpt = out / "ckpt_bitpipe"
    logs = {}

    def log(name: str) -> List[str]:
        logs[name] = out / f"{name}.jsonl"
        return ["--log-json", str(logs[name])]

    bitpipe = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--save", str(ckpt), "--save-interval", str(SAVE_AT)]
    launch(train_in_process, 2, "bert", [*MODEL, *bitpipe, *log("bitpipe")], timeout=300)
    tp2_sp_1f1b = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    launch(train_in_process, 4, "bert", [*MODEL, *tp2_sp_1f1b, *log("tp2_sp_1f1b")], timeout=300)
    single = checked(run_script("pretrain_bert.py", 1, [*MODEL, *log("single")]))
    resume = ["--load", str(ckpt), "--ckpt-step", str(SAVE_AT)]
    launch(train_in_process, 1, "bert", [*MODEL, *resume, *log("resume_single")], timeout=300)
    refused = launch(train_in_process, 1, "bert", [*MODEL, "--bert-no-binary-head", "--load", str(ckpt)], timeout=300)[0]
    return dict(records={name: records(path) for name, path in logs.items()}, stdout=single.stdout, refused=refused)


def _assert_same(actual: Dict[int, dict], expected: Dict[int, dict], iterations):
    assert_same_records(actual, expected, iterations, KEYS)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["bitpipe", "tp2_sp_1f1b"])
def test_every_layout_trains_like_a_single_process(runs, layout):
    single = runs["records"]["single"]
    assert sorted(single) == list(range(1, ITERS + 1))
    for it, record in single.items():
        assert math.isfinite(record["lm_loss"]) and math.isfinite(record["sop_loss"])
        assert ("validation_sop_loss" in record) == (it % 2 == 0)
    _assert_same(runs["records"][layout], single, range(1, ITERS + 1))


@pytest.mark.multirank
def test_progress_lines_report_both_losses(runs):
    lines = [line for line in runs["stdout"].splitlines() if "] iteration " in line]
    assert len(lines) == ITERS and "lm loss:" in lines[-1] and "sop loss:" in lines[-1]
    assert "bert: no_pipelining schedule" in runs["stdout"]
    assert "validation loss at iteration 2" in runs["stdout"]


@pytest.mark.multirank
def test_bitpipe_checkpoint_resumes_in_a_single_process(runs):
    resumed = runs["records"]["resume_single"]
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    _assert_same(resumed, runs["records"]["bitpipe"], range(SAVE_AT + 1, ITERS + 1))


@pytest.mark.multirank
def test_checkpoint_with_a_binary_head_is_refused_without_one(runs):
    assert runs["refused"] is not None and "--bert-no-binary-head is False there, True here" in runs["refused"]


def _write_sentences(prefix: Path, vocab_size: int) -> None:
    """A Megatron indexed dataset of 40 documents of 2-5 sentences of 3-12 word ids."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(40):
        lengths = rng.integers(3, 13, size=int(rng.integers(2, 6))).tolist()
        tokens = rng.integers(4, vocab_size, size=sum(lengths)).astype(np.int32)
        builder.add_document(torch.from_numpy(tokens), lengths)
    builder.finalize(get_idx_path(str(prefix)))


@pytest.mark.multirank
def test_megatron_bert_dataset_without_binary_head(tmp_path):
    prefix = tmp_path / "tiny_text_sentence"
    _write_sentences(prefix, 100)
    (tmp_path / "vocab.txt").write_text("")  # the stand-in tokenizer ignores it
    data = [
        "--data-path", str(prefix), "--split", "80,20,0", "--data-cache-path", str(tmp_path / "cache"),
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(tmp_path / "vocab.txt"),
    ]  # fmt: skip
    log = tmp_path / "log.jsonl"
    args = [*MODEL, "--vocab-size", "100", "--train-iters", "2", "--bert-no-binary-head", *data, "--log-json", str(log)]
    assert launch(_train_with_stub_tokenizer, 1, args, timeout=300) == [None]
    logged = records(log)
    assert sorted(logged) == [1, 2] and all(math.isfinite(r["lm_loss"]) for r in logged.values())
    assert "sop_loss" not in logged[1] and "validation_lm_loss" in logged[2]
    assert any(name.endswith("BERTMaskedWordPieceDataset-sample_index.npy") for name in os.listdir(tmp_path / "cache"))


@pytest.mark.multirank
def test_bad_flags_fail_on_every_rank_reported_once_naming_the_flag():
    bad = ["--tensor-model-parallel-size", "1", "--tensor-parallel-mode", "optimus2d", "--mask-prob", "1.5", "--eod-mask-loss"]
    results = launch(main_in_process, 2, "bert", [*MODEL, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", *bad], timeout=120)
    assert [status for status, _ in results] == [2, 2]
    (_, stderr), (_, quiet) = results
    assert "error: invalid arguments" in stderr and quiet == ""
    for message in ("--tensor-parallel-mode optimus2d supports GPT only", "--mask-prob must be in (0, 1)", "--eod-mask-loss applies to GPT only"):
        assert message in stderr, message


BAD_FLAGS = [
    (["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "optimus2d"], 4, "--tensor-parallel-mode optimus2d supports GPT only"),
    (["--mask-prob", "0"], 1, "--mask-prob must be in (0, 1)"),
    (["--short-seq-prob", "1.5"], 1, "--short-seq-prob must be in [0, 1]"),
    (["--vocab-size", "4"], 1, "--vocab-size 4: mock BERT data needs more than 4 tokens"),
    (["--position-embedding-type", "rope", "--rotary-base", "500"], 1, "--rotary-base: megatron's BertModel uses 10000"),
    (["--data-path", "corpus_text_sentence", "--tokenizer-type", "NullTokenizer"], 1, "--data-path: megatron's BERT dataset needs a WordPiece tokenizer"),
]  # fmt: skip


@pytest.mark.parametrize("extra,world_size,message", BAD_FLAGS, ids=[m for _, _, m in BAD_FLAGS])
def test_bert_flags_are_checked_before_any_communication(extra, world_size, message):
    from megatron_bitpipe.megatron_args import BitPipeConfigError
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.bert import BertTask

    with pytest.raises(BitPipeConfigError) as info:
        parse_args(BertTask(), [*MODEL, *extra], world_size=world_size, cuda_available=False)
    assert message in str(info.value)
