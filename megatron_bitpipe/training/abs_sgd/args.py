"""ABS-SGD's flags and their rules (pure Python, before any communication).

``--data-parallel-mode abs-sgd`` (the flag and its modes: :mod:`megatron_bitpipe.data_parallel_modes`)
selects ABS-SGD (:mod:`megatron_bitpipe.training.abs_sgd`). The ``--abs-*`` flags shape ABS-SGD's
iterations; ``--emulate-replica-slowdown`` slows data-parallel replicas down in either mode
(a testing and benchmarking aid). :class:`AbsSgdSettings` holds the parsed values with their
defaults filled in; :func:`abs_sgd_problems` lists every broken rule, naming the flags.

Units: counts are micro-batches of ``--micro-batch-size`` samples per data-parallel replica
and iteration; times are seconds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...megatron_args import BitPipeConfigError, schedule_choice
from ...schedules import REGISTRY, ScheduleChoice
from ...data_parallel_modes import ABS_SGD, data_parallel_mode, selected_mode
from ...flag_set import FlagSet

__all__ = [
    "ABS_SGD_FLAGS",
    "TRIGGERS",
    "AbsSgdSettings",
    "add_abs_sgd_args",
    "abs_sgd_problems",
    "train_samples_of",
    "count_rule",
    "CountRule",
]

#: how an ABS-SGD iteration decides each replica's micro-batches
TRIGGERS = ("time", "count", "fixed")
#: --abs-max-microbatches defaults to this many times the synchronous count per replica
DEFAULT_MAX_FACTOR = 4
_ABS_FLAGS = {
    "abs_trigger": "--abs-trigger",
    "abs_step_seconds": "--abs-step-seconds",
    "abs_min_microbatches": "--abs-min-microbatches",
    "abs_max_microbatches": "--abs-max-microbatches",
    "abs_replica_microbatches": "--abs-replica-microbatches",
    "abs_gradient_delay": "--abs-gradient-delay",
}


def _int_list(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> Tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_abs_sgd_args(parser: argparse.ArgumentParser) -> None:
    """Add ABS-SGD's flags and ``--emulate-replica-slowdown`` to ``parser`` (group ``ABS-SGD``;
    ``--data-parallel-mode`` itself: :func:`megatron_bitpipe.data_parallel_modes.add_data_parallel_mode_arg`)."""
    group = parser.add_argument_group(title="ABS-SGD (--data-parallel-mode abs-sgd) and replica slowdown")
    group.add_argument(
        "--abs-trigger",
        choices=TRIGGERS,
        default=None,
        help="abs-sgd: when a replica's iteration ends. time (default): after --abs-step-seconds of compute and "
        "once the previous all-reduce has completed; count: the replicas share --global-batch-size samples in "
        "proportion to their measured speeds; fixed: --abs-replica-microbatches",
    )
    group.add_argument(
        "--abs-step-seconds",
        type=float,
        default=None,
        help="abs-sgd with --abs-trigger time: the shortest compute time of an iteration (default 0: an iteration "
        "lasts until the previous all-reduce has completed, at least --abs-min-microbatches)",
    )
    group.add_argument(
        "--abs-min-microbatches",
        type=int,
        default=None,
        help="abs-sgd: fewest micro-batches a replica processes per iteration (default: the fewest the pipeline "
        "schedule accepts; bitpipe: an even number >= --pipeline-model-parallel-size)",
    )
    group.add_argument(
        "--abs-max-microbatches",
        type=int,
        default=None,
        help=f"abs-sgd: most micro-batches a replica processes per iteration (default {DEFAULT_MAX_FACTOR} x the "
        "synchronous count, --global-batch-size / (--micro-batch-size x data-parallel size))",
    )
    group.add_argument(
        "--abs-replica-microbatches",
        type=_int_list,
        default=None,
        metavar="N0,N1,...",
        help="abs-sgd with --abs-trigger fixed: the micro-batches of each data-parallel replica, every iteration",
    )
    group.add_argument(
        "--abs-gradient-delay",
        type=int,
        choices=(0, 1),
        default=None,
        help="abs-sgd: iterations between computing a gradient and applying it (default 1; 0 applies it in the "
        "same iteration, without overlap: synchronous data parallelism with per-replica batch sizes)",
    )
    group.add_argument(
        "--emulate-replica-slowdown",
        type=_float_list,
        default=None,
        metavar="F0,F1,...",
        help="testing aid: make data-parallel replica r F_r times slower (each rank sleeps (F_r - 1) x the time "
        "of every training forward-backward it runs), to emulate a heterogeneous cluster; one factor >= 1 per "
        "replica, either data-parallel mode",
    )


@dataclass(frozen=True)
class CountRule:
    """Micro-batch counts a replica may run in one iteration: ``lowest..highest`` that the
    pipeline schedule accepts (``multiple``: counts must be multiples of it; ``at_least``:
    the schedule's own minimum)."""

    lowest: int
    highest: int
    multiple: int = 1

    def allowed(self) -> List[int]:
        """Every allowed count, increasing."""
        first = -(-self.lowest // self.multiple) * self.multiple
        return list(range(first, self.highest + 1, self.multiple))

    def accepts(self, count: int) -> bool:
        return self.lowest <= count <= self.highest and count % self.multiple == 0


def _schedule_rules(args: argparse.Namespace) -> Tuple[ScheduleChoice, int]:
    """The schedule the flags run and its pipeline size (megatron's single-stage run obeys
    1F1B's rules: any count >= 1)."""
    try:
        choice = schedule_choice(args)
    except BitPipeConfigError:  # reported by the schedule flags' own check
        choice = ScheduleChoice("1f1b")
    return ScheduleChoice(choice.schedule, virtual_size=choice.virtual_size), args.pipeline_model_parallel_size


def _schedule_multiple(args: argparse.Namespace) -> int:
    """Counts the schedule accepts are multiples of this: its weight replicas (the pipelines
    share the micro-batches equally; bitpipe: 2), or D for megatron's interleaved schedule (the
    one taking a virtual size)."""
    choice, pp = _schedule_rules(args)
    if REGISTRY[choice.schedule].takes_virtual_size:
        return pp
    return choice.weight_replicas(pp)


def _schedule_count_problems(args: argparse.Namespace, count: int, flag: str) -> List[str]:
    choice, pp = _schedule_rules(args)
    return choice.problems(pp, count, microbatches=flag)


@dataclass(frozen=True)
class AbsSgdSettings:
    """The data-parallel mode's flags with defaults filled in (see :func:`add_abs_sgd_args`).

    ``reference_microbatches`` is ``--global-batch-size / --micro-batch-size``: the count
    trigger's global target and the denominator the gradients are pre-scaled by (so that
    equal counts summing to it reproduce synchronous data parallelism's arithmetic).
    ``slowdown`` is one factor per data-parallel replica, or None.
    """

    mode: str
    trigger: str
    step_seconds: float
    rule: CountRule
    replica_microbatches: Optional[Tuple[int, ...]]
    delay: int
    slowdown: Optional[Tuple[float, ...]]
    reference_microbatches: int
    initial_microbatches: int

    @property
    def enabled(self) -> bool:
        return data_parallel_mode(self.mode) is ABS_SGD

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AbsSgdSettings":
        """Settings of parsed, checked flags (derived values of the pretrain parser filled)."""
        return cls(
            mode=args.data_parallel_mode,
            trigger=args.abs_trigger or "time",
            step_seconds=args.abs_step_seconds if args.abs_step_seconds is not None else 0.0,
            rule=count_rule(args),
            replica_microbatches=args.abs_replica_microbatches,
            delay=1 if args.abs_gradient_delay is None else args.abs_gradient_delay,
            slowdown=args.emulate_replica_slowdown,
            reference_microbatches=args.global_batch_size // args.micro_batch_size,
            initial_microbatches=_initial_count(args),
        )


def count_rule(args: argparse.Namespace) -> CountRule:
    """The counts a replica may run: ``--abs-min/max-microbatches`` (defaults: the schedule's
    fewest; :data:`DEFAULT_MAX_FACTOR` x the synchronous count) within the schedule's rules."""
    choice, pp = _schedule_rules(args)
    lowest = args.abs_min_microbatches or choice.smallest_num_microbatches(pp)
    multiple = _schedule_multiple(args)
    highest = args.abs_max_microbatches or max(DEFAULT_MAX_FACTOR * args.num_microbatches, lowest)
    return CountRule(lowest, highest, multiple)


def _initial_count(args: argparse.Namespace) -> int:
    """Count of every replica until speeds are measured: the synchronous count, brought into
    the allowed range."""
    rule = count_rule(args)
    allowed = rule.allowed() or [rule.lowest]
    return min(allowed, key=lambda n: (abs(n - args.num_microbatches), n))


def train_samples_of(args: argparse.Namespace) -> int:
    """Training samples a dataset must hold for ``--train-iters`` iterations.

    Synchronous: ``--train-iters`` x ``--global-batch-size``. ABS-SGD: replica ``r`` reads
    its own stream (samples ``(j x dp + r) x mbs ...``, its ``j``-th micro-batch), so the
    furthest sample any replica can reach bounds the size: every iteration at most the
    largest count per replica.
    """
    samples = args.train_iters * args.global_batch_size
    if selected_mode(args) is not ABS_SGD:
        return samples
    settings = AbsSgdSettings.from_args(args)
    largest = max(settings.replica_microbatches or (settings.rule.highest, args.num_microbatches))
    return max(samples, args.train_iters * largest * args.data_parallel_size * args.micro_batch_size)


def abs_sgd_problems(args: argparse.Namespace) -> List[str]:
    """Every rule the data-parallel flags break, one message each naming the flags; no
    communication. Needs the derived sizes (``data_parallel_size``, ``num_microbatches``)."""
    problems: List[str] = []
    dp = args.data_parallel_size
    slowdown = args.emulate_replica_slowdown
    if slowdown is not None:
        if len(slowdown) != dp:
            problems.append(f"--emulate-replica-slowdown needs one factor per data-parallel replica ({dp}), got {len(slowdown)}")
        if any(not f >= 1.0 for f in slowdown):
            problems.append(f"--emulate-replica-slowdown factors must be >= 1 (a replica can only be slowed down), got {list(slowdown)}")
    if selected_mode(args) is not ABS_SGD:
        given = [flag for dest, flag in _ABS_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            problems.append(f"{', '.join(given)} need --data-parallel-mode {ABS_SGD.name}")
        return problems
    mode = f"--data-parallel-mode {ABS_SGD.name}"
    if args.fp16:
        problems.append(
            f"{mode} does not support --fp16: dynamic loss scaling would unscale a delayed gradient by a later "
            "loss scale; use --bf16 or fp32"
        )
    if getattr(args, "optimizer", "adam") == "onebit_lamb":
        problems.append(
            f"{mode} does not support --optimizer onebit_lamb: its compression stage exchanges momenta instead of "
            "gradients, and ABS-SGD exchanges the delayed gradients itself"
        )
    if args.overlap_grad_reduce:
        problems.append(f"{mode} overlaps its own gradient all-reduce with the next iteration: drop --overlap-grad-reduce")
    if getattr(args, "use_distributed_optimizer", False):
        problems.append(
            f"{mode} all-reduces whole delayed gradients and updates every weight on every rank: drop "
            "--use-distributed-optimizer (its reduce-scatter and sharded update would replace that exchange)"
        )
    trigger = args.abs_trigger or "time"
    if args.abs_step_seconds is not None:
        if trigger != "time":
            problems.append(f"--abs-step-seconds belongs to --abs-trigger time (got --abs-trigger {trigger})")
        elif not args.abs_step_seconds >= 0:
            problems.append(f"--abs-step-seconds must be >= 0 (got {args.abs_step_seconds})")
    fixed = args.abs_replica_microbatches
    if trigger == "fixed":
        if fixed is None:
            problems.append("--abs-trigger fixed needs --abs-replica-microbatches N0,N1,... (one count per replica)")
        elif len(fixed) != dp:
            problems.append(f"--abs-replica-microbatches needs one count per data-parallel replica ({dp}), got {len(fixed)}")
        else:
            for replica, count in enumerate(fixed):
                problems += _schedule_count_problems(args, count, f"--abs-replica-microbatches (replica {replica})")
        for dest in ("abs_min_microbatches", "abs_max_microbatches"):
            if getattr(args, dest) is not None:
                problems.append(f"{_ABS_FLAGS[dest]} does not apply to --abs-trigger fixed (the counts are given)")
        return problems
    if fixed is not None:
        problems.append(f"--abs-replica-microbatches needs --abs-trigger fixed (got --abs-trigger {trigger})")
    for dest in ("abs_min_microbatches", "abs_max_microbatches"):
        value = getattr(args, dest)
        if value is not None:
            if value < 1:
                problems.append(f"{_ABS_FLAGS[dest]} must be >= 1 (got {value})")
            else:
                problems += _schedule_count_problems(args, value, _ABS_FLAGS[dest])
    if problems:
        return problems
    rule = count_rule(args)
    if rule.lowest > rule.highest:
        problems.append(f"--abs-min-microbatches {rule.lowest} exceeds --abs-max-microbatches {rule.highest}")
    elif not rule.allowed():
        problems.append(f"no count between --abs-min-microbatches {rule.lowest} and --abs-max-microbatches {rule.highest} is a multiple of {rule.multiple}")
    elif trigger == "count" and args.global_batch_size // args.micro_batch_size < dp * rule.lowest:
        problems.append(
            f"--abs-trigger count shares --global-batch-size {args.global_batch_size} samples among {dp} replicas: "
            f"too few for --abs-min-microbatches {rule.lowest} x --micro-batch-size {args.micro_batch_size} each"
        )
    return problems


#: ABS-SGD's flags and rules on the pretraining scripts' command line
ABS_SGD_FLAGS = FlagSet("abs-sgd", add_abs_sgd_args, abs_sgd_problems, needs_sizes=True)
