"""BERT pretraining on megatron-core: :class:`BertTask` for the training loop.

* **Model.** megatron-core ``BertModel`` chunks of the schedule's placement
  (:func:`megatron_bitpipe.runtime.bert.build_bert_chunks`: BitPipe's V, megatron's looped
  1F1B / interleaved placements, a single process), tensor parallelism 1-D only. Megatron-LM's
  BERT: tied embeddings unless ``--untie-embeddings-and-output-weights``, the binary
  (next-sentence) head and two token types unless ``--bert-no-binary-head``. Initial weights
  come from ``--seed`` alone, so every layout starts from the single-process model.
* **Data.** :class:`~megatron_bitpipe.bert_pretraining.MockBERTDataset` by default (masking
  ``--mask-prob`` of the words); with ``--data-path``, megatron-core's
  ``BERTMaskedWordPieceDataset`` over Megatron indexed datasets of sentences (one document
  per paragraph, one sequence per sentence, as Megatron-LM's ``preprocess_data.py
  --split-sentences`` writes them), with Megatron-LM's masking settings (``--mask-prob``,
  ``--short-seq-prob``, whole-word 1- to 3-grams) and a WordPiece tokenizer
  (``--tokenizer-type BertWordPieceLowerCase`` or ``BertWordPieceCase``). Every pipeline
  rank reads the micro-batches itself: every chunk needs the padding mask, first chunks the
  tokens and token types, loss chunks (BitPipe: both edge ranks) the labels.
* **Loss.** Megatron-LM's (:func:`~megatron_bitpipe.bert_pretraining.bert_loss`): per
  micro-batch the masked-LM cross entropy averaged over its masked tokens plus the
  next-sentence cross entropy averaged over its sequences; reported as ``lm loss`` and
  ``sop loss`` (``lm loss`` only without the binary head), each averaged over the global
  batch's masked tokens / sequences.
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from ..bert_pretraining import MockBERTDataset, bert_forward_step
from ..runtime.bert import build_bert_chunks
from ..schedules.placement import Placement
from .data import indexed_datasets
from .model import build_model
from .task import PretrainTask

__all__ = ["BertTask", "WORDPIECE_TOKENIZERS", "MOCK_VALID_OFFSET"]

#: --tokenizer-type values megatron's BERT dataset works with (it needs [CLS], [SEP], [MASK])
WORDPIECE_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")
#: mock validation samples are samples MOCK_VALID_OFFSET... of the generator, far from training's
MOCK_VALID_OFFSET = 1 << 40
#: RotaryEmbedding's base in megatron's BertModel (not configurable there)
_BERT_ROTARY_BASE = 10000
#: the mock data's special tokens (padding, [CLS], [SEP], [MASK]) and shortest sample
_MOCK_SPECIAL_TOKENS, _MOCK_MIN_LENGTH = 4, 5


class BertTask(PretrainTask):
    """BERT with megatron-core; see the module docstring.

    :attr:`loss_names` follows ``--bert-no-binary-head`` once :meth:`build_model` has seen the
    flags (the loop builds the model before it reports any loss).
    """

    name = "bert"
    loss_names = ("lm loss", "sop loss")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group(title="BERT")
        group.add_argument(
            "--bert-no-binary-head",
            action="store_false",
            dest="bert_binary_head",
            help="no next-sentence (binary) head, no token types, no sop loss",
        )
        group.add_argument("--mask-prob", type=float, default=0.15, help="share of the words masked for the MLM loss")
        group.add_argument(
            "--short-seq-prob",
            type=float,
            default=0.1,
            help="probability of a shorter sample (megatron's BERT dataset; --data-path only)",
        )

    def validate(self, args: argparse.Namespace) -> List[str]:
        problems = []
        if args.tensor_parallel_mode != "1d":
            problems.append(f"--tensor-parallel-mode {args.tensor_parallel_mode} supports GPT only; BERT runs with 1d")
        if not 0.0 < args.mask_prob < 1.0:
            problems.append(f"--mask-prob must be in (0, 1) (got {args.mask_prob})")
        if not 0.0 <= args.short_seq_prob <= 1.0:
            problems.append(f"--short-seq-prob must be in [0, 1] (got {args.short_seq_prob})")
        if args.eod_mask_loss:
            problems.append("--eod-mask-loss applies to GPT only (BERT's loss is on its masked tokens)")
        if args.position_embedding_type == "rope" and args.rotary_base != _BERT_ROTARY_BASE:
            problems.append(f"--rotary-base: megatron's BertModel uses {_BERT_ROTARY_BASE} (got {args.rotary_base})")
        if args.use_mock_data:
            if args.vocab_size is not None and args.vocab_size <= _MOCK_SPECIAL_TOKENS:
                problems.append(f"--vocab-size {args.vocab_size}: mock BERT data needs more than {_MOCK_SPECIAL_TOKENS} tokens")
            if args.seq_length < _MOCK_MIN_LENGTH:
                problems.append(f"--seq-length {args.seq_length}: mock BERT samples need at least {_MOCK_MIN_LENGTH} positions")
        elif args.tokenizer_type is not None and args.tokenizer_type not in WORDPIECE_TOKENIZERS:
            problems.append(
                f"--data-path: megatron's BERT dataset needs a WordPiece tokenizer "
                f"(--tokenizer-type {' or '.join(WORDPIECE_TOKENIZERS)}), not {args.tokenizer_type}"
            )
        return problems

    def model_signature(self, args: argparse.Namespace):
        return {**super().model_signature(args), "--bert-no-binary-head": not args.bert_binary_head}

    def build_model(self, args: argparse.Namespace, placement: Placement):
        self.loss_names = ("lm loss", "sop loss") if args.bert_binary_head else ("lm loss",)
        return build_model(args, placement, chunk_builder=build_bert_chunks, add_binary_head=args.bert_binary_head)

    def forward_step(self, data_iterator, model):
        return bert_forward_step(data_iterator, model)

    def build_datasets(self, args: argparse.Namespace, tokenizer):
        train_samples = args.train_iters * args.global_batch_size
        valid_samples = args.eval_iters * args.global_batch_size
        if args.use_mock_data:
            data = MockBERTDataset(
                MOCK_VALID_OFFSET + valid_samples, args.seq_length, tokenizer.vocab_size, args.seed, mask_prob=args.mask_prob
            )
            valid = torch.utils.data.Subset(data, range(MOCK_VALID_OFFSET, MOCK_VALID_OFFSET + valid_samples))
            return torch.utils.data.Subset(data, range(train_samples)), (valid if valid_samples else None)
        from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig

        return indexed_datasets(
            args,
            tokenizer,
            BERTMaskedWordPieceDataset,
            BERTMaskedWordPieceDatasetConfig,
            masking_probability=args.mask_prob,
            short_sequence_probability=args.short_seq_prob,
            masking_max_ngram=3,
            masking_do_full_word=True,
            masking_do_permutation=False,
            masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False,
            classification_head=args.bert_binary_head,
        )
