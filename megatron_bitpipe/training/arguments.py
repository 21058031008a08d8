"""Command-line flags of the pretrain scripts (Megatron-LM's names) and their checks.

:func:`parse_args` builds the parser (common flags, :func:`~megatron_bitpipe.add_bitpipe_args`
and the task's own), parses, fills Megatron-LM's derived values and runs :func:`validate`.
Everything here is pure Python (torch is imported only to ask whether CUDA is available)
and runs before any process group exists, so a bad configuration fails identically on every
rank before any communication: a command line argparse rejects with one
:class:`~megatron_bitpipe.usage.UsageError` line (the closest flag for an unknown one), a
broken rule with one :class:`~megatron_bitpipe.megatron_args.BitPipeConfigError` naming
every offending flag. The files a run reads are checked here too: the ``.bin``/``.idx``
pairs of ``--data-path``.

Derived values (Megatron-LM's conventions): ``world_size`` (``WORLD_SIZE`` of torchrun, 1
for a single process), ``data_parallel_size``, ``num_microbatches`` (per data-parallel rank),
``ffn_hidden_size`` (4 x hidden, or Megatron's SwiGLU size), ``kv_channels``,
``max_position_embeddings`` (``--seq-length``), ``global_batch_size`` (micro-batch x
data-parallel size; ``global_batch_size_defaulted`` says the flag was left out), ``lr_decay_iters`` (``--train-iters``), ``use_mock_data`` (no
``--data-path``), ``recompute_granularity`` (``selective`` with ``--recompute-activations``);
after the checks, ``dataset_train_samples`` (the training samples the dataset must hold:
:func:`~.abs_sgd.train_samples_of`).
The run's decisions (the resolved schedule, layout, precision, batch shape, data-parallel mode,
optimizer, padded vocabulary) are not namespace fields: :meth:`megatron_bitpipe.run_config.RunConfig.from_args`
makes them once from the checked namespace and the tokenizer.

Defaults that differ from Megatron-LM: ``--hidden-dropout`` and ``--attention-dropout`` are 0
(dropout masks are drawn per rank, so only without dropout do two layouts give the same loss
curve), and the vocabulary is padded (:func:`megatron_bitpipe.run_config.padded_vocab_size`) to a multiple of lcm(``--make-vocab-size-divisible-by``,
TP size) rather than their product, so the padded size, the initial weights and checkpoints do
not depend on the TP size (any TP size dividing ``--make-vocab-size-divisible-by``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import signal
from typing import List, Optional, Sequence

from ..megatron_args import (
    PLAN_SCHEDULES,
    RECOMPUTE_MODULES,
    BitPipeConfigError,
    add_bitpipe_args,
    bitpipe_arg_problems,
    microbatch_problems,
    recompute_problems,
    resolved_schedule,
    virtual_size_problems,
)
from ..hfta.settings import HFTA_FLAGS
from ..optimizers import OPTIMIZERS, REX, add_optimizer_args, optimizer_problems
from ..schedules import ScheduleChoice
from ..schedules.layer_split import LayerSplitFlags, chunk_layer_counts, split_problems
from ..schedules.model_shape import shape_problems
from ..schedules.placement import Placement
from ..usage import FlagParser
from ..data_parallel_modes import SYNC, add_data_parallel_mode_arg, selected_mode
from .abs_sgd.args import ABS_SGD_FLAGS, train_samples_of
from .decentralized.args import DECENTRALIZED_FLAGS
from .faults import FAULT_FLAGS

__all__ = [
    "ATTENTION_BACKENDS",
    "BYTE_LEVEL_TOKENIZER",
    "FLAG_SETS",
    "BitPipeConfigError",
    "CHECKPOINT_FORMATS",
    "EXIT_SIGNALS",
    "build_parser",
    "data_path_prefixes",
    "parse_args",
    "validate",
]

#: the rooms beside the core with flags of their own (:class:`~megatron_bitpipe.flag_set.FlagSet`), in
#: ``--help`` order: each adds its flags, and its rules are asked with the common ones
FLAG_SETS = (ABS_SGD_FLAGS, DECENTRALIZED_FLAGS, HFTA_FLAGS, FAULT_FLAGS)
#: --attention-backend values: Megatron-LM's auto and local, and torch's SDPA
ATTENTION_BACKENDS = ("auto", "local", "sdpa")
#: --ckpt-format values (Megatron-LM's spelling)
CHECKPOINT_FORMATS = ("torch_dist",)
#: --tokenizer-type of megatron-core's byte-level tokenizer
BYTE_LEVEL_TOKENIZER = "ByteLevelTokenizer"

#: --tokenizer-type -> the file flags it needs
TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
    BYTE_LEVEL_TOKENIZER: (),  # megatron-core's byte-level tokenizer: no files
}
#: the fewest tokens of ByteLevelTokenizer's vocabulary (one per byte)
BYTE_VOCAB = 256


#: names ``--exit-signal`` accepts (Megatron-LM's spelling: ``SIGTERM``, ``SIGUSR1``, ...)
EXIT_SIGNALS = tuple(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="model")
    group.add_argument("--num-layers", type=int, required=True)
    group.add_argument("--hidden-size", type=int, required=True)
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x --hidden-size (SwiGLU: Megatron's 8/3 rule)")
    group.add_argument("--num-attention-heads", type=int, required=True)
    group.add_argument("--kv-channels", type=int, default=None, help="default --hidden-size / --num-attention-heads")
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=1)
    group.add_argument("--seq-length", type=int, required=True)
    group.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    group.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    group.add_argument("--norm-epsilon", type=float, default=1e-5)
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--hidden-dropout", type=float, default=0.0)
    group.add_argument("--attention-dropout", type=float, default=0.0)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--cross-entropy-loss-fusion", action="store_true", help="megatron-core's fused cross entropy (bf16 logit gradients)")
    group.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native")
    group.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default=None,
        help="default transformer_engine when it is installed, else local",
    )
    group.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="core attention: auto (megatron's: Transformer Engine's with TE layers, else the unfused "
        "DotProductAttention), local (megatron-core's unfused DotProductAttention) or sdpa "
        "(torch's scaled_dot_product_attention: flash/memory-efficient kernels on GPUs, no [b, heads, s, s] "
        "tensor); local and sdpa run megatron-core's local layers",
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=1)
    group.add_argument("--global-batch-size", type=int, default=None, help="default --micro-batch-size x data-parallel size")
    group.add_argument("--train-iters", type=int, required=True)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true", help="bf16 weights and activations, fp32 main weights (GPU only)")
    group.add_argument("--fp16", action="store_true", help="fp16 with loss scaling (GPU only)")
    group.add_argument("--loss-scale", type=float, default=None, help="fp16 static loss scale (default dynamic)")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    group.add_argument("--lr", type=float, required=True)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", REX), default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-init", type=float, default=0.0)
    group.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="Momentum factor for sgd")
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard the optimizer state (fp32 main weights, Adam moments) over each chunk's data-parallel "
        "(BitPipe: replica x data-parallel) group: megatron-core's distributed optimizer",
    )
    group.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="on --load, take the learning-rate and weight-decay schedule from these flags, not the checkpoint",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        dest="use_checkpoint_opt_param_scheduler",
        help="on --load, keep the checkpoint's learning-rate and weight-decay schedule (these flags' values are ignored)",
    )
    group.add_argument("--exit-interval", type=int, default=None, help="save and exit 0 after every iteration divisible by this")
    group.add_argument(
        "--exit-duration-in-mins", type=float, default=None, help="save and exit 0 after the first iteration ending this many minutes after start"
    )
    group.add_argument(
        "--exit-signal-handler", action="store_true", help="on --exit-signal: finish the iteration, save and exit 0"
    )
    group.add_argument("--exit-signal", choices=EXIT_SIGNALS, default="SIGTERM", metavar="SIGNAL", help="e.g. SIGTERM (default), SIGUSR1")
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="recompute the core attention of every layer in backward (= --recompute-granularity selective)",
    )
    group.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: keep only the inputs of groups of layers (--recompute-method, --recompute-num-layers) and "
        "recompute the rest in backward; selective: recompute --recompute-modules of every layer",
    )
    group.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="with full recompute: uniform recomputes every group of --recompute-num-layers layers of a model "
        "chunk, block only the first --recompute-num-layers layers of each chunk",
    )
    group.add_argument("--recompute-num-layers", type=int, default=None, help="layers per group (uniform) or per chunk (block)")
    group.add_argument(
        "--recompute-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help=f"with selective recompute: any of {', '.join(RECOMPUTE_MODULES)} (default core_attn)",
    )


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    group.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="transformer layers of a pipeline's first stage (megatron's interleaved schedule: of the first rank); "
        "the rest fill the middle stages equally (default: equal stages)",
    )
    group.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="transformer layers of a pipeline's last stage (megatron's interleaved schedule: of the last rank)",
    )
    group.add_argument(
        "--account-for-embedding-in-pipeline-split",
        action="store_true",
        help="count the embedding as one layer when splitting the layers into equal stages (the first stage holds one less)",
    )
    group.add_argument(
        "--account-for-loss-in-pipeline-split",
        action="store_true",
        help="count the loss as one layer when splitting the layers into equal stages (the last stage holds one less)",
    )
    group.add_argument(
        "--pipeline-model-parallel-layout",
        default=None,
        help="every stage's layers in pipeline order, e.g. 'Et|(tt|)*2,tL': E embedding, t transformer layer, L loss, "
        "| between stages, x*n and (...)*n repeat, commas cosmetic",
    )
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="ranks splitting each sequence (megatron's load-balanced split; GPT with --attention-backend sdpa, "
        "see docs/context_parallel.md)",
    )
    group.add_argument(
        "--cp-comm-type",
        choices=("all_gather", "p2p", "a2a", "a2a+p2p"),
        default="all_gather",
        help="how context-parallel attention exchanges keys and values (megatron's names): all_gather (default) or "
        "p2p (a ring with log-sum-exp merging); a2a and a2a+p2p are not built (docs/context_parallel.md)",
    )
    group.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None, help="default nccl with a GPU, gloo without")
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        metavar="MINUTES",
        help="a rank that waits this long in one communication ends the whole job with one line naming the hung or "
        "failed rank, the iteration and where the others waited (exit status 3); fractions are allowed, e.g. 0.1 "
        "(6 s) in tests (default 10)",
    )
    group.add_argument(
        "--overlap-p2p-comm",
        action="store_true",
        help="megatron's interleaved schedule: overlap its p2p with compute (bitpipe's plans post each receive where the plan says, right after the previous action, with or without the flag)",
    )
    group.add_argument("--overlap-grad-reduce", action="store_true", help="overlap the data-parallel gradient reduction (always on with bitpipe)")
    group.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="overlap the distributed optimizer's parameter all-gather with the next forward: each chunk's gather starts "
        "right after its step, in stage order, and its first forward waits for it (needs --use-distributed-optimizer "
        "and --overlap-grad-reduce, as in Megatron-LM)",
    )
    add_bitpipe_args(parser)
    add_data_parallel_mode_arg(parser.add_argument_group(title="data-parallel mode"))


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--log-json", default=None, metavar="PATH", help="one JSON object per iteration (rank 0 writes)")
    group.add_argument("--tensorboard-dir", default=None)
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100, help="global batches per evaluation; 0 disables it")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", default=None, metavar="DIR")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--load", default=None, metavar="DIR")
    group.add_argument("--ckpt-step", type=int, default=None, help="iteration to load (default: the latest under --load)")
    group.add_argument(
        "--ckpt-format",
        choices=CHECKPOINT_FORMATS,
        default="torch_dist",
        help="megatron-core's distributed checkpoint format (Megatron-LM's default); the only one supported",
    )
    group.add_argument("--no-save-optim", action="store_true", help="save the model without the optimizer state and schedule")
    group.add_argument("--no-save-rng", action="store_true", help="save without the random number generators' states")
    group.add_argument("--no-load-optim", action="store_true", help="load the weights and progress, not the optimizer state and schedule")
    group.add_argument("--no-load-rng", action="store_true", help="do not restore the random number generators' states")
    group.add_argument(
        "--finetune",
        action="store_true",
        help="load the weights only: iteration, consumed samples, optimizer, schedule and RNG start afresh",
    )
    group.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="with --load: stop (status 1) instead of starting from scratch when it holds no checkpoint",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="data")
    group.add_argument("--data-path", nargs="*", default=None, help="[weight] prefix ... of Megatron indexed datasets")
    group.add_argument("--split", default="969, 30, 1")
    group.add_argument("--data-cache-path", default=None)
    group.add_argument("--mock-data", action="store_true", help="synthetic data (the default without --data-path)")
    group.add_argument("--tokenizer-type", choices=tuple(TOKENIZER_FILES), default=None)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-size", type=int, default=None, help="vocabulary of NullTokenizer and mock data; of ByteLevelTokenizer (at least 256, default 512)")
    group.add_argument("--eod-mask-loss", action="store_true")


def build_parser(task=None, prog: Optional[str] = None) -> FlagParser:
    """The pretrain scripts' parser: common flags plus ``task.add_arguments`` (if any)."""
    parser = FlagParser(prog=prog)
    for add in (_add_model_args, _add_training_args, _add_parallel_args, _add_logging_args, _add_checkpoint_args, _add_data_args):
        add(parser)
    add_optimizer_args(parser)
    for flag_set in FLAG_SETS:
        flag_set.add_args(parser)
    if task is not None:
        task.add_arguments(parser)
    return parser


