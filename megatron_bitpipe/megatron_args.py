"""Megatron-style command-line flags of megatron-bitpipe and their checks.

:func:`add_bitpipe_args` has the signature Megatron-LM expects of ``extra_args_provider``
(takes a parser, returns it) and adds

* ``--pipeline-schedule {default,1f1b,interleaved,bitpipe}`` — ``default`` keeps
  megatron-core's choice (interleaved when ``--virtual-pipeline-model-parallel-size`` is
  set, else 1F1B);
* ``--split-backward`` — with ``bitpipe``: run every backward as the input gradient and,
  later, the weight gradients, placed into the pipeline's bubbles
  (:mod:`megatron_bitpipe.schedules.split_backward`); megatron-core's local layers only;
* ``--tensor-parallel-mode {1d,optimus2d}`` (:mod:`megatron_bitpipe.optimus.args`).

:func:`validate_bitpipe_args` checks a parsed namespace (Megatron-LM's argument names)
before any process group exists and raises :class:`BitPipeConfigError` naming every flag
that breaks a rule. :func:`recompute_problems` holds Megatron-LM's activation-recompute rules
(``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``,
``--recompute-modules``) for model chunks of a given number of layers.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List, Optional

from .optimus.args import add_optimus_args, validate_optimus_args

PIPELINE_SCHEDULES = ("default", "1f1b", "interleaved", "bitpipe")


class BitPipeConfigError(ValueError):
    """Invalid combination of command-line flags; the message names each flag and its rule."""


def add_bitpipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="megatron-bitpipe")
    group.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        default="default",
        help="pipeline schedule: bitpipe (bidirectional V, two weight replicas), 1f1b, "
        "interleaved (needs --virtual-pipeline-model-parallel-size), or default "
        "(megatron-core's own choice).",
    )
    group.add_argument(
        "--split-backward",
        action="store_true",
        help="with --pipeline-schedule bitpipe: compute each backward's input gradient first and its "
        "weight gradients later, in the pipeline bubbles (zero-bubble style; same math). Needs "
        "--transformer-impl local and --tensor-parallel-mode 1d.",
    )
    return add_optimus_args(parser)


#: ``--recompute-modules`` of megatron-core's dense GPT/BERT layers
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


def recompute_problems(args: argparse.Namespace, layers_per_chunk: int) -> List[str]:
    """Megatron-LM's activation-recompute rules, one message per broken rule naming the flags.

    ``--recompute-granularity full`` checkpoints whole layers and needs ``--recompute-method``
    (``uniform``: every group of ``--recompute-num-layers`` consecutive layers of a model chunk;
    ``block``: the first ``--recompute-num-layers`` layers of each chunk) and
    ``--recompute-num-layers`` between 1 and ``layers_per_chunk`` (a divisor of it for
    ``uniform``, whose groups must tile the chunk); ``selective`` recomputes
    ``--recompute-modules`` (default ``core_attn``) of every layer and takes neither. Without a
    granularity the other flags would be ignored, so they are refused. megatron-core's norm
    recompute (``layernorm``) imports Transformer Engine.
    """
    granularity: Optional[str] = getattr(args, "recompute_granularity", None)
    method, layers = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None)
    modules = getattr(args, "recompute_modules", None)
    problems: List[str] = []
    if granularity != "full":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            if value is not None:
                problems.append(f"{flag} applies to --recompute-granularity full only (got {granularity or 'no recompute'})")
    if granularity != "selective" and modules is not None:
        problems.append("--recompute-modules applies to --recompute-granularity selective only")
    if granularity == "full":
        if method is None:
            problems.append("--recompute-granularity full needs --recompute-method uniform or block")
        if layers is None:
            problems.append(f"--recompute-granularity full needs --recompute-num-layers (1 to {layers_per_chunk}, the layers of a model chunk)")
        elif not 1 <= layers <= layers_per_chunk:
            problems.append(f"--recompute-num-layers {layers} must be between 1 and the {layers_per_chunk} layers of a model chunk")
        elif method == "uniform" and layers_per_chunk % layers:
            problems.append(
                f"--recompute-method uniform needs --recompute-num-layers {layers} to divide the {layers_per_chunk} "
                "layers of a model chunk"
            )
    if granularity == "selective" and modules:
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        if unknown:
            problems.append(f"--recompute-modules {' '.join(unknown)}: dense layers recompute {', '.join(RECOMPUTE_MODULES)}")
        if "layernorm" in modules and importlib.util.find_spec("transformer_engine") is None:
            problems.append("--recompute-modules layernorm needs Transformer Engine (megatron-core's norm recompute imports it)")
    return problems


def microbatches_per_data_parallel_rank(args: argparse.Namespace) -> int:
    """``--global-batch-size / (--micro-batch-size x data-parallel size)``, checked."""
    world = args.world_size
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world % model_parallel:
        raise BitPipeConfigError(
            f"world size {world} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size = {model_parallel}"
        )
    data_parallel = world // model_parallel
    per_step = args.micro_batch_size * data_parallel
    if args.global_batch_size % per_step:
        raise BitPipeConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel}"
        )
    return args.global_batch_size // per_step


def validate_bitpipe_args(args: argparse.Namespace) -> None:
    """Raise :class:`BitPipeConfigError` listing every broken rule (no communication)."""
    problems: List[str] = []
    schedule = getattr(args, "pipeline_schedule", "default")
    pp = args.pipeline_model_parallel_size
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    try:
        num_microbatches = microbatches_per_data_parallel_rank(args)
    except BitPipeConfigError as error:
        problems.append(str(error))
        num_microbatches = None
    if schedule == "bitpipe":
        if pp < 2 or pp % 2:
            problems.append(f"--pipeline-model-parallel-size must be even and >= 2 for bitpipe (got {pp})")
        elif args.num_layers % (2 * pp):
            problems.append(
                f"--num-layers {args.num_layers} must be divisible by 2 x --pipeline-model-parallel-size "
                f"= {2 * pp} (bitpipe runs {2 * pp} stages)"
            )
        if vp not in (None, 1):
            problems.append("--virtual-pipeline-model-parallel-size must not be set with bitpipe (4 chunks per rank are fixed)")
        if num_microbatches is not None:
            if num_microbatches % 2:
                problems.append(
                    f"bitpipe needs an even number of micro-batches per data-parallel rank: "
                    f"--global-batch-size / (--micro-batch-size x data-parallel size) = {num_microbatches}"
                )
            if num_microbatches < pp:
                problems.append(
                    f"bitpipe needs at least --pipeline-model-parallel-size={pp} micro-batches per "
                    f"data-parallel rank; --global-batch-size gives {num_microbatches}"
                )
        if getattr(args, "encoder_num_layers", None) and getattr(args, "decoder_num_layers", None):
            problems.append("bitpipe does not support encoder-decoder models")
    elif schedule == "interleaved" and vp in (None, 1):
        problems.append("--pipeline-schedule interleaved needs --virtual-pipeline-model-parallel-size >= 2")
    elif schedule == "1f1b" and vp not in (None, 1):
        problems.append("--pipeline-schedule 1f1b runs one chunk per rank: unset --virtual-pipeline-model-parallel-size")
    if getattr(args, "split_backward", False):
        if schedule != "bitpipe":
            problems.append(f"--split-backward needs --pipeline-schedule bitpipe (got {schedule})")
        if getattr(args, "transformer_impl", "local") == "transformer_engine":
            problems.append("--split-backward defers the weight gradients of megatron-core's local layers: use --transformer-impl local")
        if getattr(args, "tensor_parallel_mode", "1d") != "1d":
            problems.append("--split-backward is not supported with --tensor-parallel-mode optimus2d")
    try:
        validate_optimus_args(args)
    except ValueError as error:
        problems.append(str(error))
    if problems:
        raise BitPipeConfigError("invalid arguments:\n  " + "\n  ".join(problems))
