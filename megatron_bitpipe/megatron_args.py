"""Megatron-style command-line flags of megatron-bitpipe and their checks.

:func:`add_bitpipe_args` has the signature Megatron-LM expects of ``extra_args_provider``
(takes a parser, returns it) and adds

* ``--pipeline-schedule`` — ``default`` keeps megatron-core's choice (interleaved when a
  virtual pipeline size > 1 is set: ``--virtual-pipeline-model-parallel-size`` in
  megatron-bitpipe's scripts, ``--num-virtual-stages-per-pipeline-rank`` in Megatron-LM's;
  else 1F1B); ``1f1b`` and ``interleaved`` are megatron-core's functions; every other
  registered schedule (:data:`PLAN_SCHEDULES`: bitpipe, chimera, zb-h1, zbv, dualpipe,
  dualpipev) runs on this package's plan executor;
* ``--split-backward`` — with a plan schedule: run every backward as the input gradient and,
  later, the weight gradients, placed into the pipeline's bubbles
  (:mod:`megatron_bitpipe.schedules.split_backward`), through megatron-core's
  ``delay_wgrad_compute`` contract (local layers and Transformer Engine's); the zero-bubble
  and DualPipe schedules split every backward with or without it;
* ``--schedule-costs FILE`` — the cost file ``scripts/calibrate_gpu.py`` writes: the split
  places its weight-gradient actions, and ZB-V plans its order, for these measured costs; with
  Megatron-LM's MoE flags and the file's ``t_a2a`` / ``a2a_bandwidth``, every device share's
  forward, backward and input gradient also wait for its MoE layers' all-to-alls
  (:meth:`~megatron_bitpipe.schedules.CostModel.with_all_to_alls`);
* ``--tensor-parallel-mode {1d,optimus2d}`` (:mod:`megatron_bitpipe.optimus.args`).

:func:`validate_bitpipe_args` checks a parsed namespace (Megatron-LM's argument names)
before any process group exists and raises :class:`BitPipeConfigError` naming every flag
that breaks a rule (:func:`bitpipe_arg_problems` gives the list). The schedule's own rules
come from :meth:`megatron_bitpipe.schedules.ScheduleChoice.problems`
(:func:`schedule_choice` of the flags); the rules here are about combining flags.
:func:`recompute_problems` holds Megatron-LM's activation-recompute rules
(``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``,
``--recompute-modules``) for model chunks of a given number of layers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import replace
from typing import List, Optional

from .optimus.args import add_optimus_args, validate_optimus_args
from .schedules import ScheduleChoice
from .schedules.errors import VP_FLAG
from .schedules.layer_split import LayerSplitFlags
from .schedules.registry import REGISTRY, plan_executed_schedules, training_schedules
from .schedules.costs import CostModel, read_cost_file
from .schedules.moe_shape import MoEShape

#: ``--pipeline-schedule`` values: megatron-core's own choice, then every schedule the registry
#: says training runs (``1f1b``, ``interleaved``: megatron-core's functions; the others: the plan executor)
PIPELINE_SCHEDULES = ("default",) + training_schedules()


class BitPipeConfigError(ValueError):
    """Invalid combination of command-line flags; the message names each flag and its rule."""


def add_bitpipe_args(parser: argparse.ArgumentParser, *, virtual_size_flag: str = VP_FLAG) -> argparse.ArgumentParser:
    """Add the flags to ``parser``; ``virtual_size_flag`` is the parser's flag for the virtual
    pipeline size (named in the help)."""
    group = parser.add_argument_group(title="megatron-bitpipe")
    group.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        default="default",
        help="pipeline schedule: default (megatron-core's own choice), 1f1b, interleaved (needs "
        f"{virtual_size_flag}), or one this package's plan executor runs: bitpipe (bidirectional V, two "
        "weight replicas), chimera (two replicas), zb-h1, zbv (a V, one replica), dualpipe (two replicas), "
        "dualpipev (a V, one replica); zb-h1, zbv, dualpipe and dualpipev always split their backwards. "
        "`python -m megatron_bitpipe.schedules list` describes each.",
    )
    group.add_argument(
        "--split-backward",
        action="store_true",
        help="with --pipeline-schedule bitpipe or chimera: compute each backward's input gradient first and its "
        "weight gradients later, in the pipeline bubbles (zero-bubble style; same math); zb-h1, zbv, dualpipe "
        "and dualpipev always do. Needs --tensor-parallel-mode 1d.",
    )
    group.add_argument(
        "--schedule-costs",
        metavar="FILE",
        default=None,
        help="with --split-backward or --pipeline-schedule zbv: JSON cost file (t_forward, t_backward, t_weight, "
        "t_input, t_p2p, ... as scripts/calibrate_gpu.py writes it) the weight-gradient steps are placed, and "
        "ZB-V's order planned, for; default: t_backward = 2 t_forward, half of it weight gradients.",
    )
    return add_optimus_args(parser)


#: ``--pipeline-schedule`` values this package's executor runs; the others select megatron-core's
#: own functions, whose rules megatron-core checks
PLAN_SCHEDULES = plan_executed_schedules()
#: the schedules whose own order is planned for ``--schedule-costs``
COST_PLANNED_SCHEDULES = tuple(name for name in PLAN_SCHEDULES if REGISTRY[name].takes_costs)
#: where the training scripts' number of micro-batches per data-parallel rank comes from
MICROBATCHES_SOURCE = "micro-batches per data-parallel rank (--global-batch-size / (--micro-batch-size x data-parallel size))"


def model_parallel_size_of(args: argparse.Namespace) -> int:
    """TP x CP x PP: the ranks holding one data-parallel replica (``--context-parallel-size``
    counts where the namespace has it: Megatron-LM's, and this package's scripts')."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size * cp


def data_parallel_size_problems(args: argparse.Namespace) -> List[str]:
    """The world size must be a multiple of TP x CP x PP, the global batch of micro-batch x DP."""
    world = args.world_size
    cp = getattr(args, "context_parallel_size", 1) or 1
    model_parallel = model_parallel_size_of(args)
    if world % model_parallel:
        sizes = "--tensor-model-parallel-size x --pipeline-model-parallel-size"
        sizes += " x --context-parallel-size" if cp > 1 else ""
        return [f"world size {world} is not divisible by {sizes} = {model_parallel}"]
    data_parallel = world // model_parallel
    per_step = args.micro_batch_size * data_parallel
    if args.global_batch_size % per_step:
        return [
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel}"
        ]
    return []


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
        if "mlp" in modules and getattr(args, "add_bias_linear", True):
            problems.append(
                "--recompute-modules mlp needs --disable-bias-linear: megatron-core's MLP recompute hands the output "
                "layer's bias parameter through its checkpoint, whose backward then never ends"
            )
    return problems


