"""BERT pretraining on megatron-core: :class:`BertTask` for the training loop.

* **Model.** megatron-core ``BertModel`` chunks of the schedule's placement (:data:`BERT`)
  (:func:`megatron_bitpipe.model.bert_model.build_bert_chunks`: BitPipe's V, megatron's looped
  1F1B / interleaved placements, a single process), tensor parallelism 1-D only. Megatron-LM's
  BERT: tied embeddings unless ``--untie-embeddings-and-output-weights``, the binary
  (next-sentence) head and two token types unless ``--bert-no-binary-head``. Initial weights
  come from ``--seed`` alone, so every layout starts from the single-process model.
* **Data.** :class:`MockBERTDataset` by default (masking
  ``--mask-prob`` of the words); with ``--data-path``, megatron-core's
  ``BERTMaskedWordPieceDataset`` over Megatron indexed datasets of sentences (one document
  per paragraph, one sequence per sentence, as Megatron-LM's ``preprocess_data.py
  --split-sentences`` writes them), with Megatron-LM's masking settings (``--mask-prob``,
  ``--short-seq-prob``, whole-word 1- to 3-grams) and a WordPiece tokenizer
  (``--tokenizer-type BertWordPieceLowerCase`` or ``BertWordPieceCase``). Every pipeline
  rank reads the micro-batches itself: every chunk needs the padding mask, first chunks the
  tokens and token types, loss chunks (BitPipe: both edge ranks) the labels.
* **Loss.** Megatron-LM's (:func:`bert_loss`): per
  micro-batch the masked-LM cross entropy averaged over its masked tokens plus the
  next-sentence cross entropy averaged over its sequences; reported as ``lm loss`` and
  ``sop loss`` (``lm loss`` only without the binary head), each averaged over the global
  batch's masked tokens / sequences.
* **HFTA** (``--hfta-models B``, :data:`HFTA_BERT`): a fused array of B BERTs
  (:class:`~megatron_bitpipe.hfta.bert.HftaBertChunk`) on the same micro-batches, loss
  :func:`hfta_bert_loss` (each model's :func:`bert_loss`, summed), reports per model.

The pieces work with megatron's own schedules and any training loop too: :class:`MockBERTDataset`
and :func:`collate_bert` give micro-batches in the format of megatron-core's BERT dataset
(:class:`megatron.core.datasets.bert_dataset.BERTMaskedWordPieceDataset`: ``text`` token ids,
``types`` segment 0 / 1, ``labels`` original token where masked and -1 elsewhere,
``loss_mask`` 1 where masked, ``padding_mask`` 1 for tokens, all ``[b, s]`` int64, and
``is_random`` ``[b]``, 1 if the second segment is a random one); :func:`bert_forward_step` is a
megatron ``forward_step_func`` whose loss (:func:`bert_loss`) is returned in megatron-core's
three-value form (loss times masked-token count, the count, sum/count reports): megatron's
``forward_step`` divides by the count and by the number of micro-batches (the BitPipe runtime
by the number per replica, :func:`megatron_bitpipe.execution.replicas.microbatches_per_replica`),
so the gradient is that of the mean micro-batch loss over the global batch, whatever the
layout. Per-token loss (``calculate_per_token_loss``) is not supported: the next-sentence loss
is per sequence.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy
import torch
import torch.nn.functional as F
from megatron.core.utils import get_model_config, unwrap_model

from ..hfta.bert import HftaBertChunk, hfta_bert_layer_spec
from ..hfta.reports import hfta_iteration_losses, hfta_loss_names, model_loss
from ..model.bert_model import build_bert_chunks, default_bert_layer_spec
from ..run_config import RunConfig
from .bert_args import MOCK_FIRST_WORD, MOCK_MIN_LENGTH, WORDPIECE_TOKENIZERS, BertArguments, BertSettings
from .data import indexed_datasets
from .model_kind import (
    ModelKind, core_attention, fused_p2p_shapes, is_fused_array, local_layer_spec, no_p2p_adjustment, own_iteration_losses,
)  # fmt: skip
from .task import PretrainTask

__all__ = [
    "BERT",
    "BERT_KEYS",
    "BertTask",
    "HFTA_BERT",
    "KINDS",
    "MOCK_VALID_OFFSET",
    "MockBERTDataset",
    "WORDPIECE_TOKENIZERS",
    "bert_forward_step",
    "bert_loss",
    "bert_losses",
    "bert_microbatches",
    "collate_bert",
    "hfta_bert_loss",
]

BERT_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")

# Token ids of the mock vocabulary; ordinary tokens are [_FIRST_WORD, vocab_size).
_PAD, _CLS, _SEP, _MASK, _FIRST_WORD = 0, 1, 2, 3, MOCK_FIRST_WORD


class MockBERTDataset(torch.utils.data.Dataset):
    """Deterministic synthetic BERT samples: sample ``i`` depends only on ``(seed, i)`` (a NumPy
    generator seeded with both).

    Each sample is ``[CLS] A [SEP] B [SEP]`` followed by padding, with a length drawn from
    ``[min_length, seq_length]`` (``min_length`` defaults to half the sequence, at least 5),
    A and B non-empty random words; ``max(1, round(mask_prob x words))`` word positions are
    replaced by ``[MASK]`` and become the MLM targets; ``is_random`` is a fair coin.
    Token ids: 0 padding, 1 CLS, 2 SEP, 3 MASK, words 4..vocab_size-1.
    """

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        mask_prob: float = 0.15,
        min_length: Optional[int] = None,
    ):
        min_length = max(MOCK_MIN_LENGTH, seq_length // 2) if min_length is None else min_length
        if vocab_size <= _FIRST_WORD:
            raise ValueError(f"--vocab-size {vocab_size}: the mock BERT data needs more than {_FIRST_WORD} tokens")
        if not MOCK_MIN_LENGTH <= min_length <= seq_length:
            raise ValueError(f"--seq-length {seq_length}: mock BERT samples need at least {MOCK_MIN_LENGTH} positions")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"--mask-prob {mask_prob} must be in (0, 1)")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.mask_prob = mask_prob
        self.min_length = min_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        rng = numpy.random.default_rng([self.seed, index])
        length = int(rng.integers(self.min_length, self.seq_length, endpoint=True))
        words_a = int(rng.integers(1, length - 4, endpoint=True))
        words_b = length - 3 - words_a
        text = numpy.full(self.seq_length, _PAD, dtype=numpy.int64)
        text[:length] = rng.integers(_FIRST_WORD, self.vocab_size, length)
        text[[0, 1 + words_a, length - 1]] = (_CLS, _SEP, _SEP)
        types = numpy.zeros(self.seq_length, dtype=numpy.int64)
        types[2 + words_a : length] = 1
        words = numpy.array([p for p in range(1, length - 1) if p != 1 + words_a])
        count = max(1, round(self.mask_prob * (words_a + words_b)))
        masked = rng.permutation(words)[:count]
        labels = numpy.full(self.seq_length, -1, dtype=numpy.int64)
        labels[masked] = text[masked]
        text[masked] = _MASK
        loss_mask = numpy.zeros(self.seq_length, dtype=numpy.int64)
        loss_mask[masked] = 1
        padding_mask = numpy.zeros(self.seq_length, dtype=numpy.int64)
        padding_mask[:length] = 1
        is_random = int(rng.integers(0, 1, endpoint=True))
        return {
            "text": torch.from_numpy(text),
            "types": torch.from_numpy(types),
            "labels": torch.from_numpy(labels),
            "is_random": torch.tensor(is_random),
            "loss_mask": torch.from_numpy(loss_mask),
            "padding_mask": torch.from_numpy(padding_mask),
        }


def collate_bert(samples: Sequence[Mapping[str, object]]) -> Dict[str, torch.Tensor]:
    """Stack samples (tensors, NumPy arrays or ints, as megatron's dataset gives them) into a
    micro-batch of int64 tensors with the :data:`BERT_KEYS`; other keys are dropped."""
    batch = torch.utils.data.default_collate([{k: sample[k] for k in BERT_KEYS} for sample in samples])
    return {k: v.long() for k, v in batch.items()}


def bert_microbatches(
    dataset: torch.utils.data.Dataset, first_sample: int, num_microbatches: int, micro_batch_size: int
) -> List[Dict[str, torch.Tensor]]:
    """``num_microbatches`` consecutive micro-batches of ``dataset`` from sample ``first_sample``."""
    return [
        collate_bert([dataset[first_sample + m * micro_batch_size + i] for i in range(micro_batch_size)])
        for m in range(num_microbatches)
    ]


def bert_loss(
    loss_mask: torch.Tensor, is_random: Optional[torch.Tensor], output: Tuple[torch.Tensor, Optional[torch.Tensor]]
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Loss of one micro-batch from a BERT post-process chunk's ``(per-token MLM loss [b, s],
    binary logits [b, 2] or None)``, in megatron-core's three-value form.

    The micro-batch loss is Megatron-LM's ``lm + sop``: ``lm`` the MLM cross entropy averaged
    over the ``n`` positions with ``loss_mask`` 1 (``n >= 1``), ``sop`` the binary-head cross
    entropy against ``is_random`` averaged over the sequences (-1 ignored; 0 without a binary
    head). Returns ``(n * (lm + sop), n, reports)``: megatron-core's ``forward_step`` divides
    the first by ``n`` (and by the micro-batches). ``reports`` (detached, Megatron-LM's names)
    are ``{"lm loss": [lm sum, n], "sop loss": [sop sum, sequences]}`` (no "sop loss" without
    a binary head): sum and count, so a training loop can average them over any set of
    micro-batches and data-parallel ranks.
    """
    per_token, binary_logits = output
    mask = loss_mask.float().reshape(-1)
    num_masked = mask.sum()
    lm_sum = torch.sum(per_token.float().reshape(-1) * mask)
    reports = {"lm loss": torch.stack([lm_sum.detach(), num_masked])}
    loss_sum = lm_sum
    if binary_logits is not None:
        labels = is_random.reshape(-1)
        sop_sum = F.cross_entropy(binary_logits.reshape(-1, 2).float(), labels, ignore_index=-1, reduction="sum")
        sequences = (labels != -1).sum().float()
        loss_sum = lm_sum + num_masked * sop_sum / sequences
        reports["sop loss"] = torch.stack([sop_sum.detach(), sequences])
    return loss_sum, num_masked.to(torch.int), reports


def hfta_bert_loss(
    num_models: int, loss_mask: torch.Tensor, is_random: Optional[torch.Tensor], output: Tuple[torch.Tensor, Optional[torch.Tensor]]
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """:func:`bert_loss` of a fused array of ``num_models`` BERTs
    (:class:`~megatron_bitpipe.hfta.bert.HftaBertChunk`: per-token MLM loss ``[B*b, s]``, binary
    logits ``[B*b, 2]`` or None, model ``k``'s in rows ``k*b ..``), every model on the same
    micro-batch: ``(Σ_k loss_sum_k, n, reports)`` with model ``k``'s ``loss_sum_k`` and reports
    its :func:`bert_loss`, so megatron's division by the one masked-token count ``n`` gives each
    model its own gradient. Reports: ``lm loss`` / ``sop loss`` the models' mean (sums averaged
    over the models, the counts one model's), ``lm loss k`` / ``sop loss k`` model ``k``'s."""
    per_token, binary_logits = output
    per_token = per_token.reshape(num_models, -1, per_token.shape[-1])
    binary = [None] * num_models if binary_logits is None else binary_logits.reshape(num_models, -1, 2)
    losses, reports = [], {}
    for k in range(num_models):
        loss_k, num_masked, reports_k = bert_loss(loss_mask, is_random, (per_token[k], binary[k]))
        losses.append(loss_k)
        reports.update({model_loss(name, k): report for name, report in reports_k.items()})
    for name, report in reports_k.items():
        mean = torch.stack([reports[model_loss(name, k)][0] for k in range(num_models)]).mean()
        reports[name] = torch.stack([mean, report[1]])
    return torch.stack(losses).sum(), num_masked, reports


def bert_forward_step(data_iterator: Iterator, model: torch.nn.Module, loss_func: Callable = bert_loss):
    """megatron ``forward_step_func`` for BERT on :func:`collate_bert` micro-batches.

    Every chunk reads the next micro-batch from its iterator: every pipeline rank needs data,
    since every chunk needs the padding mask (first chunks also the tokens and types, loss
    chunks the labels, loss mask and ``is_random``). Token types are passed iff the model has
    token-type embeddings. ``loss_func(loss_mask, is_random, output)`` is the loss
    (:func:`bert_loss`; a fused array's :func:`hfta_bert_loss` with its B bound). ValueError
    naming ``--calculate-per-token-loss`` if the config asks for per-token loss.
    """
    if get_model_config(model).calculate_per_token_loss:
        raise ValueError(
            "BERT's loss is per micro-batch (the next-sentence loss is per sequence); drop --calculate-per-token-loss"
        )
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    inner = unwrap_model(model)
    with_types = inner.pre_process and inner.embedding.tokentype_embeddings is not None
    output = model(
        batch["text"],
        batch["padding_mask"],
        tokentype_ids=batch["types"] if with_types else None,
        lm_labels=batch["labels"],
    )
    return output, functools.partial(loss_func, batch["loss_mask"], batch["is_random"])


#: mock validation samples are samples MOCK_VALID_OFFSET... of the generator, far from training's
MOCK_VALID_OFFSET = 1 << 40


class BertTask(BertArguments, PretrainTask):
    """BERT with megatron-core; see the module docstring. Its kinds: :data:`BERT`,
    :data:`HFTA_BERT` (``--hfta-models``)."""

    name = "bert"

    def model_flags(self):
        return {**super().model_flags(), "--bert-no-binary-head": lambda a: not getattr(a, "bert_binary_head", True)}

    def build_datasets(self, run: RunConfig, tokenizer):
        settings = _bert_settings(run)
        train_samples = run.data.train_samples
        valid_samples = run.data.eval_iters * run.batches.global_batch_size
        if run.data.mock:
            data = MockBERTDataset(
                MOCK_VALID_OFFSET + valid_samples, run.batches.seq_length, tokenizer.vocab_size, run.seed, mask_prob=settings.mask_prob
            )
            valid = torch.utils.data.Subset(data, range(MOCK_VALID_OFFSET, MOCK_VALID_OFFSET + valid_samples))
            return torch.utils.data.Subset(data, range(train_samples)), (valid if valid_samples else None), None
        from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig

        return indexed_datasets(
            run,
            tokenizer,
            BERTMaskedWordPieceDataset,
            BERTMaskedWordPieceDatasetConfig,
            masking_probability=settings.mask_prob,
            short_sequence_probability=settings.short_seq_prob,
            masking_max_ngram=3,
            masking_do_full_word=True,
            masking_do_permutation=False,
            masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False,
            classification_head=settings.binary_head,
        )


def _bert_settings(run: RunConfig) -> BertSettings:
    """BERT's own decisions in ``run``; ValueError for a run made without the BERT task."""
    if not isinstance(run.task_settings, BertSettings):
        raise ValueError("a BERT run's RunConfig needs BERT's settings: RunConfig.from_args(args, vocab_size, task)")
    return run.task_settings


def bert_losses(run: RunConfig) -> Tuple[str, ...]:
    """The losses one BERT reports: ``lm loss`` and ``sop loss``, ``lm loss`` only without the binary head."""
    return ("lm loss", "sop loss") if _bert_settings(run).binary_head else ("lm loss",)


def _binary_head(run: RunConfig) -> dict:
    return dict(add_binary_head=_bert_settings(run).binary_head)


#: megatron-core ``BertModel`` chunks (:func:`~megatron_bitpipe.model.bert_model.build_bert_chunks`,
#: the local layer spec, with SDPA's core attention under ``--attention-backend sdpa``),
#: Megatron-LM's loss (:func:`bert_forward_step`)
BERT = ModelKind(
    name="bert",
    task=BertTask.name,
    chosen_when=None,
    chunk_builder=build_bert_chunks,
    layer_spec=local_layer_spec(default_bert_layer_spec),
    chunk_kwargs=_binary_head,
    forward_step=lambda run: bert_forward_step,
    loss_names=bert_losses,
    iteration_losses=own_iteration_losses,
    p2p_shapes=no_p2p_adjustment,
    causal_attention=False,
)

#: a fused array of ``--hfta-models`` BERTs (:class:`~megatron_bitpipe.hfta.bert.HftaBertChunk`),
#: loss :func:`hfta_bert_loss`: reports the models' means and ``lm loss k`` / ``sop loss k`` per model
HFTA_BERT = replace(
    BERT,
    name="hfta-bert",
    chosen_when=is_fused_array,
    layer_spec=lambda run, config: hfta_bert_layer_spec(run.hfta.num_models, core_attention(run)),
    chunk_kwargs=lambda run: dict(_binary_head(run), model_class=HftaBertChunk, hfta=run.hfta),
    forward_step=lambda run: functools.partial(
        bert_forward_step, loss_func=functools.partial(hfta_bert_loss, run.hfta.num_models)
    ),
    loss_names=lambda run: hfta_loss_names(bert_losses(run), run.hfta.num_models),
    iteration_losses=lambda run, losses: hfta_iteration_losses(losses, bert_losses(run), run.hfta.num_models),
    p2p_shapes=fused_p2p_shapes,
)

#: the BERT task's kinds, for :mod:`.model_registry`
KINDS = (BERT, HFTA_BERT)
