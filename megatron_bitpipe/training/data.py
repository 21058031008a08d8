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
``--eval-iters`` global batches of samples (``--eval-iters`` for the test split too; ABS-SGD's
training set: as far as any replica's stream can reach,
:attr:`~megatron_bitpipe.run_config.DataSettings.train_samples`), the blend and ``--split`` of
the run's :class:`~megatron_bitpipe.run_config.DataSettings`.

**Evaluation** always runs on the first ``--eval-iters`` global batches of the validation
set, so successive validation losses are comparable and do not depend on resumes; the test
set, where ``--split`` gives it a share, is evaluated the same way once, after training.

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

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import megatron_compat
from ..megatron_args import BitPipeConfigError
from ..run_config import RunConfig, TokenizerSettings
from .arguments import BYTE_LEVEL_TOKENIZER

__all__ = ["BYTE_LEVEL_TOKENIZER", "build_tokenizer", "indexed_datasets", "microbatches", "collate"]


def build_tokenizer(settings: TokenizerSettings):
    """megatron-core's tokenizer of ``settings``; BitPipeConfigError naming the flag if it fails."""
    if settings.tokenizer_type == BYTE_LEVEL_TOKENIZER:
        from megatron.core.tokenizers import MegatronTokenizer

        size = {} if settings.vocab_size is None else {"vocab_size": settings.vocab_size}
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, **size)
    tokenizer_type = settings.tokenizer_type or "NullTokenizer"
    try:
        return megatron_compat.build_tokenizer(
            tokenizer_type,
            vocab_file=settings.vocab_file,
            merge_file=settings.merge_file,
            tokenizer_model=settings.tokenizer_model,
            vocab_size=settings.vocab_size,
        )
    except Exception as error:  # noqa: BLE001 - missing files or libraries: say which flag
        raise BitPipeConfigError(f"--tokenizer-type {tokenizer_type}: cannot build the tokenizer: {error}") from error


#: megatron-core's splits, in the order of its split matrix
_SPLITS = ("training", "validation", "test")


def _split_elements(dataset_class, config, prefix: str, split: int) -> int:
    """Elements (sequences or documents, as ``dataset_class`` splits) of ``prefix`` that
    megatron-core's builder gives to split ``split`` (its rounding of the ``--split`` shares)."""
    share = config.split_matrix[split]
    if share is None:
        return 0
    elements = dataset_class.numel_low_level_dataset(dataset_class.build_low_level_dataset(prefix, config))
    return int(round(share[1] * elements)) - int(round(share[0] * elements))


def indexed_datasets(
    run: RunConfig, tokenizer, dataset_class, config_class, **fields
) -> Tuple[object, Optional[object], Optional[object]]:
    """``(train, valid, test)`` megatron-core datasets of ``dataset_class`` over ``run``'s
    ``--data-path`` blend: ``run.data.train_samples`` training samples and ``--eval-iters``
    global batches of validation and of test samples (valid and test None with
    ``--eval-iters 0``; test None unless ``--split`` gives it a part of every dataset of the
    blend).

    ``config_class`` (a ``BlendedMegatronDatasetConfig``) gets the common fields from ``run``
    (``--seed``, ``--seq-length``, ``--data-path``, ``--split``, ``--data-cache-path``,
    the tokenizer, memory-mapped ``.bin`` files) and the task's ``fields``. megatron-core's
    builder would loop forever on a split with a share but no data (a small corpus and the
    default ``--split 969, 30, 1``): such a split is left out, and BitPipeConfigError names
    ``--split`` if it is the training set or, with evaluation, the validation set.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    data = run.data
    blend = get_blend_from_list(list(data.paths))
    config = config_class(
        random_seed=run.seed,
        sequence_length=run.batches.seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=data.cache_path,
        tokenizer=tokenizer,
        mmap_bin_files=True,
        **fields,
    )
    needed = (True, data.eval_iters > 0, False)
    held = []
    for split, name in enumerate(_SPLITS):
        empty = [prefix for prefix in blend[0] if _split_elements(dataset_class, config, prefix, split) < 1]
        if empty and needed[split]:
            extra = " or set --eval-iters 0" if split else ""
            raise BitPipeConfigError(f"--split {data.split}: the {name} set gets no data of {empty[0]}; give it a larger share{extra}")
        held.append(not empty)
    config.split_matrix = [share if has_data else None for share, has_data in zip(config.split_matrix, held)]
    evaluated = data.eval_iters * run.batches.global_batch_size
    samples = [data.train_samples, evaluated, evaluated]
    train, valid, test = BlendedMegatronDatasetBuilder(dataset_class, samples, lambda: True, config).build()
    if data.eval_iters == 0:
        return train, None, None
    return train, valid, test


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack samples into a micro-batch (keys of the first sample; ``attention_mask`` dropped:
    the models build their causal or padding masks themselves)."""
    keys = [k for k in samples[0] if k != "attention_mask"]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


def microbatches(dataset, first_sample: int, run: RunConfig, dp_rank: int) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of ``run``'s global batch starting at sample
    ``first_sample`` (training: the consumed samples; evaluation batch ``k``: ``k x
    --global-batch-size``)."""
    mbs, dp = run.batches.micro_batch_size, run.layout.data
    batches = []
    for m in range(run.batches.num_microbatches):
        start = first_sample + (m * dp + dp_rank) * mbs
        batches.append(collate([dataset[start + j] for j in range(mbs)]))
    return batches
