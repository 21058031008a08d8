"""Megatron-style command-line flags of Optimus 2D.

``add_optimus_args`` has the signature Megatron-LM expects of ``extra_args_provider``
(takes a parser, returns it). ``validate_optimus_args`` checks the parsed arguments before
any process group exists.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .validation import unsupported_features, check_optimus_settings

TENSOR_PARALLEL_MODES = ("1d", "optimus2d")


def add_optimus_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--tensor-parallel-mode {1d,optimus2d}`` (default ``1d``, megatron's own TP)."""
    group = parser.add_argument_group(title="optimus 2D tensor parallelism")
    group.add_argument(
        "--tensor-parallel-mode",
        choices=TENSOR_PARALLEL_MODES,
        default="1d",
        help="1d: megatron-core tensor parallelism. optimus2d: SUMMA 2-D tensor parallelism "
        "(Optimus) over a q x q mesh; --tensor-model-parallel-size must be q*q and the "
        "micro-batch, hidden size, heads and FFN size divisible by q.",
    )
    return parser


def validate_optimus_args(args: argparse.Namespace) -> Optional[int]:
    """Check Megatron-LM arguments for ``--tensor-parallel-mode optimus2d``.

    Returns the mesh side q, or ``None`` in ``1d`` mode. Raises ValueError naming every
    offending flag. Reads Megatron-LM's argument names; absent ones are not checked.
    """
    if getattr(args, "tensor_parallel_mode", "1d") != "optimus2d":
        return None
    hidden = getattr(args, "hidden_size", None)
    ffn = getattr(args, "ffn_hidden_size", None)
    if ffn is None and hidden is not None:
        ffn = 4 * hidden
    groups = (
        getattr(args, "num_query_groups", None)
        if getattr(args, "group_query_attention", False)
        else None
    )
    return check_optimus_settings(
        getattr(args, "tensor_model_parallel_size", 1),
        divisible_by_side={
            "--micro-batch-size": getattr(args, "micro_batch_size", None),
            "--hidden-size": hidden,
            "--num-attention-heads": getattr(args, "num_attention_heads", None),
            "--num-query-groups": groups,
            "--ffn-hidden-size": ffn,
        },
        divisible_by_tp_size={"padded vocabulary size": getattr(args, "padded_vocab_size", None)},
        unsupported=unsupported_features(args),
    )