def microbatches_per_data_parallel_rank(args: argparse.Namespace) -> int:
    """``--global-batch-size / (--micro-batch-size x data-parallel size)``, checked."""
    problems = data_parallel_size_problems(args)
    if problems:
        raise BitPipeConfigError(problems[0])
    data_parallel = args.world_size // model_parallel_size_of(args)
    return args.global_batch_size // (args.micro_batch_size * data_parallel)


def microbatch_problems(
    args: argparse.Namespace, choice: ScheduleChoice, num_microbatches: Optional[int], *, virtual_size_flag: str = VP_FLAG
) -> List[str]:
    """``choice``'s rules for the flags (:meth:`ScheduleChoice.problems` of the pipeline size,
    ``num_microbatches`` per data-parallel rank and ``--num-layers``), and what
    ``--global-batch-size`` to give when only the number of micro-batches breaks them: the
    smallest valid value (smallest N x ``--micro-batch-size`` x data-parallel size) and, for a
    value given, the next valid one above it. When the flag was left out
    (``args.global_batch_size_defaulted``, set by the pretrain scripts), the micro-batch rules
    become one message saying so. ``virtual_size_flag`` names the virtual pipeline size's flag
    in the messages."""
    pp = args.pipeline_model_parallel_size
    # The uneven-layout flags replace the equal-stage rule (their own rules: layer_split).
    layers = None if LayerSplitFlags.from_args(args).given else getattr(args, "num_layers", None)
    names = dict(microbatches=MICROBATCHES_SOURCE, virtual_size_flag=virtual_size_flag)
    problems = choice.problems(pp, num_microbatches, layers, **names)
    if num_microbatches is None:
        return problems
    batch_rules = [p for p in problems if p not in choice.problems(pp, None, layers, **names)]
    if not batch_rules:
        return problems
    data_parallel = args.world_size // model_parallel_size_of(args)
    per_microbatch = args.micro_batch_size * data_parallel
    fewest = choice.smallest_num_microbatches(pp)
    smallest = (
        f"the smallest valid --global-batch-size is {fewest * per_microbatch} ({fewest} micro-batches x "
        f"--micro-batch-size {args.micro_batch_size} x data-parallel size {data_parallel})"
    )
    others = [p for p in problems if p not in batch_rules]
    if getattr(args, "global_batch_size_defaulted", False):
        prefix = f"{MICROBATCHES_SOURCE} = {num_microbatches}: "
        rules = "; ".join(rule.removeprefix(prefix) for rule in batch_rules)
        return others + [
            f"--global-batch-size is not set, and its default, --micro-batch-size x data-parallel size = "
            f"{args.global_batch_size}, gives {num_microbatches} micro-batch{'es' if num_microbatches != 1 else ''} per data-parallel "
            f"rank, but {rules}: {smallest}"
        ]
    candidates = range(max(num_microbatches, fewest), num_microbatches + fewest + 2 * pp)
    larger = next((n for n in candidates if not choice.problems(pp, n)), fewest)
    if larger > fewest:
        smallest += f"; the next valid one above {args.global_batch_size} is {larger * per_microbatch}"
    return problems + [smallest]


