"""``scripts/pretrain_bert.py``'s own flags and their checks (pure Python).

:class:`BertArguments` adds Megatron-LM's BERT flags (``--bert-no-binary-head``,
``--mask-prob``, ``--short-seq-prob``) and checks them with the common ones; the script parses
and checks before it imports torch, megatron-core or :mod:`.bert` (whose
:class:`~.bert.BertTask` inherits these methods).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List

from .task import TaskArguments

__all__ = ["BERT_ROTARY_BASE", "BertArguments", "BertSettings", "MOCK_FIRST_WORD", "MOCK_MIN_LENGTH", "WORDPIECE_TOKENIZERS"]

#: --tokenizer-type values megatron's BERT dataset works with (it needs [CLS], [SEP], [MASK])
WORDPIECE_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")
#: RotaryEmbedding's base in megatron's BertModel (not configurable there)
BERT_ROTARY_BASE = 10000
#: first ordinary token of the mock vocabulary (0-3 are [PAD], [CLS], [SEP], [MASK])
MOCK_FIRST_WORD = 4
#: shortest mock sample: [CLS] word [SEP] word [SEP]
MOCK_MIN_LENGTH = 5


@dataclass(frozen=True)
class BertSettings:
    """BERT's own decisions (:attr:`~megatron_bitpipe.run_config.RunConfig.task_settings`).

    Attributes:
        mask_prob: ``--mask-prob``, the share of tokens masked, in (0, 1).
        short_seq_prob: ``--short-seq-prob``, the share of samples cut short, in [0, 1].
        binary_head: the sentence-order labels are drawn (not ``--bert-no-binary-head``).
    """

    mask_prob: float
    short_seq_prob: float
    binary_head: bool


class BertArguments(TaskArguments):
    """BERT's flags (Megatron-LM's names) and the rules BERT adds to the common ones."""

    def task_settings(self, args: argparse.Namespace) -> BertSettings:
        return BertSettings(mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob, binary_head=args.bert_binary_head)

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
        if args.position_embedding_type == "rope" and args.rotary_base != BERT_ROTARY_BASE:
            problems.append(f"--rotary-base: megatron's BertModel uses {BERT_ROTARY_BASE} (got {args.rotary_base})")
        if args.use_mock_data:
            if args.vocab_size is not None and args.vocab_size <= MOCK_FIRST_WORD:
                problems.append(f"--vocab-size {args.vocab_size}: mock BERT data needs more than {MOCK_FIRST_WORD} tokens")
            if args.seq_length < MOCK_MIN_LENGTH:
                problems.append(f"--seq-length {args.seq_length}: mock BERT samples need at least {MOCK_MIN_LENGTH} positions")
        elif args.tokenizer_type is not None and args.tokenizer_type not in WORDPIECE_TOKENIZERS:
            problems.append(
                f"--data-path: megatron's BERT dataset needs a WordPiece tokenizer "
                f"(--tokenizer-type {' or '.join(WORDPIECE_TOKENIZERS)}), not {args.tokenizer_type}"
            )
        return problems
