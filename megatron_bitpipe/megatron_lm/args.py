"""megatron-bitpipe's flags on Megatron-LM's command line, and the rules of its training loop.

:func:`add_megatron_lm_args` is an ``extra_args_provider``: it adds the plugin's flags
(:func:`megatron_bitpipe.megatron_args.add_bitpipe_args`), ``--layout-independent-init`` and
the optimizer flags (:func:`megatron_bitpipe.optimizers.add_optimizer_args`), and extends the
choices of Megatron-LM's ``--optimizer`` (``lamb``, ``onebit_lamb``,
``schedulefree_adamw``), ``--lr-decay-style`` and ``--lr-wsd-decay-style`` (``rex``).
:func:`chain_args_provider` puts it after a script's own provider.

:func:`validate_megatron_lm_args` runs after Megatron-LM's ``validate_args`` (which fills in
``data_parallel_size`` and the other derived fields) and before ``torch.distributed`` is
initialised, on every rank: :func:`~megatron_bitpipe.megatron_args.bitpipe_arg_problems`
(among them the schedule's own rules and tied embeddings on a placement whose pipelines end
apart: dualpipe, chimera) plus, when this package's plan executor runs the schedule (bitpipe,
chimera, zb-h1, zbv, dualpipe, dualpipev), the Megatron-LM features its chunks cannot be
combined with, the schedule's rules for every number of micro-batches a batch-size ramp
reaches (``--rampup-batch-size`` at core_v0.16.1, ``--step-batch-size-schedule`` at core_v0.19.0:
:func:`~megatron_bitpipe.batch_ramp.ramp_problems`, from megatron-core's own calculator, as
Megatron-LM's training code builds it), Megatron-LM's weight-gradient deferral flags that contradict the schedule's
backwards (split or whole), the uneven-layout flags' rules on the placement's stages, the
activation-recompute rules for its chunks (``--num-layers`` / stages per pipeline layers, ``2 x
--pipeline-model-parallel-size`` stages for bitpipe, zbv and dualpipev, or the uneven split's
counts: :func:`~megatron_bitpipe.megatron_args.recompute_problems`), with
``--num-experts`` the mixture-of-experts rules (:func:`moe_problems`) and with
``--context-parallel-size`` > 1 the context-parallel ones (:func:`context_parallel_problems`). It raises
:class:`~megatron_bitpipe.megatron_args.BitPipeConfigError` listing every offending flag.

:func:`hold_layer_split` runs before Megatron-LM's ``validate_args``: a plan-executed schedule
splits the layers over its own stages, so the uneven-layout flags are kept from Megatron-LM's
rules and TransformerConfig (:func:`release_layer_split` after it).
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Optional

from ..batch_ramp import batch_ramp_of, ramp_problems
from ..moe_settings import expert_bias_problems
from ..megatron_args import (
    BitPipeConfigError,
    add_bitpipe_args,
    bitpipe_arg_problems,
    model_parallel_size_of,
    recompute_problems,
    resolved_schedule,
)
from ..optimizers import OPTIMIZERS, REX, add_optimizer_args, optimizer_problems
from ..schedules import ScheduleChoice
from ..schedules.layer_split import HELD_ATTRIBUTE, LayerSplitFlags, chunk_layer_counts, split_layers, split_problems

__all__ = [
    "VIRTUAL_SIZE_FLAG",
    "add_megatron_lm_args",
    "chain_args_provider",
    "CP_COMM_TYPES",
    "SDPA_SPEC",
    "configure_optimizer_checkpoints",
    "context_parallel_problems",
    "hold_layer_split",
    "release_layer_split",
    "validate_megatron_lm_args",
]

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

VIRTUAL_SIZE_FLAG = "--num-virtual-stages-per-pipeline-rank"
"""Megatron-LM's flag for the virtual pipeline size (tags core_v0.16.1 through core_v0.19.0;
``--num-layers-per-virtual-pipeline-stage`` derives it from a layer count instead)."""

_HYBRID = (
    "{schedule} builds GPTModel chunks; hybrid (Mamba) models pick each pipeline stage's layers from "
    "their layer pattern in megatron's looped order, which cannot hold {schedule}'s stages"
)
# (attribute, flag, why it cannot run with a plan-executed schedule, ``{schedule}`` its name); a
# flag is set when the attribute is truthy (numbers: > 1 for the parallel sizes).
_PLAN_CONFLICTS = (
    ("use_torch_fsdp2", "--use-torch-fsdp2", "{schedule} wraps each chunk in megatron DDP"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "{schedule} wraps each chunk in megatron DDP"),
    ("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances",
     "{schedule} shards each chunk's optimizer state over its replica x data-parallel group"),
    ("mtp_num_layers", "--mtp-num-layers", "multi-token prediction is not supported"),
    ("use_tp_pp_dp_mapping", "--use-tp-pp-dp-mapping", "{schedule} uses megatron's default tp-dp-pp rank order"),
    ("use_legacy_models", "--use-legacy-models", "{schedule} builds megatron-core models"),
    ("init_model_with_meta_device", "--init-model-with-meta-device", "{schedule} initialises weights from --seed"),
    ("yaml_cfg", "--yaml-cfg", "{schedule} reads the model from command-line flags"),
    ("gtp_weight_remat_size", "--tensor-parallel-num-weight-shards",
     "{schedule} builds its process groups over tensor x data x pipeline ranks, without a weight-shard axis"),
)
# Flags that cannot be combined with split backwards (--split-backward, or a schedule that always
# splits: ScheduleChoice.splits_backward; ``{split}`` names which), then those that cannot be
# combined with whole backwards; same form as _PLAN_CONFLICTS.
_SPLIT_CONFLICTS = (
    ("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute",
     "{split} defers every weight gradient itself, the embedding's included"),
)
_WHOLE_BACKWARD_CONFLICTS = (
    ("delay_wgrad_compute", "--delay-wgrad-compute",
     "{schedule} runs whole backwards, so nothing would compute the deferred weight gradients (add --split-backward, "
     "or choose a schedule that splits its backwards)"),
)
# The layer pattern of a hybrid (Mamba) model; core_v0.19 copies the deprecated override flag
# into hybrid_layer_pattern, so the first one set is the one the user typed.
_HYBRID_PATTERNS = (("hybrid_override_pattern", "--hybrid-override-pattern"), ("hybrid_layer_pattern", "--hybrid-layer-pattern"))
# Megatron-LM's fields of the five uneven-layout flags, with their unset values.
_LAYER_SPLIT_FIELDS = (
    ("decoder_first_pipeline_num_layers", None),
    ("decoder_last_pipeline_num_layers", None),
    ("account_for_embedding_in_pipeline_split", False),
    ("account_for_loss_in_pipeline_split", False),
    ("pipeline_model_parallel_layout", None),
)
_PARALLEL_SIZES = {"num_distributed_optimizer_instances", "gtp_weight_remat_size"}
#: ``--cp-comm-type`` values the SDPA attention's key/value exchange implements, in megatron-core's
#: spelling (``TransformerConfig.cp_comm_type``, which Megatron-LM fills from the flag): ``all_gather``
#: (:mod:`megatron_bitpipe.model.context_parallel`) and ``p2p``, the ring (Megatron-LM's default,
#: :mod:`megatron_bitpipe.model.ring_attention`). Megatron-LM's help text spells the all-gather
#: ``allgather``, which megatron-core does not know: refused, naming ``all_gather``.
CP_COMM_TYPES = ("all_gather", "p2p")
#: The layer spec context parallelism needs on Megatron-LM's scripts (local layers, SDPA core attention)
SDPA_SPEC = ("megatron_bitpipe.model.sdpa_attention", "gpt_local_sdpa_layer_spec")
# Megatron-LM flags a plan-executed schedule cannot be combined with at --context-parallel-size > 1;
# same form as _PLAN_CONFLICTS (``{cp}``: the size).
_CONTEXT_PARALLEL_CONFLICTS = (
    ("hierarchical_context_parallel_sizes", "--hierarchical-context-parallel-sizes",
     "the SDPA attention exchanges keys and values over one context-parallel group"),
    ("hybrid_context_parallel", "--hybrid-context-parallel", "the sequences are split over the one context-parallel group"),
    ("sft", "--sft", "its packed sequences (THD) reach the SDPA attention, which takes no packed_seq_params"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking",
     "its packed sequences (THD) reach the SDPA attention, which takes no packed_seq_params"),
    ("num_experts", "--num-experts", "mixture-of-experts layers with context parallelism are not supported"),
    ("save", "--save", "the checkpoints' replica ids do not count the context-parallel ranks yet"),
    ("load", "--load", "the checkpoints' replica ids do not count the context-parallel ranks yet"),
    ("pretrained_checkpoint", "--pretrained-checkpoint", "the checkpoints' replica ids do not count the context-parallel ranks yet"),
)
# Mixture-of-experts flags a plan-executed schedule cannot be combined with (with --num-experts);
# same form as _PLAN_CONFLICTS.
_MOE_CONFLICTS = (
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
     "the overlap is megatron's own combined 1F1B schedule, not {schedule}'s"),
)


def _extend_choices(parser: argparse.ArgumentParser, flag: str, extra) -> None:
    """Add ``extra`` to the choices of Megatron-LM's ``flag`` (if the parser has that flag)."""
    action = parser._option_string_actions.get(flag)
    if action is not None and action.choices is not None:
        action.choices = list(action.choices) + [c for c in extra if c not in action.choices]


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--pipeline-schedule``, ``--split-backward``, ``--schedule-costs``,
    ``--tensor-parallel-mode``, ``--layout-independent-init`` and the optimizer flags; extend
    ``--optimizer``, ``--lr-decay-style`` and ``--lr-wsd-decay-style``."""
    _extend_choices(parser, "--optimizer", OPTIMIZERS)
    _extend_choices(parser, "--lr-decay-style", [REX])
    _extend_choices(parser, "--lr-wsd-decay-style", [REX])
    add_optimizer_args(parser)
    parser = add_bitpipe_args(parser, virtual_size_flag=VIRTUAL_SIZE_FLAG)
    group = parser.add_argument_group(title="megatron-bitpipe (Megatron-LM)")
    group.add_argument(
        "--layout-independent-init",
        action="store_true",
        help="initialise every weight from --seed and its full-model parameter name, so the initial "
        "model does not depend on the parallel layout or the schedule (always on with "
        "--pipeline-schedule bitpipe, whose two weight replicas must start identical).",
    )
    return parser


def chain_args_provider(provider: Optional[ArgsProvider]) -> ArgsProvider:
    """An ``extra_args_provider`` running ``provider`` (if any), then :func:`add_megatron_lm_args`."""

    def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser)
        return add_megatron_lm_args(parser)

    return extra_args_provider


def hold_layer_split(args: argparse.Namespace) -> None:
    """Keep the uneven-layout flags from Megatron-LM where this package's plan executor splits the
    layers: call on every rank before Megatron-LM's ``validate_args`` (both routes). Local.

    Megatron-LM counts the five flags over its looped stages (a layout's stages set its virtual
    size; ``--num-layers`` plus the accounted embedding and loss must divide by the pipeline
    ranks), and its TransformerConfig splits those stages by them. A plan's placement has its own
    stages (BitPipe: ``2 x --pipeline-model-parallel-size`` per pipeline, in pipeline order), so
    with a plan-executed schedule the flags move to ``args.``:data:`HELD_ATTRIBUTE` (the fields
    of a :class:`~megatron_bitpipe.schedules.layer_split.LayerSplitFlags`, which the RunConfig and
    the checks read) and Megatron-LM's fields are unset; its TransformerConfig then splits nothing.

    Megatron-LM's equal-split check (``--num-layers`` divisible by the pipeline ranks) is
    skipped by Megatron-LM when a first-stage count is given; where the split is uneven and that
    check would fail, ``decoder_first_pipeline_num_layers`` holds the first stage's count of the
    plan's split until :func:`release_layer_split`. A split that breaks its rules is refused here,
    before Megatron-LM's checks (:class:`BitPipeConfigError`, one line per rule naming the flag).
    Other schedules (megatron's own) keep the flags: Megatron-LM applies them.
    """
    flags = LayerSplitFlags.from_args(args)
    choice = ScheduleChoice(resolved_schedule(args))
    if not flags.given or not choice.plan_executed or getattr(args, HELD_ATTRIBUTE, None) is not None:
        return
    setattr(args, HELD_ATTRIBUTE, flags.as_dict())
    for field, unset in _LAYER_SPLIT_FIELDS:
        setattr(args, field, unset)
    pp, num_layers = args.pipeline_model_parallel_size, args.num_layers
    if num_layers is None or choice.problems(pp):
        return  # the schedule's rules report these after validate_args
    problems = split_problems(flags, choice.placement(pp), num_layers, VIRTUAL_SIZE_FLAG)
    if problems:
        raise BitPipeConfigError("invalid arguments:\n  " + "\n  ".join(problems))
    if num_layers % pp:
        args.decoder_first_pipeline_num_layers = split_layers(flags, choice.placement(pp), num_layers).counts[0]


def release_layer_split(args: argparse.Namespace) -> None:
    """Unset the first-stage count :func:`hold_layer_split` lent Megatron-LM's ``validate_args``
    (after it ran, before the TransformerConfig is built). Local."""
    if getattr(args, HELD_ATTRIBUTE, None) is not None:
        args.decoder_first_pipeline_num_layers = None


def validate_megatron_lm_args(args: argparse.Namespace) -> None:
    """Raise :class:`BitPipeConfigError` naming every flag that breaks a rule (no communication).

    The rules of the Megatron-LM features this package's chunks cannot hold apply when its plan
    executor runs the schedule (the registry's
    :attr:`~megatron_bitpipe.schedules.ScheduleChoice.plan_executed`); each message names the
    schedule."""
    choice = ScheduleChoice(resolved_schedule(args), split_backward=bool(getattr(args, "split_backward", False)))
    ramp = batch_ramp_of(args, implemented_only=True) if choice.plan_executed else None
    problems: List[str] = bitpipe_arg_problems(args, virtual_size_flag=VIRTUAL_SIZE_FLAG, batch_ramp=ramp is not None)
    # the cost file, if any, is checked above
    if ramp is not None and args.world_size % model_parallel_size_of(args) == 0:
        problems += _megatron_lm_ramp_problems(args, ramp, choice)
    if choice.plan_executed and args.world_size % model_parallel_size_of(args) == 0:
        problems += _evaluation_batch_problems(args, choice)
    problems += optimizer_problems(args, schedule=choice.schedule, megatron_lm=True)
    if getattr(args, "tensor_parallel_mode", "1d") == "optimus2d":
        problems.append(
            "--tensor-parallel-mode optimus2d is not available through Megatron-LM's scripts (their "
            "model builders use megatron's 1-D tensor parallelism); use megatron-bitpipe's scripts/pretrain_gpt.py"
        )
    if choice.plan_executed:
        schedule, pp = choice.schedule, args.pipeline_model_parallel_size
        stages = choice.placement(pp).num_stages
        if choice.splits_backward:
            split = "--split-backward" if choice.split_backward else f"--pipeline-schedule {schedule} (its backwards are always split)"
            conflicts = [(a, f, r.format(split=split)) for a, f, r in _SPLIT_CONFLICTS]
        else:
            conflicts = list(_WHOLE_BACKWARD_CONFLICTS)
        for attribute, flag, reason in (*_PLAN_CONFLICTS, *conflicts):
            value = getattr(args, attribute, None)
            if (value or 0) > 1 if attribute in _PARALLEL_SIZES else value:
                problems.append(f"{flag} cannot be used with --pipeline-schedule {schedule}: {reason.format(schedule=schedule, stages=stages)}")
        hybrid = next((flag for attribute, flag in _HYBRID_PATTERNS if getattr(args, attribute, None)), None)
        if hybrid is not None:
            problems.append(f"{hybrid} cannot be used with --pipeline-schedule {schedule}: {_HYBRID.format(schedule=schedule)}")
        flags = LayerSplitFlags.from_args(args)
        placement = None if choice.problems(pp) else choice.placement(pp)
        if flags.given and placement is not None:
            problems += split_problems(flags, placement, args.num_layers, VIRTUAL_SIZE_FLAG)
        for size in chunk_layer_counts(flags, placement, args.num_layers, stages, VIRTUAL_SIZE_FLAG):
            problems += [p for p in recompute_problems(args, size) if p not in problems]
        if (getattr(args, "context_parallel_size", 1) or 1) > 1:
            problems += context_parallel_problems(args, schedule)
        if getattr(args, "num_experts", None) and placement is not None:
            problems += moe_problems(args, schedule, placement.num_pipelines)
        checkpoints = any(getattr(args, name, None) for name in ("save", "load", "pretrained_checkpoint"))
        if checkpoints and getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
            problems.append(
                f"--ckpt-format {getattr(args, 'ckpt_format', 'torch_dist')} cannot be used with --pipeline-schedule "
                f"{schedule}: use --ckpt-format torch_dist (the default), which any schedule and layout loads"
            )
    if problems:
        raise BitPipeConfigError("invalid arguments:\n  " + "\n  ".join(problems))


def _evaluation_batch_problems(args: argparse.Namespace, choice: ScheduleChoice) -> List[str]:
    """The schedule's micro-batch rules for Megatron-LM's evaluation batch (core_v0.19.0's
    ``--eval-global-batch-size`` / ``--eval-micro-batch-size``, which ``validate_args`` fills from
    the training ones, and beside a step batch-size schedule from ``--micro-batch-size`` x DP:
    one micro-batch), where it differs from the training batch's; none without evaluation or at
    tags without the flags."""
    batch, micro = getattr(args, "eval_global_batch_size", None), getattr(args, "eval_micro_batch_size", None)
    if batch is None or micro is None or not (getattr(args, "eval_iters", 0) or 0) > 0:
        return []
    data_parallel = args.world_size // model_parallel_size_of(args)
    if batch % (micro * data_parallel):
        return []  # Megatron-LM's own check says so
    source = f"evaluation micro-batches per data-parallel rank (--eval-global-batch-size {batch} / (--eval-micro-batch-size {micro} x data-parallel size {data_parallel}))"
    pp = args.pipeline_model_parallel_size
    every = choice.problems(pp, batch // (micro * data_parallel), None, microbatches=source, virtual_size_flag=VIRTUAL_SIZE_FLAG)
    return [p for p in every if p not in choice.problems(pp, None, None, virtual_size_flag=VIRTUAL_SIZE_FLAG)]


def _megatron_lm_ramp_problems(args: argparse.Namespace, ramp, choice: ScheduleChoice) -> List[str]:
    """The schedule's rules for every step of Megatron-LM's ramp (``--train-iters`` steps, or
    those ``--train-samples`` gives), on the namespace after ``validate_args``."""
    return ramp_problems(
        ramp, choice, args.pipeline_model_parallel_size, args.micro_batch_size, args.world_size // model_parallel_size_of(args),
        train_iters=getattr(args, "train_iters", None), train_samples=getattr(args, "train_samples", None),
    )  # fmt: skip


def configure_optimizer_checkpoints(args: argparse.Namespace) -> None:
    """Switch on Megatron-LM's ``--dist-ckpt-optim-fully-reshardable`` (its checkpointing reads
    it from its own namespace) where a plan-executed schedule runs with
    ``--use-distributed-optimizer``: ``fully_reshardable`` is the only form its per-chunk
    distributed optimizers save; says so on rank 0. Local; after :func:`validate_megatron_lm_args`,
    before the run's :class:`~megatron_bitpipe.run_config.RunConfig` is made."""
    choice = ScheduleChoice(resolved_schedule(args))
    if not (choice.plan_executed and getattr(args, "use_distributed_optimizer", False)) or args.dist_ckpt_optim_fully_reshardable:
        return
    args.dist_ckpt_optim_fully_reshardable = True
    if args.rank == 0:
        print(
            f"megatron_bitpipe: --pipeline-schedule {choice.schedule} with --use-distributed-optimizer saves "
            "its optimizer state fully reshardable (--dist-ckpt-optim-fully-reshardable)",
            flush=True,
        )