def schedule_costs(args: argparse.Namespace) -> Optional[CostModel]:
    """The :class:`~megatron_bitpipe.schedules.CostModel` of ``--schedule-costs`` (None without
    the flag); :class:`BitPipeConfigError` naming the flag if the file cannot be read."""
    path = getattr(args, "schedule_costs", None)
    if path is None:
        return None
    try:
        costs = CostModel(**read_cost_file(path))
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as error:
        raise BitPipeConfigError(f"--schedule-costs {path}: {error}") from None
    return _with_expert_all_to_alls(costs, args)


def _with_expert_all_to_alls(costs: CostModel, args: argparse.Namespace) -> CostModel:
    """``costs`` with the all-to-alls of the MoE layers of one device share folded in (none
    without ``--num-experts``): their average count per pipeline rank, each layer's bytes from
    the shapes (:meth:`~megatron_bitpipe.schedules.moe_shape.MoEShape.all_to_all_bytes`)."""
    if getattr(args, "num_experts", None) is None:
        return costs
    freq = getattr(args, "moe_layer_freq", 1)
    try:
        moe = MoEShape(
            args.num_experts, getattr(args, "moe_router_topk", 2), getattr(args, "moe_ffn_hidden_size", None),
            freq if isinstance(freq, int) else tuple(freq), getattr(args, "moe_shared_expert_intermediate_size", None),
            getattr(args, "moe_expert_capacity_factor", None), getattr(args, "expert_model_parallel_size", 1) or 1,
        )  # fmt: skip
        moe_layers = moe.layer_count(args.num_layers)
    except ValueError as error:
        raise BitPipeConfigError(f"--schedule-costs with --num-experts: {error}") from None
    element_bytes = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4
    sent = moe.all_to_all_bytes(args.seq_length * args.micro_batch_size, args.hidden_size, element_bytes)
    return costs.with_all_to_alls(moe_layers / args.pipeline_model_parallel_size, sent)


def resolved_schedule(args: argparse.Namespace) -> str:
    """The schedule ``--pipeline-schedule`` selects, ``default`` resolved as megatron-core
    resolves it (interleaved with a virtual pipeline size > 1, else 1f1b). A namespace
    without the flag (Megatron-LM's parser without this package's flags) runs megatron's default.
    The only place the flag is read."""
    schedule = getattr(args, "pipeline_schedule", "default")
    if schedule != "default":
        return schedule
    return "interleaved" if getattr(args, "virtual_pipeline_model_parallel_size", None) not in (None, 1) else "1f1b"


