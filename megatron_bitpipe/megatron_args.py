"""Megatron-style command-line flags of megatron-bitpipe and their checks.

:func:`add_bitpipe_args` has the signature Megatron-LM expects of ``extra_args_provider``
(takes a parser, returns it) and adds

* ``--pipeline-schedule {default,1f1b,interleaved,bitpipe}`` — ``default`` keeps
  megatron-core's choice (interleaved when ``--virtual-pipeline-model-parallel-size`` is
  set, else 1F1B);
* ``--split-backward`` — with ``bitpipe``: run every backward as the input gradient and,
  later, the weight gradients, placed into the pipeline's bubbles
  (:mod:`megatron_bitpipe.schedules.split_backward`); megatron-core's local layers only;
* ``--schedule-costs FILE`` — the cost file ``scripts/calibrate_gpu.py`` writes: the split
  places its weight-gradient actions for these measured costs;
* ``--tensor-parallel-mode {1d,optimus2d}`` (:mod:`megatron_bitpipe.optimus.args`).

:func:`validate_bitpipe_args` checks a parsed namespace (Megatron-LM's argument names)
before any process group exists and raises :class:`BitPipeConfigError` naming every flag
that breaks a rule (:func:`bitpipe_arg_problems` gives the list). The schedule's own rules
come from :meth:`megatron_bitpipe.schedules.ScheduleChoice.problems`
(:func:`schedule_choice` of the flags); the rules here are about combining flags.
"""

from __future__ import annotations

import argparse
import json
from typing import List, Optional

from .optimus.args import add_optimus_args, validate_optimus_args
from .schedules import ScheduleChoice
from .schedules.simulate import CostModel, read_cost_file

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
    group.add_argument(
        "--schedule-costs",
        metavar="FILE",
        default=None,
        help="with --split-backward: JSON cost file (t_forward, t_backward, t_weight, t_p2p, ... as "
        "scripts/calibrate_gpu.py writes it) the weight-gradient steps are placed for; default: "
        "t_backward = 2 t_forward, half of it weight gradients.",
    )
    return add_optimus_args(parser)


#: ``--pipeline-schedule`` values this package's executor runs; the others select megatron-core's
#: own functions, whose rules megatron-core checks
PLAN_SCHEDULES = ("bitpipe",)
#: where the training scripts' number of micro-batches per data-parallel rank comes from
MICROBATCHES_SOURCE = "micro-batches per data-parallel rank (--global-batch-size / (--micro-batch-size x data-parallel size))"


def data_parallel_size_problems(args: argparse.Namespace) -> List[str]:
    """The world size must be a multiple of TP x PP, the global batch of micro-batch x DP."""
    world = args.world_size
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world % model_parallel:
        return [
            f"world size {world} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size = {model_parallel}"
        ]
    data_parallel = world // model_parallel
    per_step = args.micro_batch_size * data_parallel
    if args.global_batch_size % per_step:
        return [
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel}"
        ]
    return []


def microbatches_per_data_parallel_rank(args: argparse.Namespace) -> int:
    """``--global-batch-size / (--micro-batch-size x data-parallel size)``, checked."""
    problems = data_parallel_size_problems(args)
    if problems:
        raise BitPipeConfigError(problems[0])
    data_parallel = args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    return args.global_batch_size // (args.micro_batch_size * data_parallel)


def schedule_costs(args: argparse.Namespace) -> Optional[CostModel]:
    """The :class:`~megatron_bitpipe.schedules.CostModel` of ``--schedule-costs`` (None without
    the flag); :class:`BitPipeConfigError` naming the flag if the file cannot be read."""
    path = getattr(args, "schedule_costs", None)
    if path is None:
        return None
    try:
        return CostModel(**read_cost_file(path))
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as error:
        raise BitPipeConfigError(f"--schedule-costs {path}: {error}") from None


def schedule_choice(args: argparse.Namespace) -> ScheduleChoice:
    """The schedule the flags select: ``--pipeline-schedule`` (``default``: interleaved with a
    virtual size > 1, else 1f1b), ``--split-backward``, ``--schedule-costs`` and the virtual size.
    Reads the cost file (:func:`schedule_costs`)."""
    schedule = getattr(args, "pipeline_schedule", "default")
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if schedule == "default":
        schedule = "interleaved" if vp not in (None, 1) else "1f1b"
    split = getattr(args, "split_backward", False)
    return ScheduleChoice(schedule, split, schedule_costs(args) if split else None, vp)


def bitpipe_arg_problems(args: argparse.Namespace) -> List[str]:
    """Every rule the parsed flags (Megatron-LM's names) break, one message each; no communication."""
    problems = data_parallel_size_problems(args)
    num_microbatches = None if problems else microbatches_per_data_parallel_rank(args)
    schedule = getattr(args, "pipeline_schedule", "default")
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    try:
        choice = schedule_choice(args)
    except BitPipeConfigError as error:
        problems.append(str(error))
        choice = ScheduleChoice(schedule if schedule != "default" else "1f1b", virtual_size=vp)
    if schedule == "interleaved" and vp in (None, 1):
        problems.append("--pipeline-schedule interleaved needs --virtual-pipeline-model-parallel-size >= 2")
    elif schedule == "1f1b" and vp not in (None, 1):
        problems.append("--pipeline-schedule 1f1b runs one chunk per rank: unset --virtual-pipeline-model-parallel-size")
    elif choice.schedule in PLAN_SCHEDULES:
        problems += choice.problems(
            args.pipeline_model_parallel_size, num_microbatches, args.num_layers, microbatches=MICROBATCHES_SOURCE
        )
    if schedule == "bitpipe" and getattr(args, "encoder_num_layers", None) and getattr(args, "decoder_num_layers", None):
        problems.append("bitpipe does not support encoder-decoder models")
    if getattr(args, "split_backward", False):
        if schedule != "bitpipe":
            problems.append(f"--split-backward needs --pipeline-schedule bitpipe (got {schedule})")
        if getattr(args, "transformer_impl", "local") == "transformer_engine":
            problems.append("--split-backward defers the weight gradients of megatron-core's local layers: use --transformer-impl local")
        if getattr(args, "tensor_parallel_mode", "1d") != "1d":
            problems.append("--split-backward is not supported with --tensor-parallel-mode optimus2d")
    elif getattr(args, "schedule_costs", None) is not None:
        problems.append("--schedule-costs places the weight-gradient steps of --split-backward: add --split-backward")
    try:
        validate_optimus_args(args)
    except ValueError as error:
        problems.append(str(error))
    return problems


def validate_bitpipe_args(args: argparse.Namespace) -> None:
    """Raise :class:`BitPipeConfigError` listing every broken rule (:func:`bitpipe_arg_problems`)."""
    problems = bitpipe_arg_problems(args)
    if problems:
        raise BitPipeConfigError("invalid arguments:\n  " + "\n  ".join(problems))
