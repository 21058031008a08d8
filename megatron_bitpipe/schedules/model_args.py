"""The schedule command line's model flags (Megatron-LM's names): a
:class:`~.model_shape.ModelShape`, how training stores it (:class:`~.memory.TrainingMemory`)
and the uneven-layout flags (:class:`~.layer_split.LayerSplitFlags`).

The model is optional: without ``--num-layers`` the simulator costs equal stages from the cost
model alone; with it, ``--hidden-size``, ``--num-attention-heads``, ``--seq-length`` and
``--vocab-size`` are required too. Defaults are Megatron-LM's. ``--num-experts`` makes the
layers ``--moe-layer-freq`` selects mixture-of-experts layers (:class:`~.moe_shape.MoEShape`;
the other MoE flags need it).
"""

from __future__ import annotations

import argparse
from typing import Optional

from .costs import Hardware
from .errors import ScheduleConfigError
from .layer_split import EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LOSS_FLAG, LayerSplitFlags
from .memory import OPTIMIZERS, TrainingMemory
from .model_shape import ATTENTION_BACKENDS, NORMALIZATIONS, POSITION_EMBEDDINGS, ModelShape
from ..moe_settings import parse_moe_layer_freq
from .moe_shape import MoEShape

__all__ = ["add_hardware_arguments", "add_model_arguments", "hardware", "layer_split_flags", "model_shape", "training_memory"]

#: the flags a model needs besides --num-layers
_REQUIRED = ("hidden_size", "num_attention_heads", "seq_length", "vocab_size")
#: the MoE flags besides --num-experts, with the defaults that mean "not given"
_MOE_DEFAULTS = {"moe_router_topk": 2, "moe_ffn_hidden_size": None, "moe_layer_freq": 1,
                 "moe_shared_expert_intermediate_size": None, "moe_expert_capacity_factor": None,
                 "expert_model_parallel_size": 1}  # fmt: skip


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
    model.add_argument("--context-parallel-size", type=int, default=1, metavar="CP",
                       help="ranks splitting every sequence (2 CP load-balanced chunks; keys and values all-gathered per "
                       "layer, --t-cp, --cp-bandwidth); the model's costs and memory are one such rank's (default 1)")
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
    _add_moe_arguments(parser)
    if not layout_flags:
        return
    layout = parser.add_argument_group("uneven stages", "Megatron-LM's flags, counted over one pipeline's stages in pipeline order")
    layout.add_argument(FIRST_FLAG, type=int, default=None, metavar="X", help="transformer layers of the first stage")
    layout.add_argument(LAST_FLAG, type=int, default=None, metavar="Y", help="transformer layers of the last stage")
    layout.add_argument(EMBEDDING_FLAG, action="store_true", help="count the embedding as one layer")
    layout.add_argument(LOSS_FLAG, action="store_true", help="count the loss as one layer")
    layout.add_argument(LAYOUT_FLAG, default=None, metavar="LAYOUT", help="e.g. 'Et|tt|tt|tL': every stage's layers")


def _add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    moe = parser.add_argument_group(
        "mixture of experts", "Megatron-LM's MoE flags: with --num-experts, each MoE layer costs its router, top-k experts "
        "and shared expert, its dispatch and combine all-to-alls (--t-a2a, --a2a-bandwidth) and its experts' memory per rank; "
        "tokens per expert are the balanced expectation"
    )
    moe.add_argument("--num-experts", type=int, default=None, metavar="E", help="experts of every MoE layer (default: no MoE layers)")
    moe.add_argument("--moe-router-topk", type=int, default=2, metavar="K", help="experts each token goes to (default 2)")
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None, metavar="F", help="an expert's hidden size (default --ffn-hidden-size)")
    moe.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1, metavar="N|LIST",
                     help="every N-th layer is an MoE layer, or one 0/1 per layer as Megatron-LM's list, e.g. '([1]*3+[0])*2' (default 1)")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, metavar="F",
                     help="the shared expert's hidden size (default: no shared expert)")
    moe.add_argument("--moe-expert-capacity-factor", type=float, default=None, metavar="C",
                     help="tokens an expert keeps, as a fraction of its expected tokens; below 1 the rest are dropped (default: dropless)")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="EP",
                     help="ranks the experts are spread over (E/EP each), within the data-parallel copies of a stage (default 1)")