def schedule_choice(args: argparse.Namespace) -> ScheduleChoice:
    """The schedule the flags select: :func:`resolved_schedule`, ``--split-backward``,
    ``--schedule-costs`` and the virtual size. Reads the cost file (:func:`schedule_costs`)."""
    split = getattr(args, "split_backward", False)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    choice = ScheduleChoice(resolved_schedule(args), split, None, vp)
    return replace(choice, costs=schedule_costs(args)) if choice.uses_costs else choice


def virtual_size_problems(args: argparse.Namespace, *, virtual_size_flag: str = VP_FLAG) -> List[str]:
    """The rule ``--pipeline-schedule`` and the virtual pipeline size make together, stated once
    for both routes: ``interleaved`` needs a virtual size >= 2, ``1f1b`` none (the plan-executed
    schedules' own virtual-size rules are :meth:`~megatron_bitpipe.schedules.ScheduleChoice.problems`').
    ``virtual_size_flag`` names the flag in the message."""
    schedule = getattr(args, "pipeline_schedule", "default")  # as given: the message names the flag
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if schedule == "interleaved" and vp in (None, 1):
        return [f"--pipeline-schedule interleaved needs {virtual_size_flag} >= 2"]
    if schedule == "1f1b" and vp not in (None, 1):
        return [f"--pipeline-schedule 1f1b runs one chunk per rank: unset {virtual_size_flag}"]
    return []


def bitpipe_arg_problems(args: argparse.Namespace, *, virtual_size_flag: str = VP_FLAG, batch_ramp: bool = False) -> List[str]:
    """Every rule the parsed flags (Megatron-LM's names) break, one message each; no communication.
    ``virtual_size_flag`` names the flag that sets ``virtual_pipeline_model_parallel_size``.
    ``batch_ramp``: the global batch size changes during training (a batch-size ramp, whose every
    step the caller checks: :func:`~megatron_bitpipe.batch_ramp.ramp_problems`), so
    ``--global-batch-size`` is not the number of micro-batches of every step and the micro-batch
    rules are not checked against it."""
    problems = data_parallel_size_problems(args)
    num_microbatches = None if problems or batch_ramp else microbatches_per_data_parallel_rank(args)
    schedule = getattr(args, "pipeline_schedule", "default")  # as given: the rules below name the flag
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    try:
        choice = schedule_choice(args)
    except BitPipeConfigError as error:
        problems.append(str(error))
        choice = ScheduleChoice(resolved_schedule(args), getattr(args, "split_backward", False), virtual_size=vp)
    combination = virtual_size_problems(args, virtual_size_flag=virtual_size_flag)
    problems += combination
    if not combination and choice.plan_executed:
        problems += microbatch_problems(args, choice, num_microbatches, virtual_size_flag=virtual_size_flag)
    if choice.plan_executed and getattr(args, "encoder_num_layers", None) and getattr(args, "decoder_num_layers", None):
        problems.append(f"{choice.schedule} does not support encoder-decoder models")
    if choice.plan_executed and not getattr(args, "untie_embeddings_and_output_weights", False):
        pp = args.pipeline_model_parallel_size
        if pp >= 1 and not choice.problems(pp) and not choice.placement(pp).ties_embeddings:
            problems.append(
                f"--pipeline-schedule {choice.schedule} puts a pipeline's embedding and output layer on different "
                f"ranks of its {choice.placement(pp).name} placement: add --untie-embeddings-and-output-weights "
                "(tied embeddings need both ends of every pipeline on one rank)"
            )
    if choice.split_backward and not choice.plan_executed:
        problems.append(f"--split-backward needs --pipeline-schedule {' or '.join(PLAN_SCHEDULES)} (got {schedule})")
    if choice.splits_backward and getattr(args, "tensor_parallel_mode", "1d") != "1d":
        split = "--split-backward" if choice.split_backward else f"--pipeline-schedule {choice.schedule} (its backwards are always split)"
        problems.append(f"{split} is not supported with --tensor-parallel-mode optimus2d")
    if getattr(args, "schedule_costs", None) is not None and not choice.uses_costs:
        problems.append(
            f"--schedule-costs: {choice.label} plans nothing for costs (they place the weight-gradient steps of "
            f"--split-backward and plan {', '.join(COST_PLANNED_SCHEDULES)}'s order): add --split-backward or drop the flag"
        )
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
