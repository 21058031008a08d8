"""scripts/preprocess_data.py and the real-text path into pretrain_gpt.py.

* Round trip: the tokens read back from the ``.bin``/``.idx`` pair (megatron-core's
  ``IndexedDataset``) are the tokenizer's, document by document (and sentence by sentence),
  with the end-of-document token where asked; empty documents are left out and counted;
  several worker processes write the same files as one.
* The built-in corpus (Python's documentation topics) is preprocessed once and reused.
* ``--tokenizer-type ByteLevelTokenizer`` goes through the pretrain scripts' flags and
  tokenizer builder; bad flags and bad input are refused naming the flag or the file line.
* Multi-rank: pretrain_gpt.py's loop trains on the preprocessed built-in corpus with BitPipe
  on 2 ranks exactly like a single process (losses and validation losses, rtol 1e-5).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatron_bitpipe.training.preprocess import (
    STDLIB_DOCS,
    main,
    read_documents,
    split_sentences,
    stdlib_docs_dataset,
    tokenizer_settings,
    write_indexed_datasets,
)

DOCUMENTS = [
    {"text": "The quick brown fox. It jumps!\n\nOver the lazy dog?", "title": "Fox"},
    {"text": "", "title": "empty"},
    {"text": "Größe und Übermaß: naïve café (ünïcödé).", "title": "Unicode"},
    {"text": "one\ntwo\nthree", "title": ""},
]


def _read_back(prefix: str):
    """(sequences as lists, document boundaries) of an indexed dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))], dataset.document_indices.tolist()


def _byte_tokenizer():
    from megatron_bitpipe.training.data import build_tokenizer

    return build_tokenizer(tokenizer_settings())


def test_documents_read_back_as_the_tokenizer_wrote_them(tmp_path):
    tokenizer = _byte_tokenizer()
    summaries = write_indexed_datasets(DOCUMENTS, str(tmp_path / "corpus"), tokenizer_settings(), ("text", "title"), append_eod=True)
    text, title = summaries["text"], summaries["title"]
    assert text.prefix == str(tmp_path / "corpus_text_document") and text.dtype == "uint16"
    assert (text.documents, text.empty_documents, title.documents, title.empty_documents) == (3, 1, 3, 1)
    for summary, key in ((text, "text"), (title, "title")):
        sequences, boundaries = _read_back(summary.prefix)
        expected = [tokenizer.tokenize(d[key]) + [tokenizer.eod] for d in DOCUMENTS if d[key]]
        assert sequences == expected
        assert boundaries == list(range(len(expected) + 1))  # one sequence per document
        assert summary.tokens == sum(map(len, expected)) and summary.sequences == len(expected)
    assert tokenizer.eod == 0 and tokenizer.detokenize(_read_back(text.prefix)[0][1][:-1]) == DOCUMENTS[2]["text"]


def test_sentences_keep_their_document_boundaries(tmp_path):
    tokenizer = _byte_tokenizer()
    summary = write_indexed_datasets(DOCUMENTS, str(tmp_path / "corpus"), tokenizer_settings(), sentences=True, append_eod=True)["text"]
    assert summary.prefix.endswith("corpus_text_sentence")
    sequences, boundaries = _read_back(summary.prefix)
    sentences = [split_sentences(d["text"]) for d in DOCUMENTS if d["text"]]
    assert sentences[0] == ["The quick brown fox.", "It jumps!", "Over the lazy dog?"]
    assert sentences[2] == ["one\ntwo\nthree"]
    expected = [tokenizer.tokenize(s) for doc in sentences for s in doc]
    ends = np.cumsum([len(doc) for doc in sentences]).tolist()
    for end in ends:  # the end-of-document token closes each document's last sentence
        expected[end - 1] = expected[end - 1] + [tokenizer.eod]
    assert sequences == expected and boundaries == [0, *ends]


def test_plain_text_documents(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First paragraph\nstill first.\n\n  \nSecond.\nThird line\n")
    texts = lambda mode: [d["text"] for d in read_documents([str(path)], text_documents=mode)]  # noqa: E731
    assert texts("file") == [path.read_text()]
    assert texts("paragraph") == ["First paragraph\nstill first.", "Second.\nThird line\n"]
    assert texts("line") == ["First paragraph", "still first.", "Second.", "Third line"]


@pytest.mark.multirank
def test_workers_write_the_same_files(tmp_path):
    documents = [{"text": f"document {i}: " + "word " * (i % 7)} for i in range(600)]  # several worker batches
    one = write_indexed_datasets(documents, str(tmp_path / "one"), tokenizer_settings(), append_eod=True)["text"].prefix
    two = write_indexed_datasets(documents, str(tmp_path / "two"), tokenizer_settings(), append_eod=True, workers=2)["text"].prefix
    for suffix in (".bin", ".idx"):
        assert Path(one + suffix).read_bytes() == Path(two + suffix).read_bytes()


def test_stdlib_docs_corpus_is_written_once(tmp_path):
    from pydoc_data.topics import topics

    prefix = stdlib_docs_dataset(str(tmp_path))
    assert Path(prefix).name.startswith("stdlib_docs_py") and prefix.endswith("_ByteLevelTokenizer_text_document")
    sequences, boundaries = _read_back(prefix)
    assert len(sequences) == len(topics) and boundaries == list(range(len(topics) + 1))
    assert sequences[0] == _byte_tokenizer().tokenize(topics[sorted(topics)[0]]) + [0]
    written = Path(prefix + ".bin").stat().st_mtime_ns
    assert stdlib_docs_dataset(str(tmp_path)) == prefix and Path(prefix + ".bin").stat().st_mtime_ns == written
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(prefix).name + ".bin", Path(prefix).name + ".idx"]