def context_parallel_problems(args: argparse.Namespace, schedule: str) -> List[str]:
    """The rules of ``--context-parallel-size`` > 1 with a plan-executed ``schedule`` on
    Megatron-LM's namespace after ``validate_args``, one line per broken rule (local: imports the
    ``--spec`` module, as Megatron-LM's model builder will).

    The chunks' core attention must be this package's SDPA one, the only local attention that
    splits keys and values over the context-parallel group (megatron-core's local
    ``DotProductAttention`` asserts a context-parallel size of 1): ``--transformer-impl local``
    and a ``--spec`` whose layers use :class:`~megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention`
    (:data:`SDPA_SPEC`), every ``--cp-comm-type`` one of :data:`CP_COMM_TYPES`, ``--attention-dropout 0``
    (the layer refuses dropout under the split); and none of :data:`_CONTEXT_PARALLEL_CONFLICTS`.
    Megatron-LM's own rules (``--seq-length`` a multiple of ``2 x CP``, the world size a
    multiple of TP x CP x PP) are checked by its ``validate_args`` before.
    """
    cp = args.context_parallel_size
    with_cp = f"with --context-parallel-size {cp} and --pipeline-schedule {schedule}"
    spec_flag = "--spec " + " ".join(SDPA_SPEC)
    problems = []
    if getattr(args, "transformer_impl", "local") != "local":
        problems.append(
            f"--transformer-impl {args.transformer_impl} cannot be used {with_cp}: Transformer Engine's context-parallel "
            f"attention is not wired to {schedule}'s chunks (a GPU-only path, not run here); use --transformer-impl local "
            f"with {spec_flag}"
        )
    elif not _spec_uses_sdpa(getattr(args, "spec", None)):
        given = "no --spec" if not getattr(args, "spec", None) else "--spec " + " ".join(args.spec)
        problems.append(
            f"--context-parallel-size {cp} with --pipeline-schedule {schedule} needs {spec_flag} (or a layer spec of yours "
            f"whose core attention is SdpaDotProductAttention), got {given}: megatron-core's local DotProductAttention "
            "has no context parallelism"
        )
    unsupported = [value for value in _as_list(getattr(args, "cp_comm_type", None) or []) if value not in CP_COMM_TYPES]
    for value in dict.fromkeys(unsupported):
        problems.append(
            f"--cp-comm-type {value} cannot be used {with_cp}: the SDPA attention exchanges keys and values by "
            f"{' or '.join(CP_COMM_TYPES)} only (megatron-core's names; Megatron-LM's default is p2p)"
        )
    if (getattr(args, "attention_dropout", 0.0) or 0.0) > 0:
        problems.append(
            f"--attention-dropout {args.attention_dropout} cannot be used {with_cp}: the SDPA attention refuses dropout "
            "under the split (Megatron-LM's default is 0.1); pass --attention-dropout 0"
        )
    for attribute, flag, reason in _CONTEXT_PARALLEL_CONFLICTS:
        if getattr(args, attribute, None):
            problems.append(f"{flag} cannot be used {with_cp}: {reason}")
    return problems