def _moe_shape(args: argparse.Namespace) -> Optional[MoEShape]:
    """The MoE layers the flags describe, None without ``--num-experts``; ScheduleConfigError
    for MoE flags without it."""
    if args.num_experts is None:
        given = [f"--{k.replace('_', '-')}" for k, default in _MOE_DEFAULTS.items() if getattr(args, k) != default]
        if given:
            raise ScheduleConfigError(f"{', '.join(given)}: the MoE flags need --num-experts")
        return None
    fields = {k: getattr(args, k) for k in _MOE_DEFAULTS}
    if not isinstance(fields["moe_layer_freq"], int):
        fields["moe_layer_freq"] = tuple(fields["moe_layer_freq"])
    return MoEShape(args.num_experts, **fields)


def model_shape(args: argparse.Namespace) -> Optional[ModelShape]:
    """The model the flags describe, None without ``--num-layers``; ScheduleConfigError naming
    a missing or bad flag."""
    if args.num_layers is None:
        given = [f"--{k.replace('_', '-')}" for k in _REQUIRED if getattr(args, k) is not None]
        if given or layer_split_flags(args).given:
            raise ScheduleConfigError(f"{', '.join(given + layer_split_flags(args).names)}: the model's flags need --num-layers")
        if args.num_experts is not None:
            raise ScheduleConfigError("--num-experts: the model's flags need --num-layers")
        if args.context_parallel_size != 1:
            raise ScheduleConfigError("--context-parallel-size: the model's flags need --num-layers")
        return None
    missing = [f"--{k.replace('_', '-')}" for k in _REQUIRED if getattr(args, k) is None]
    if missing:
        raise ScheduleConfigError(f"--num-layers needs {', '.join(missing)} too")
    try:
        moe = _moe_shape(args)
        return ModelShape(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length, vocab_size=args.vocab_size, micro_batch_size=args.micro_batch_size,
            ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups, swiglu=args.swiglu,
            add_bias_linear=not args.disable_bias_linear, normalization=args.normalization,
            position_embedding_type=args.position_embedding_type, max_position_embeddings=args.max_position_embeddings,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, attention_backend=args.attention_backend,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout, moe=moe,
            context_parallel_size=args.context_parallel_size,
        )  # fmt: skip
    except ValueError as error:
        raise ScheduleConfigError(str(error)) from None


#: the hardware flags (:class:`~.costs.Hardware`'s fields) that --weigh-context-parallel costs every layout from
_HARDWARE_FLAGS = ("achieved_tflops", "p2p_latency_ms", "p2p_bandwidth_gbs", "allreduce_bandwidth_gbs", "cp_latency_ms", "cp_bandwidth_gbs")
WEIGH_FLAG = "--weigh-context-parallel"


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """``--weigh-context-parallel`` and the hardware figures it costs every layout from."""
    group = parser.add_argument_group(
        "pipeline against context parallelism", f"with {WEIGH_FLAG}, every split of the -D x --context-parallel-size ranks "
        "into PP stages of CP context-parallel ranks is costed from the model's FLOPs and these figures (milliseconds; "
        "the --t-* flags and --costs do not apply)"
    )
    group.add_argument(WEIGH_FLAG, action="store_true", help="try every PP x CP split of the ranks (needs the model and --achieved-tflops)")
    group.add_argument("--achieved-tflops", type=float, default=None, metavar="TFLOPS", help="sustained matrix-multiply TFLOP/s of one device")
    for name in _HARDWARE_FLAGS[1:]:
        group.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(Hardware, name), metavar="X",
                           help=f"default {getattr(Hardware, name):g}")


def hardware(args: argparse.Namespace) -> Hardware:
    """The hardware figures of ``--weigh-context-parallel``; ScheduleConfigError naming the flag."""
    if args.achieved_tflops is None:
        raise ScheduleConfigError(f"{WEIGH_FLAG} needs --achieved-tflops (every layout is costed from the model's FLOPs)")
    if args.costs or any(getattr(args, k, None) is not None for k in ("t_forward", "t_backward", "t_p2p", "t_sync", "t_cp")):
        raise ScheduleConfigError(f"{WEIGH_FLAG} costs every layout from the hardware flags: drop --costs and the --t-* flags")
    try:
        return Hardware(**{k: getattr(args, k) for k in _HARDWARE_FLAGS}, bytes_per_element=2 if args.bf16 else 4)
    except ValueError as error:
        raise ScheduleConfigError(f"--achieved-tflops / the bandwidth and latency flags: {error}") from None


def training_memory(args: argparse.Namespace, data_parallel_size: int) -> TrainingMemory:
    """How the flags store parameters, gradients and optimizer state."""
    return TrainingMemory(args.bf16, args.optimizer, args.use_distributed_optimizer, data_parallel_size)


def layer_split_flags(args: argparse.Namespace) -> LayerSplitFlags:
    """The uneven-layout flags given (none on a parser without them)."""
    return LayerSplitFlags.from_args(args)