def test_byte_level_tokenizer_through_the_pretrain_flags(tmp_path):
    from megatron_bitpipe.megatron_args import BitPipeConfigError
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.gpt import GPTTask

    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]
    model += ["--train-iters", "1", "--lr", "1e-3", "--data-path", stdlib_docs_dataset(str(tmp_path)), "--tokenizer-type", "ByteLevelTokenizer"]
    default = build_tokenizer(parse_args(GPTTask(), model, world_size=1, cuda_available=False))
    assert (default.vocab_size, default.eod) == (512, 0)
    assert build_tokenizer(parse_args(GPTTask(), [*model, "--vocab-size", "256"], world_size=1, cuda_available=False)).vocab_size == 256
    with pytest.raises(BitPipeConfigError, match="--vocab-size 255: ByteLevelTokenizer needs at least 256"):
        parse_args(GPTTask(), [*model, "--vocab-size", "255"], world_size=1, cuda_available=False)


def _cli(tmp_path, *argv):
    return main(["--output-prefix", str(tmp_path / "out"), *argv])


def test_cli_writes_and_reports(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCUMENTS))
    assert _cli(tmp_path, "--input", str(corpus), "--json-keys", "text", "title", "--tokenizer-type", "ByteLevelTokenizer", "--append-eod") == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'out'}_text_document.bin/.idx: 3 documents, 3 sequences" in out and "1 empty documents left out" in out
    assert _read_back(str(tmp_path / "out_title_document"))[0][0] == [70, 111, 120, 0]  # "Fox" + end of document


BAD_CLI = [
    (["--input", "missing.jsonl", "--tokenizer-type", "ByteLevelTokenizer"], 2, "--input missing.jsonl: no such file"),
    (["--input", STDLIB_DOCS, "--json-keys", "body", "--tokenizer-type", "ByteLevelTokenizer"], 2, "--json-keys body: stdlib-docs is plain text"),
    (["--input", STDLIB_DOCS, "--tokenizer-type", "GPT2BPETokenizer"], 2, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (["--input", STDLIB_DOCS, "--tokenizer-type", "ByteLevelTokenizer", "--workers", "0"], 2, "--workers must be at least 1"),
    (["--input", STDLIB_DOCS, "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "100"], 2, "--vocab-size 100: too small"),
]  # fmt: skip


@pytest.mark.parametrize("argv,status,message", BAD_CLI, ids=[m for _, _, m in BAD_CLI])
def test_cli_refuses_bad_flags(tmp_path, capsys, argv, status, message):
    assert _cli(tmp_path, *argv) == status
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("line,message", [("not json", "not a JSON object"), ('{"title": "x"}', "no text under --json-keys text")])
def test_cli_names_the_bad_input_line(tmp_path, capsys, line, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n' + line + "\n")
    assert _cli(tmp_path, "--input", str(corpus), "--tokenizer-type", "ByteLevelTokenizer") == 1
    assert f"{corpus}:2: {message}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # the partial .bin is removed


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_bitpipe_trains_on_the_stdlib_docs_like_a_single_process(tmp_path):
    from megatron_bitpipe.cpu.launcher import launch

    from ..pretrain_support import assert_same_records, records, train_in_process

    prefix = stdlib_docs_dataset(str(tmp_path / "data"))
    flags = [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3",
        "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--data-path", prefix, "--split", "90,10,0",
        "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256", "--data-cache-path", str(tmp_path / "cache"),
    ]  # fmt: skip
    bitpipe = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--log-json", str(tmp_path / "bitpipe.jsonl")]
    launch(train_in_process, 1, "gpt", [*flags, "--log-json", str(tmp_path / "single.jsonl")], timeout=240)
    launch(train_in_process, 2, "gpt", [*flags, *bitpipe], timeout=240)
    single, pipelined = records(tmp_path / "single.jsonl"), records(tmp_path / "bitpipe.jsonl")
    assert sorted(single) == [1, 2, 3] and all(math.isfinite(r["lm_loss"]) for r in single.values())
    assert math.log(256) - 0.5 < single[1]["lm_loss"] < math.log(256) + 0.5  # untrained: about uniform over the bytes
    assert_same_records(pipelined, single, [1, 2, 3], ("lm_loss", "grad_norm", "lr", "validation_lm_loss"))
    assert "validation_lm_loss" in single[3]