def _spec_uses_sdpa(spec) -> bool:
    """Whether Megatron-LM's ``--spec MODULE NAME`` names a layer spec whose self-attention's
    core attention is SdpaDotProductAttention (False for no spec, ``--spec local``, a name that
    does not import or not a layer spec)."""
    import importlib

    from ..model.sdpa_attention import SdpaDotProductAttention, uses_core_attention

    if not spec or len(spec) != 2:
        return False
    try:
        layer_spec = getattr(importlib.import_module(spec[0]), spec[1])
    except (ImportError, AttributeError):
        return False
    return hasattr(layer_spec, "submodules") and uses_core_attention(layer_spec, SdpaDotProductAttention)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def moe_problems(args: argparse.Namespace, schedule: str, num_pipelines: int) -> List[str]:
    """The mixture-of-experts rules of a plan-executed ``schedule`` (``num_pipelines`` pipelines
    in its placement) on Megatron-LM's namespace after ``validate_args``, one line per broken rule.

    The ranks of one expert-parallel group exchange tokens inside every MoE layer, so they must
    run the same stage at the same time: they are consecutive data-parallel ranks of one pipeline
    rank (``--expert-model-parallel-size`` divides the data-parallel size; megatron's expert rank
    order then gives the same groups as the placement's), with expert tensor parallelism equal to
    tensor parallelism.
    """
    ep, dp, tp = args.expert_model_parallel_size, args.data_parallel_size, args.tensor_model_parallel_size
    problems = expert_bias_problems(args) if getattr(args, "transformer_impl", "local") == "local" else []
    if dp % ep:
        problems.append(
            f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} with --pipeline-schedule {schedule}: "
            "an expert-parallel group's ranks exchange tokens in every MoE layer, so they must be data-parallel copies of "
            "one pipeline rank, which run each stage at the same time"
        )
    expert_tp = getattr(args, "expert_tensor_parallel_size", None)
    if expert_tp not in (None, tp):
        problems.append(
            f"--expert-tensor-parallel-size {expert_tp} must equal --tensor-model-parallel-size {tp} with "
            f"--pipeline-schedule {schedule} (its groups split the experts like the dense layers)"
        )
    if "global_aux_loss" in _as_list(args.moe_router_load_balancing_type):
        problems.append(
            f"--moe-router-load-balancing-type global_aux_loss cannot be used with --pipeline-schedule {schedule}: its "
            "statistics span the data-parallel ranks and micro-batches of a step, which the placement's pipelines run "
            "at different times"
        )
    if args.moe_token_dispatcher_type == "flex":
        problems.append(
            f"--moe-token-dispatcher-type flex cannot be used with --pipeline-schedule {schedule}: use allgather or alltoall, "
            "which exchange tokens over the chunk's expert-parallel group"
        )
    if num_pipelines > 1 and getattr(args, "moe_router_enable_expert_bias", False):
        problems.append(
            f"--moe-router-enable-expert-bias cannot be used with --pipeline-schedule {schedule}: each layer has a copy in "
            f"each of its {num_pipelines} pipelines, and megatron updates a router's expert bias from the tokens its own "
            "copy routed, so the copies would drift apart"
        )
    for attribute, flag, reason in _MOE_CONFLICTS:
        if getattr(args, attribute, None):
            problems.append(f"{flag} cannot be used with --num-experts and --pipeline-schedule {schedule}: {reason.format(schedule=schedule)}")
    return problems
