"""Text to Megatron indexed datasets (``.bin``/``.idx``): the code behind
``scripts/preprocess_data.py``, importable by benchmarks and tests.

**Inputs** (``--input``, any number, read in the order given):

* ``*.json`` / ``*.jsonl``: loose JSON, one object per line (Megatron-LM's format), one
  document per line; ``--json-keys`` names the fields to tokenize (each key its own dataset);
* any other file: plain UTF-8 text with the one key ``text``, one document per file,
  per paragraph (blocks separated by blank lines) or per line (``--text-documents``);
* ``stdlib-docs`` (:data:`STDLIB_DOCS`): the built-in corpus, the English documentation
  topics the Python standard library ships in ``pydoc_data.topics`` (what ``help("if")``
  prints), one document per topic, sorted by name, key ``text``. Every Python installation
  has it, so it needs no download; it differs a little between Python versions (3.11: 79
  topics, 465,000 characters).

**Output**, per key: ``{output_prefix}_{key}_{level}.bin`` and ``.idx`` (``level`` is
``document``, or ``sentence`` with ``--split-sentences``; Megatron-LM's naming), written by
megatron-core's ``IndexedDatasetBuilder``: one sequence per document, or one per sentence
with the document boundaries in the index (what megatron-core's BERT dataset reads). With
``--append-eod`` the tokenizer's end-of-document token ends every document (the last
sentence with ``--split-sentences``). Tokens are ``uint16`` below 65500 vocabulary entries,
else ``int32`` (megatron-core's ``DType.optimal_dtype``). A document without any token for a
key is left out of that key's dataset and counted in the summary.

**Tokenizers** are those of the pretrain scripts, built by the same function
(:func:`megatron_bitpipe.training.data.build_tokenizer`) from the same flags, so the
``--tokenizer-type`` and files given here are those to give to ``pretrain_gpt.py``.
``ByteLevelTokenizer`` (megatron-core's byte-level tokenizer) needs no files and no download.

**Sentences** (``--split-sentences``): a paragraph (text between blank lines) is split after
``.``, ``!`` or ``?`` (optionally followed by a closing quote or bracket) followed by
whitespace; a simple rule, not Megatron-LM's NLTK splitter.

**Workers**: ``--workers N`` tokenizes batches of documents in N processes (each builds its
tokenizer once per batch); the output is the same for every N.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

from ..megatron_args import BitPipeConfigError
from ..run_config import TokenizerSettings
from ..usage import USAGE_EXIT_STATUS, FlagParser, UsageError
from .arguments import BYTE_LEVEL_TOKENIZER, BYTE_VOCAB, TOKENIZER_FILES

__all__ = [
    "STDLIB_DOCS",
    "TEXT_DOCUMENTS",
    "CorpusError",
    "DatasetSummary",
    "stdlib_docs",
    "read_documents",
    "split_sentences",
    "tokenizer_settings",
    "write_indexed_datasets",
    "stdlib_docs_dataset",
    "build_parser",
    "main",
]

#: ``--input`` name of the built-in corpus (Python's own documentation topics)
STDLIB_DOCS = "stdlib-docs"
#: ``--text-documents``: how plain-text files are cut into documents
TEXT_DOCUMENTS = ("file", "paragraph", "line")
#: suffixes read as loose JSON (one object per line)
JSON_SUFFIXES = (".json", ".jsonl")
#: documents per batch handed to a worker process
WORKER_BATCH = 256

_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+")


class CorpusError(ValueError):
    """Input that cannot be preprocessed (unreadable line, missing key); names the file."""


@dataclass
class DatasetSummary:
    """What :func:`write_indexed_datasets` wrote for one key."""

    #: path prefix of the ``.bin``/``.idx`` pair (what ``--data-path`` takes)
    prefix: str
    #: documents written
    documents: int
    #: sequences written (documents, or sentences with ``--split-sentences``)
    sequences: int
    #: tokens written, end-of-document tokens included
    tokens: int
    #: documents left out because they have no token for this key
    empty_documents: int
    #: token dtype in the ``.bin`` file
    dtype: str


def stdlib_docs() -> Iterator[Dict[str, str]]:
    """The built-in corpus: ``{"text": topic}`` for each of ``pydoc_data.topics``' topics,
    sorted by name."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield {"text": topics[name]}


