"""The schedule command line's model flags (Megatron-LM's names): a
:class:`~.model_shape.ModelShape`, how training stores it (:class:`~.memory.TrainingMemory`)
and the uneven-layout flags (:class:`~.layer_split.LayerSplitFlags`).

The model is optional: without ``--num-layers`` the simulator costs equal stages from the cost
model alone; with it, ``--hidden-size``, ``--num-attention-heads``, ``--seq-length`` and
``--vocab-size`` are required too. Defaults are Megatron-LM's.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .errors import ScheduleConfigError
from .layer_split import EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LOSS_FLAG, LayerSplitFlags
from .memory import OPTIMIZERS, TrainingMemory
from .model_shape import ATTENTION_BACKENDS, NORMALIZATIONS, POSITION_EMBEDDINGS, ModelShape

__all__ = ["add_model_arguments", "layer_split_flags", "model_shape", "training_memory"]

#: the flags a model needs besides --num-layers
_REQUIRED = ("hidden_size", "num_attention_heads", "seq_length", "vocab_size")


def add_model_arguments(parser: argparse.ArgumentParser, layout_flags: bool = True) -> None:
    """The model's flags (a ``model`` group) and, with ``layout_flags``, Megatron-LM's five
    uneven-layout flags."""
    model = parser.add_argument_group(
        "model", "a GPT's shape (Megatron-LM's flags): with --num-layers, each stage is costed from its layers, "
        "the embedding and the head, and memory per rank is reported"
    )
    model.add_argument("--num-layers", type=int, default=None, metavar="L", help="transformer layers")
    model.add_argument("--hidden-size", type=int, default=None, metavar="H")
    model.add_argument("--ffn-hidden-size", type=int, default=None, metavar="F", help="MLP hidden size (default 4 H)")
    model.add_argument("--num-attention-heads", type=int, default=None, metavar="A")
    model.add_argument("--num-query-groups", type=int, default=None, metavar="G",
                       help="key/value heads of grouped-query attention (default: the attention heads)")
    model.add_argument("--seq-length", type=int, default=None, metavar="S")
    model.add_argument("--max-position-embeddings", type=int, default=None, metavar="P", help="default --seq-length")
    model.add_argument("--micro-batch-size", type=int, default=1, metavar="B")
    model.add_argument("--vocab-size", type=int, default=None, metavar="V")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="M")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--swiglu", action="store_true", help="gated MLP (its first linear is 2 F wide)")
    model.add_argument("--disable-bias-linear", action="store_true")
    model.add_argument("--normalization", choices=tuple(NORMALIZATIONS), default="LayerNorm")
    model.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default="learned_absolute")
    model.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="unfused and local keep the s x s attention scores for the backward")
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (default fp32)")
    model.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    model.add_argument("--use-distributed-optimizer", action="store_true",
                       help="shard the optimizer state over each stage's replicas x data-parallel ranks")
    if not layout_flags:
        return
    layout = parser.add_argument_group("uneven stages", "Megatron-LM's flags, counted over one pipeline's stages in pipeline order")
    layout.add_argument(FIRST_FLAG, type=int, default=None, metavar="X", help="transformer layers of the first stage")
    layout.add_argument(LAST_FLAG, type=int, default=None, metavar="Y", help="transformer layers of the last stage")
    layout.add_argument(EMBEDDING_FLAG, action="store_true", help="count the embedding as one layer")
    layout.add_argument(LOSS_FLAG, action="store_true", help="count the loss as one layer")
    layout.add_argument(LAYOUT_FLAG, default=None, metavar="LAYOUT", help="e.g. 'Et|tt|tt|tL': every stage's layers")


def model_shape(args: argparse.Namespace) -> Optional[ModelShape]:
    """The model the flags describe, None without ``--num-layers``; ScheduleConfigError naming
    a missing or bad flag."""
    if args.num_layers is None:
        given = [f"--{k.replace('_', '-')}" for k in _REQUIRED if getattr(args, k) is not None]
        if given or layer_split_flags(args).given:
            raise ScheduleConfigError(f"{', '.join(given + layer_split_flags(args).names)}: the model's flags need --num-layers")
        return None
    missing = [f"--{k.replace('_', '-')}" for k in _REQUIRED if getattr(args, k) is None]
    if missing:
        raise ScheduleConfigError(f"--num-layers needs {', '.join(missing)} too")
    try:
        return ModelShape(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length, vocab_size=args.vocab_size, micro_batch_size=args.micro_batch_size,
            ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups, swiglu=args.swiglu,
            add_bias_linear=not args.disable_bias_linear, normalization=args.normalization,
            position_embedding_type=args.position_embedding_type, max_position_embeddings=args.max_position_embeddings,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, attention_backend=args.attention_backend,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        )  # fmt: skip
    except ValueError as error:
        raise ScheduleConfigError(str(error)) from None


def training_memory(args: argparse.Namespace, data_parallel_size: int) -> TrainingMemory:
    """How the flags store parameters, gradients and optimizer state."""
    return TrainingMemory(args.bf16, args.optimizer, args.use_distributed_optimizer, data_parallel_size)


def layer_split_flags(args: argparse.Namespace) -> LayerSplitFlags:
    """The uneven-layout flags given (none on a parser without them)."""
    return LayerSplitFlags.from_args(args)