def _fill_derived(args: argparse.Namespace, world_size: int, cuda_available: bool) -> None:
    args.world_size = world_size
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * max(args.context_parallel_size, 1)
    args.data_parallel_size = max(world_size // max(model_parallel, 1), 1)
    args.global_batch_size_defaulted = args.global_batch_size is None
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    args.num_microbatches = args.global_batch_size // per_step if per_step > 0 else 0
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.kv_channels is None and args.num_attention_heads > 0:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron-LM's rule: nothing to split
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available else "gloo"
    args.use_mock_data = not args.data_path
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"  # Megatron-LM's meaning of --recompute-activations


def _positive(args, names: Sequence[str]) -> List[str]:
    return [f"{_flag(n)} must be positive (got {getattr(args, n)})" for n in names if getattr(args, n) is None or getattr(args, n) <= 0]


def _model_problems(args) -> List[str]:
    """The model's sizes (the rules of :func:`~megatron_bitpipe.schedules.model_shape.shape_problems`,
    the simulator's too) and how the layout splits them."""
    problems = _positive(
        args, ("train_iters", "global_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size")
    )
    problems += shape_problems(
        args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
        micro_batch_size=args.micro_batch_size, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        position_embedding_type=args.position_embedding_type, max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
    )  # fmt: skip
    if problems:
        return problems
    if args.num_query_groups % args.tensor_model_parallel_size and args.tensor_parallel_mode == "1d":
        problems.append(
            f"--num-query-groups {args.num_query_groups} (= --num-attention-heads without --group-query-attention) "
            f"must be divisible by --tensor-model-parallel-size {args.tensor_model_parallel_size}"
        )
    if args.sequence_parallel and args.seq_length % args.tensor_model_parallel_size:
        problems.append(
            f"--sequence-parallel needs --seq-length {args.seq_length} divisible by --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size}"
        )
    return problems


def _pipeline_problems(args) -> List[str]:
    """megatron-core's own schedules on this package's chunks: the layers fill equal stages and
    the interleaved schedule's rules (the plan-executed schedules' are in
    :func:`~megatron_bitpipe.megatron_args.bitpipe_arg_problems`)."""
    problems = []
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    interleaved = resolved_schedule(args) == "interleaved"
    if args.pipeline_schedule not in PLAN_SCHEDULES and not _flag_combination_problem(args):
        choice = ScheduleChoice(resolved_schedule(args), virtual_size=vp)
        problems += microbatch_problems(args, choice, args.num_microbatches)
    if interleaved and pp < 2:
        problems.append("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size >= 2")
    if args.tensor_parallel_mode == "optimus2d" and interleaved:
        problems.append(
            "--tensor-parallel-mode optimus2d runs with --pipeline-schedule bitpipe, 1f1b or default, not "
            "with --virtual-pipeline-model-parallel-size"
        )
    return problems


def _flag_combination_problem(args) -> bool:
    """Whether --pipeline-schedule and the virtual size contradict each other (reported by
    :func:`~megatron_bitpipe.megatron_args.bitpipe_arg_problems`)."""
    return bool(virtual_size_problems(args))


def _layer_split_problems(args) -> List[str]:
    """The uneven-layout flags' rules on the placement of the schedule that runs (without them
    the schedule's own rules hold the equal-stage rule; a bad pipeline size is reported there)."""
    flags = LayerSplitFlags.from_args(args)
    placement = _checked_placement(args)
    if not flags.given or placement is None:
        return []
    return split_problems(flags, placement, args.num_layers)


def _checked_placement(args) -> Optional[Placement]:
    """The placement of the schedule that runs, or None where the flags break the schedule's
    pipeline-size rules (reported by those)."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    choice = ScheduleChoice(resolved_schedule(args), virtual_size=vp)
    if choice.problems(pp) or _flag_combination_problem(args):
        return None
    return choice.placement(pp)


def _overlap_problems(args) -> List[str]:
    """Megatron-LM's rules for ``--overlap-param-gather`` (its ``validate_args``), with its flag names."""
    if not getattr(args, "overlap_param_gather", False):
        return []
    problems = []
    if not args.use_distributed_optimizer:
        problems.append("--overlap-param-gather is only supported with the distributed optimizer: add --use-distributed-optimizer")
    if not args.overlap_grad_reduce:
        problems.append("--overlap-param-gather must be used with --overlap-grad-reduce")
    return problems


def _recompute_problems(args) -> List[str]:
    """Megatron-LM's recompute rules for the chunks of the schedule that runs (each distinct
    non-zero number of layers a chunk holds)."""
    problems = []
    if args.recompute_activations and args.recompute_granularity == "full":
        problems.append("--recompute-activations means --recompute-granularity selective: drop one of them")
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    choice = ScheduleChoice(resolved_schedule(args), virtual_size=vp)
    stages = pp if choice.problems(pp) else choice.placement(pp).num_stages  # the schedule's rules report a bad pp
    chunk_sizes = chunk_layer_counts(LayerSplitFlags.from_args(args), _checked_placement(args), args.num_layers, stages)
    for size in chunk_sizes:
        problems += [p for p in recompute_problems(args, size) if p not in problems]
    return problems


def _precision_problems(args, cuda_available: bool) -> List[str]:
    problems = []
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 are mutually exclusive")
    for name in ("bf16", "fp16"):
        if getattr(args, name) and not cuda_available:
            problems.append(f"--{name} needs a CUDA GPU; none is available (train in fp32 on the CPU)")
    if args.distributed_backend == "nccl" and not cuda_available:
        problems.append("--distributed-backend nccl needs CUDA GPUs; use gloo on the CPU")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if args.transformer_impl == "transformer_engine" and not have_te:
        problems.append("--transformer-impl transformer_engine: Transformer Engine is not installed")
    problems += _attention_backend_problems(args)
    return problems


def _attention_backend_problems(args) -> List[str]:
    """--attention-backend local and sdpa replace the core attention of megatron-core's local
    1-D layers (without --transformer-impl they select local layers)."""
    backend = args.attention_backend
    if backend == "auto":
        return []
    problems = []
    if args.transformer_impl == "transformer_engine":
        problems.append(
            f"--attention-backend {backend} is a core attention of megatron-core's local layers; Transformer "
            "Engine has its own fused attention: use --transformer-impl local (or leave it out), or "
            "--attention-backend auto"
        )
    if backend == "sdpa" and args.tensor_parallel_mode != "1d":
        problems.append(
            f"--attention-backend sdpa needs --tensor-parallel-mode 1d (Optimus 2D layers have their own "
            f"attention; got {args.tensor_parallel_mode})"
        )
    return problems


def _context_parallel_problems(args, task) -> List[str]:
    """--context-parallel-size: what it runs with (docs/context_parallel.md)."""
    cp = args.context_parallel_size
    if cp < 1:
        return [f"--context-parallel-size must be positive (got {cp})"]
    if args.cp_comm_type in ("a2a", "a2a+p2p"):
        return [
            f"--cp-comm-type {args.cp_comm_type} is not built: it moves attention heads between context-parallel "
            "ranks (all-to-all), which the SDPA layer does not do; use all_gather or p2p"
        ]
    if cp == 1:
        return []
    flag = f"--context-parallel-size {cp}"
    rules = [
        (args.seq_length % (2 * cp) != 0, f"needs --seq-length {args.seq_length} divisible by 2 x {cp} (two chunks per rank)"),
        (args.attention_backend != "sdpa", "needs --attention-backend sdpa (megatron-core's local attention has no context parallelism)"),
        (
            resolved_schedule(args) not in PLAN_SCHEDULES or args.pipeline_model_parallel_size < 2,
            f"runs with the plan-executed schedules ({', '.join(PLAN_SCHEDULES)}) at --pipeline-model-parallel-size >= 2; "
            "megatron-core's own schedule functions (1f1b, interleaved, one stage) are not checked with it",
        ),
        (getattr(task, "name", "gpt") != "gpt", "is supported for GPT only (BERT's padding mask is not split)"),
        (args.tensor_parallel_mode != "1d", "needs --tensor-parallel-mode 1d"),
        (bool(getattr(args, "num_experts", None)), "with --num-experts is not supported"),
        (bool(getattr(args, "hfta_models", None)), "with --hfta-models is not supported"),
        (getattr(args, "coreset", None) is not None, "with --coreset is not supported"),
        (args.attention_dropout > 0, f"needs --attention-dropout 0 (got {args.attention_dropout})"),
        (selected_mode(args) != SYNC, f"needs --data-parallel-mode sync (got {selected_mode(args).name})"),
    ]
    return [f"{flag} {rule}" for broken, rule in rules if broken]


def _schedule_problems(args) -> List[str]:
    problems = []
    if args.lr_decay_iters <= args.lr_warmup_iters:
        problems.append(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters {args.lr_decay_iters}")
    if args.min_lr > args.lr:
        problems.append(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    if args.lr_warmup_init > args.lr:
        problems.append(f"--lr-warmup-init {args.lr_warmup_init} must not exceed --lr {args.lr}")
    for name in ("log_interval",):
        if getattr(args, name) <= 0:
            problems.append(f"{_flag(name)} must be positive")
    if args.eval_iters < 0:
        problems.append("--eval-iters must be >= 0")
    if args.eval_iters > 0 and args.eval_interval <= 0:
        problems.append("--eval-interval must be positive (or set --eval-iters 0)")
    if args.distributed_timeout_minutes <= 0:
        problems.append(f"--distributed-timeout-minutes must be positive (got {args.distributed_timeout_minutes:g})")
    for name in ("exit_interval", "exit_duration_in_mins"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            problems.append(f"{_flag(name)} must be positive")
    if args.ckpt_step is not None and args.load is None:
        problems.append("--ckpt-step needs --load DIR")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        problems.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually exclusive")
    if args.save_interval is not None:
        if args.save is None:
            problems.append("--save-interval needs --save DIR")
        if args.save_interval <= 0:
            problems.append("--save-interval must be positive")
    return problems


def data_path_prefixes(data_path: Sequence[str]) -> List[str]:
    """The dataset prefixes of ``--data-path`` (``prefix ...`` or ``weight prefix ...``, read
    as megatron-core's ``get_blend_from_list`` reads them)."""
    if len(data_path) % 2:
        return list(data_path)
    try:
        [float(weight) for weight in data_path[::2]]
    except ValueError:
        return list(data_path)
    return list(data_path[1::2])


def _missing_dataset_problem(prefix: str) -> Optional[str]:
    """Why ``prefix`` is not a Megatron indexed dataset (its ``.bin`` and ``.idx``), with the
    nearest prefix there is; None if both files exist."""
    missing = [prefix + suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
    if not missing:
        return None
    problem = f"--data-path {prefix}: {' and '.join(missing)} not found"
    directory = os.path.dirname(prefix) or "."
    if prefix.endswith((".bin", ".idx")):
        return problem + " (give the prefix, without .bin/.idx)"
    if not os.path.isdir(directory):
        return problem + f" (no directory {directory})"
    prefixes = sorted(
        os.path.join(os.path.dirname(prefix), name[: -len(".bin")])
        for name in os.listdir(directory)
        if name.endswith(".bin") and os.path.isfile(os.path.join(directory, name[: -len(".bin")] + ".idx"))
    )
    near = [p for p in prefixes if os.path.basename(p).startswith(os.path.basename(prefix))] or difflib.get_close_matches(prefix, prefixes, n=1)
    if near:
        return problem + f" (did you mean {near[0]}?)"
    return problem + " (scripts/preprocess_data.py writes PREFIX_text_document.bin and .idx)"


def _data_problems(args) -> List[str]:
    problems = []
    if args.data_path and args.mock_data:
        problems.append("--mock-data and --data-path are mutually exclusive")
    for prefix in data_path_prefixes(args.data_path or []):
        problem = _missing_dataset_problem(prefix)
        if problem:
            problems.append(problem)
    tokenizer = args.tokenizer_type
    if tokenizer is None:
        if not args.use_mock_data:
            problems.append("--data-path needs --tokenizer-type (and its files)")
        elif args.vocab_size is None:
            problems.append("mock data needs --vocab-size (or a --tokenizer-type with its files)")
    else:
        missing = [_flag(name) for name in TOKENIZER_FILES[tokenizer] if getattr(args, name) is None]
        if missing:
            problems.append(f"--tokenizer-type {tokenizer} needs {' and '.join(missing)}")
    if args.vocab_size is not None and args.vocab_size <= 0:
        problems.append("--vocab-size must be positive")
    elif tokenizer == "ByteLevelTokenizer" and args.vocab_size is not None and args.vocab_size < BYTE_VOCAB:
        problems.append(f"--vocab-size {args.vocab_size}: ByteLevelTokenizer needs at least {BYTE_VOCAB} (one token per byte)")
    return problems


def validate(args: argparse.Namespace, task=None, cuda_available: bool = False) -> None:
    """Raise :class:`BitPipeConfigError` listing every broken rule; no communication."""
    problems = _model_problems(args)
    if not problems:  # later rules divide by these sizes
        problems += bitpipe_arg_problems(args)
        problems += _pipeline_problems(args)
        problems += _layer_split_problems(args)
        problems += _recompute_problems(args)
        problems += [problem for flag_set in FLAG_SETS if flag_set.needs_sizes for problem in flag_set.problems(args)]
    problems += _precision_problems(args, cuda_available)
    problems += _schedule_problems(args)
    problems += _overlap_problems(args)
    problems += _context_parallel_problems(args, task)
    problems += optimizer_problems(args, schedule=resolved_schedule(args))
    problems += _data_problems(args)
    problems += [problem for flag_set in FLAG_SETS if not flag_set.needs_sizes for problem in flag_set.problems(args)]
    if task is not None:
        problems += task.validate(args)
    if problems:
        raise BitPipeConfigError("invalid arguments:\n  " + "\n  ".join(problems))


def parse_args(
    task=None,
    argv: Optional[Sequence[str]] = None,
    *,
    world_size: Optional[int] = None,
    cuda_available: Optional[bool] = None,
    prog: Optional[str] = None,
) -> argparse.Namespace:
    """Parse and check ``argv`` (default ``sys.argv[1:]``) for a job of ``world_size`` ranks.

    ``task`` adds its flags and rules (a :class:`~.task.TaskArguments`); ``world_size``
    defaults to torchrun's ``WORLD_SIZE`` (1 without torchrun); ``cuda_available`` to
    ``torch.cuda.is_available()``; ``prog`` names the script in messages. A command line
    argparse rejects raises :class:`~megatron_bitpipe.usage.UsageError` (``--help`` prints
    and exits 0 as usual); rule violations raise :class:`BitPipeConfigError`.
    """
    parser = build_parser(task, prog)
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    _fill_derived(args, world_size, cuda_available)
    validate(args, task, cuda_available)
    args.dataset_train_samples = train_samples_of(args)  # the mode's rules are checked now
    return args