def _text_documents(text: str, mode: str) -> List[str]:
    if mode == "file":
        return [text]
    pieces = _PARAGRAPH_BREAK.split(text) if mode == "paragraph" else text.splitlines()
    return [piece for piece in pieces if piece.strip()]


def _json_documents(path: Path, json_keys: Sequence[str]) -> Iterator[Dict[str, str]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{path}:{number}: not a JSON object ({error})") from error
            if not isinstance(record, dict):
                raise CorpusError(f"{path}:{number}: not a JSON object")
            missing = [key for key in json_keys if not isinstance(record.get(key), str)]
            if missing:
                raise CorpusError(f"{path}:{number}: no text under --json-keys {' '.join(missing)}")
            yield {key: record[key] for key in json_keys}


def read_documents(inputs: Sequence[str], json_keys: Sequence[str] = ("text",), text_documents: str = "file") -> Iterator[Dict[str, str]]:
    """The documents of ``inputs`` (see the module docstring), each ``{key: text}`` for
    ``json_keys``; lazily, one input after the other."""
    for source in inputs:
        if source == STDLIB_DOCS:
            yield from stdlib_docs()
            continue
        path = Path(source)
        if path.suffix in JSON_SUFFIXES:
            yield from _json_documents(path, json_keys)
            continue
        for text in _text_documents(path.read_text(encoding="utf-8"), text_documents):
            yield {"text": text}


def split_sentences(text: str) -> List[str]:
    """``text`` cut into sentences (see the module docstring), stripped, none empty."""
    sentences = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        sentences += [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]
    return sentences


def tokenizer_settings(
    tokenizer_type: str = BYTE_LEVEL_TOKENIZER,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
) -> TokenizerSettings:
    """The tokenizer :func:`~megatron_bitpipe.training.data.build_tokenizer` builds, named as the
    pretrain scripts' flags name it (default: byte-level)."""
    return TokenizerSettings(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size)


def _encode(tokenizer, document: Dict[str, str], json_keys: Sequence[str], sentences: bool, append_eod: bool) -> Dict[str, List[List[int]]]:
    """key -> the document's token sequences (one, or one per sentence), empty ones dropped;
    the end-of-document token appended to the last with ``append_eod``."""
    encoded = {}
    for key in json_keys:
        pieces = split_sentences(document[key]) if sentences else [document[key]]
        sequences = [ids for ids in (list(tokenizer.tokenize(piece)) for piece in pieces) if ids]
        if sequences and append_eod:
            sequences[-1].append(tokenizer.eod)
        encoded[key] = sequences
    return encoded


def _encode_batch(settings: TokenizerSettings, json_keys, sentences: bool, append_eod: bool, batch: List[Dict[str, str]]):
    """Worker body: a batch of documents encoded with a tokenizer built from ``settings``."""
    from .data import build_tokenizer

    tokenizer = build_tokenizer(settings)
    return [_encode(tokenizer, document, json_keys, sentences, append_eod) for document in batch]


def _batches(documents: Iterable[Dict[str, str]], size: int) -> Iterator[List[Dict[str, str]]]:
    documents = iter(documents)
    while batch := list(islice(documents, size)):
        yield batch


def write_indexed_datasets(
    documents: Iterable[Dict[str, str]],
    output_prefix: str,
    tokenizer: TokenizerSettings,
    json_keys: Sequence[str] = ("text",),
    *,
    sentences: bool = False,
    append_eod: bool = False,
    workers: int = 1,
    log: Optional[Callable[[str], None]] = None,
    log_interval: int = 1000,
) -> Dict[str, DatasetSummary]:
    """Tokenize ``documents`` (``{key: text}``) and write one Megatron indexed dataset per key
    (see the module docstring); key -> :class:`DatasetSummary`.

    ``tokenizer`` is the tokenizer to encode with (:func:`tokenizer_settings`). ``log`` (if given)
    receives a progress line every ``log_interval`` documents. If reading or tokenizing
    fails, the exception propagates and no partial ``.bin`` file is left behind.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    from .data import build_tokenizer

    built = build_tokenizer(tokenizer)
    dtype = DType.optimal_dtype(built.vocab_size)
    level = "sentence" if sentences else "document"
    prefixes = {key: f"{output_prefix}_{key}_{level}" for key in json_keys}
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {key: IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype) for key, prefix in prefixes.items()}
    counts = {key: dict(documents=0, sequences=0, tokens=0, empty_documents=0) for key in json_keys}

    if workers == 1:
        encoded = (_encode(built, document, json_keys, sentences, append_eod) for document in documents)
        pool = None
    else:
        import multiprocessing

        pool = multiprocessing.Pool(workers)
        encode = partial(_encode_batch, tokenizer, tuple(json_keys), sentences, append_eod)
        encoded = (doc for batch in pool.imap(encode, _batches(documents, WORKER_BATCH)) for doc in batch)
    start, read, complete = time.perf_counter(), 0, False
    try:
        for read, document in enumerate(encoded, 1):
            for key, sequences in document.items():
                count = counts[key]
                if not sequences:
                    count["empty_documents"] += 1
                    continue
                lengths = [len(ids) for ids in sequences]
                builders[key].add_document(np.concatenate(sequences).astype(dtype), lengths)  # numpy: what the builder writes
                count["documents"] += 1
                count["sequences"] += len(lengths)
                count["tokens"] += sum(lengths)
            if log is not None and read % log_interval == 0:
                log(f"processed {read} documents ({read / (time.perf_counter() - start):.1f} documents/s)")
        complete = True
    finally:
        if pool is not None:
            pool.terminate()
        if not complete:  # no half-written .bin without its .idx
            for key, builder in builders.items():
                builder.data_file.close()
                os.remove(get_bin_path(prefixes[key]))
    for key, builder in builders.items():
        builder.finalize(get_idx_path(prefixes[key]))
    return {key: DatasetSummary(prefix=prefixes[key], dtype=np.dtype(dtype).name, **counts[key]) for key in json_keys}


def stdlib_docs_dataset(output_dir: str, tokenizer: Optional[TokenizerSettings] = None) -> str:
    """The ``--data-path`` prefix of the built-in corpus, preprocessed under ``output_dir``
    with ``tokenizer`` (default: byte-level) and ``--append-eod``; written on the first call,
    reused after (the name carries the Python version, whose topics it holds, and the
    tokenizer type: use one ``output_dir`` per set of tokenizer files).

    Call it once before starting ranks (or on one rank, then a barrier): the files are
    written under a temporary name and renamed, the ``.idx`` last, so a present ``.idx``
    means a complete dataset.
    """
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    tokenizer = tokenizer or tokenizer_settings()
    name = f"stdlib_docs_py{sys.version_info.major}{sys.version_info.minor}_{tokenizer.tokenizer_type}"
    prefix = f"{Path(output_dir) / name}_text_document"
    if not os.path.exists(get_idx_path(prefix)):
        partial_prefix = f"{Path(output_dir) / name}.{os.getpid()}.partial"
        written = write_indexed_datasets(stdlib_docs(), partial_prefix, tokenizer, append_eod=True)["text"].prefix
        os.replace(get_bin_path(written), get_bin_path(prefix))
        os.replace(get_idx_path(written), get_idx_path(prefix))
    return prefix


def build_parser() -> FlagParser:
    """``scripts/preprocess_data.py``'s flags (Megatron-LM's ``tools/preprocess_data.py`` names)."""
    parser = FlagParser(
        prog="preprocess_data.py",
        description="Tokenize text or JSON lines into Megatron indexed datasets (.bin/.idx).",
    )
    group = parser.add_argument_group(title="input")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help=f"JSON-lines files (.json, .jsonl), plain-text files, or {STDLIB_DOCS} (Python's own documentation, built in)",
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields of each JSON object to tokenize, one dataset each (default: text)")
    group.add_argument(
        "--text-documents", choices=TEXT_DOCUMENTS, default="file", help="plain-text files: one document per file (default), paragraph or line"
    )
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (BERT's datasets)")
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", choices=tuple(TOKENIZER_FILES), required=True)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary; ByteLevelTokenizer's (at least 256, default 512)")
    group.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    group = parser.add_argument_group(title="output")
    group.add_argument("--output-prefix", required=True, help="written: PREFIX_{key}_{document|sentence}.bin and .idx")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    group.add_argument("--log-interval", type=int, default=1000, help="progress line every this many documents")
    return parser


def _problems(args: argparse.Namespace) -> List[str]:
    problems = []
    for source in args.input:
        if source != STDLIB_DOCS and not Path(source).is_file():
            problems.append(f"--input {source}: no such file (or {STDLIB_DOCS} for the built-in corpus)")
    plain = [s for s in args.input if s == STDLIB_DOCS or (Path(s).is_file() and Path(s).suffix not in JSON_SUFFIXES)]
    if plain and args.json_keys != ["text"]:
        problems.append(f"--json-keys {' '.join(args.json_keys)}: {plain[0]} is plain text, whose only key is text")
    if len(set(args.json_keys)) != len(args.json_keys):
        problems.append("--json-keys: each key once")
    missing = [f"--{name.replace('_', '-')}" for name in TOKENIZER_FILES[args.tokenizer_type] if getattr(args, name) is None]
    if missing:
        problems.append(f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")
    if args.vocab_size is not None and args.vocab_size < (BYTE_VOCAB if args.tokenizer_type == BYTE_LEVEL_TOKENIZER else 1):
        problems.append(f"--vocab-size {args.vocab_size}: too small for {args.tokenizer_type}")
    if args.workers < 1:
        problems.append("--workers must be at least 1")
    if args.log_interval < 1:
        problems.append("--log-interval must be at least 1")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``scripts/preprocess_data.py``: 0 done, 2 bad flags, 1 unusable input (message on stderr).
    The flags are parsed (and ``--help`` printed) before torch or megatron-core is imported."""

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        log(str(error))
        return USAGE_EXIT_STATUS
    from .data import build_tokenizer

    try:
        problems = _problems(args)
        if problems:
            raise BitPipeConfigError("invalid arguments:\n  " + "\n  ".join(problems))
        settings = TokenizerSettings.from_args(args)
        build_tokenizer(settings)  # a broken tokenizer fails here, naming --tokenizer-type
        start = time.perf_counter()
        summaries = write_indexed_datasets(
            read_documents(args.input, args.json_keys, args.text_documents),
            args.output_prefix,
            settings,
            args.json_keys,
            sentences=args.split_sentences,
            append_eod=args.append_eod,
            workers=args.workers,
            log=log,
            log_interval=args.log_interval,
        )
    except BitPipeConfigError as error:
        log(f"error: {error}")
        return USAGE_EXIT_STATUS
    except (CorpusError, OSError, UnicodeDecodeError) as error:
        log(f"error: {error}")
        return 1
    for summary in summaries.values():
        empty = f", {summary.empty_documents} empty documents left out" if summary.empty_documents else ""
        print(
            f"{summary.prefix}.bin/.idx: {summary.documents} documents, {summary.sequences} sequences, "
            f"{summary.tokens} tokens ({summary.dtype}){empty} in {time.perf_counter() - start:.1f} s"
        )
    return 0
