"""Data for any task: tokenizers, the global-batch order, and micro-batch assembly.

**Order.** Datasets are random-access sequences of samples (dicts of tensors). Iteration
``i`` (0-based) trains on the global batch of samples ``[c, c + global_batch_size)`` with
``c`` the samples consumed before it (``i x --global-batch-size`` without changes of the batch
size), whatever the layout; data-parallel rank ``r`` takes micro-batch ``m`` of it as samples
``c + (m x dp + r) x mbs ... + mbs`` (Megatron-LM's sampler). Resuming from a checkpoint
continues at its consumed-sample count, so the data after a resume are those an
uninterrupted run would have seen. Every rank reads its micro-batches itself (the datasets
are deterministic), which costs the ranks that need no tokens a little reading and saves
a broadcast.

**Megatron indexed datasets** (``--data-path``) come from megatron-core's
``BlendedMegatronDatasetBuilder`` (:func:`indexed_datasets`): ``--train-iters`` and
``--eval-iters`` global batches of samples (ABS-SGD: as far as any replica's stream can
reach, :func:`~.abs_sgd.dataset_train_samples`), the blend and ``--split`` of the flags.

**Evaluation** always runs on the first ``--eval-iters`` global batches of the validation
set, so successive validation losses are comparable and do not depend on resumes.

**Tokenizers** are megatron-core's (``megatron.core.tokenizers``), selected with
Megatron-LM's ``--tokenizer-type`` and file flags; mock data without ``--tokenizer-type``
uses the null tokenizer of ``--vocab-size`` tokens (plus end-of-document).
``--tokenizer-type ByteLevelTokenizer`` is megatron-core's byte-level tokenizer (library
``byte-level``; not one of Megatron-LM's choices): a token is a UTF-8 byte, the
end-of-document token is 0 (the NUL byte, absent from text), the vocabulary
``--vocab-size`` (at least 256; megatron-core's default 512). It needs no files and no
download, which makes it the tokenizer of the built-in corpus
(:mod:`megatron_bitpipe.training.preprocess`).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..megatron_args import BitPipeConfigError
from .abs_sgd.args import dataset_train_samples

__all__ = ["BYTE_LEVEL_TOKENIZER", "build_tokenizer", "indexed_datasets", "microbatches", "collate"]


#: --tokenizer-type of megatron-core's byte-level tokenizer
BYTE_LEVEL_TOKENIZER = "ByteLevelTokenizer"


def build_tokenizer(args: argparse.Namespace):
    """megatron-core's tokenizer for the flags (``tokenizer_type``, ``vocab_file``,
    ``merge_file``, ``tokenizer_model``, ``vocab_size``); BitPipeConfigError naming the flag
    if it fails."""
    if args.tokenizer_type == BYTE_LEVEL_TOKENIZER:
        from megatron.core.tokenizers import MegatronTokenizer

        size = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, **size)
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as megatron_build

    settings = SimpleNamespace(
        tokenizer_type=args.tokenizer_type or "NullTokenizer",
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        tokenizer_metadata=None,
        tokenizer_special_tokens=None,
        tokenizer_hf_use_fast=True,
        tokenizer_hf_include_special_tokens=False,
        trust_remote_code=False,
        tokenizer_sentencepiece_legacy=False,
        tiktoken_pattern=None,
        tiktoken_num_special_tokens=1000,
    )
    try:
        return megatron_build(settings)
    except Exception as error:  # noqa: BLE001 - missing files or libraries: say which flag
        raise BitPipeConfigError(f"--tokenizer-type {settings.tokenizer_type}: cannot build the tokenizer: {error}") from error


def indexed_datasets(args: argparse.Namespace, tokenizer, dataset_class, config_class, **fields) -> Tuple[object, Optional[object]]:
    """``(train, valid)`` megatron-core datasets of ``dataset_class`` over the ``--data-path``
    blend (valid None with ``--eval-iters 0``).

    ``config_class`` (a ``BlendedMegatronDatasetConfig``) gets the common fields from the
    flags (``--seed``, ``--seq-length``, ``--data-path``, ``--split``, ``--data-cache-path``,
    the tokenizer, memory-mapped ``.bin`` files) and the task's ``fields``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    config = config_class(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        mmap_bin_files=True,
        **fields,
    )
    samples = [dataset_train_samples(args), args.eval_iters * args.global_batch_size, 0]
    train, valid, _ = BlendedMegatronDatasetBuilder(dataset_class, samples, lambda: True, config).build()
    return train, (valid if args.eval_iters > 0 else None)


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack samples into a micro-batch (keys of the first sample; ``attention_mask`` dropped:
    the models build their causal or padding masks themselves)."""
    keys = [k for k in samples[0] if k != "attention_mask"]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


def microbatches(dataset, first_sample: int, args, dp_rank: int) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch starting at sample
    ``first_sample`` (training: the consumed samples; evaluation batch ``k``: ``k x
    --global-batch-size``)."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    batches = []
    for m in range(args.num_microbatches):
        start = first_sample + (m * dp + dp_rank) * mbs
        batches.append(collate([dataset[start + j] for j in range(mbs)]))
    return batches
