"""The optimizer flags and their rules, in pure Python (no torch, no megatron-core): the
training scripts parse and check their flags before the heavy imports.

``--optimizer`` takes megatron-core's own ``adam`` and ``sgd`` (:data:`MEGATRON_OPTIMIZERS`,
with Megatron-LM's ``--sgd-momentum``, which the training scripts define as Megatron-LM does)
and this package's :data:`OWN_OPTIMIZERS`. :func:`add_optimizer_args` adds the flags of REX,
LAMB, 1-bit LAMB and Schedule-Free AdamW (Megatron-style names that neither Megatron-LM
core_v0.16.1 nor core_v0.19.0 defines); :func:`optimizer_problems` checks them without
communication; :class:`OptimizerChoice` is what :func:`~.factory.build_megatron_optimizer`
needs of them.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import List, Optional

from ..schedules.registry import plan_executed_schedules

__all__ = [
    "OPTIMIZERS",
    "MEGATRON_OPTIMIZERS",
    "OWN_OPTIMIZERS",
    "REX",
    "OptimizerChoice",
    "add_optimizer_args",
    "optimizer_problems",
]

#: ``--lr-decay-style`` of the REX schedule
REX = "rex"
#: built by megatron-core's ``get_megatron_optimizer`` (Megatron-LM builds them itself)
MEGATRON_OPTIMIZERS = ("adam", "sgd")
#: built by :func:`~.factory.build_megatron_optimizer` around this package's torch optimizers
OWN_OPTIMIZERS = ("lamb", "onebit_lamb", "schedulefree_adamw")
OPTIMIZERS = MEGATRON_OPTIMIZERS + OWN_OPTIMIZERS


@dataclass(frozen=True)
class OptimizerChoice:
    """``--optimizer`` and the flags of this package's optimizers (the rest is megatron's
    ``OptimizerConfig``: lr, betas, eps, SGD's momentum, weight decay, clipping, precision).

    ``decentralized``: a decentralized data-parallel mode runs (``--data-parallel-mode
    decentlam``, ``dmsgd`` or ``lsgd``; the training scripts set it): ``--optimizer sgd`` is
    then built as :class:`~.decentralized_sgd.DecentralizedSGD`, whose step is the mode's
    update (:mod:`megatron_bitpipe.training.decentralized` attaches it)."""

    name: str = "adam"
    lamb_min_coeff: float = 0.01
    lamb_max_coeff: float = 10.0
    onebit_freeze_iters: Optional[int] = None
    sf_warmup_iters: int = 0
    sf_weight_lr_power: float = 2.0
    sf_r: float = 0.0
    decentralized: bool = False

    @property
    def freeze_iteration(self) -> Optional[int]:
        """The iteration after which 1-bit LAMB freezes its variance and starts exchanging
        compressed momenta (``--onebit-freeze-iters``); None for the other optimizers."""
        return self.onebit_freeze_iters if self.name == "onebit_lamb" else None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "OptimizerChoice":
        return cls(
            name=args.optimizer,
            lamb_min_coeff=args.lamb_min_coeff,
            lamb_max_coeff=args.lamb_max_coeff,
            onebit_freeze_iters=args.onebit_freeze_iters,
            sf_warmup_iters=args.lr_warmup_iters or 0,
            sf_weight_lr_power=args.sf_weight_lr_power,
            sf_r=args.sf_r,
        )


def add_optimizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of REX, LAMB, 1-bit LAMB and Schedule-Free AdamW (not ``--optimizer`` or
    ``--lr-decay-style`` themselves, whose choices the caller owns)."""
    group = parser.add_argument_group(title="megatron-bitpipe optimizers")
    group.add_argument("--rex-beta", type=float, default=0.5,
                       help="--lr-decay-style rex: lr = min + (max - min)(1 - z)/(1 - beta z), z the elapsed decay "
                       "fraction; 0.5 is the REX paper's schedule, 0 linear decay")
    group.add_argument("--lamb-min-coeff", type=float, default=0.01, help="lamb, onebit_lamb: lower bound of the trust ratio ||w||/||u||")
    group.add_argument("--lamb-max-coeff", type=float, default=10.0, help="lamb, onebit_lamb: upper bound of the trust ratio")
    group.add_argument("--onebit-freeze-iters", type=int, default=None,
                       help="onebit_lamb: iterations of plain LAMB (full-precision gradient all-reduce) before the "
                       "variance freezes and momenta are exchanged with 1-bit compression")
    group.add_argument("--sf-weight-lr-power", type=float, default=2.0,
                       help="schedulefree_adamw: weights of the averaged iterate are lr_max^power during warm-up")
    group.add_argument("--sf-r", type=float, default=0.0, help="schedulefree_adamw: polynomial weighting power of the average")
    return parser


def optimizer_problems(args: argparse.Namespace, *, schedule: str, megatron_lm: bool = False) -> List[str]:
    """Every broken rule of the optimizer flags, each naming its flags (no communication).

    ``schedule`` is the pipeline schedule that runs (a registered name, ``default`` resolved);
    the rules depend on whether this package's plan executor runs it (its per-chunk DDP and
    optimizers) or megatron-core's functions do. ``megatron_lm`` for Megatron-LM's training loop
    (whose megatron-core schedules build megatron's DDP).
    """
    problems: List[str] = []
    name = getattr(args, "optimizer", "adam")
    if not 0.0 <= args.rex_beta < 1.0:
        problems.append(f"--rex-beta must lie in [0, 1) (got {args.rex_beta})")
    if name == "sgd":
        if not 0.0 <= getattr(args, "sgd_momentum", 0.0) < 1.0:
            problems.append(f"--sgd-momentum must lie in [0, 1) (got {args.sgd_momentum})")
        if getattr(args, "use_distributed_optimizer", False) and (not megatron_lm or schedule in plan_executed_schedules()):
            problems.append(
                "--optimizer sgd cannot be combined with --use-distributed-optimizer here (its per-chunk "
                "distributed optimizers and their checkpoints are built and tested for Adam's state only)"
            )
    if name not in OWN_OPTIMIZERS:
        return problems
    for attribute, flag in (
        ("use_distributed_optimizer", "--use-distributed-optimizer"),
        ("optimizer_cpu_offload", "--optimizer-cpu-offload"),
        ("use_precision_aware_optimizer", "--use-precision-aware-optimizer"),
        ("num_experts", "--num-experts"),
    ):
        if getattr(args, attribute, None):
            problems.append(f"--optimizer {name} cannot be combined with {flag} (megatron builds that only for Adam and SGD)")
    if name in ("lamb", "onebit_lamb") and not 0.0 < args.lamb_min_coeff <= args.lamb_max_coeff:
        problems.append(
            f"--lamb-min-coeff {args.lamb_min_coeff} and --lamb-max-coeff {args.lamb_max_coeff} must satisfy 0 < min <= max"
        )
    if name == "schedulefree_adamw":
        if importlib.util.find_spec("schedulefree") is None:
            problems.append("--optimizer schedulefree_adamw needs the schedulefree package: pip install 'megatron-bitpipe[schedulefree]'")
        if getattr(args, "lr_decay_style", "linear") != "constant":
            problems.append(
                f"--optimizer schedulefree_adamw does not decay the learning rate: use --lr-decay-style constant "
                f"(got {args.lr_decay_style}); --lr-warmup-iters becomes its own warm-up"
            )
        if getattr(args, "lr_warmup_init", 0.0):
            problems.append("--optimizer schedulefree_adamw warms up from 0: --lr-warmup-init must be 0")
        for attribute, flag in (("lr_warmup_fraction", "--lr-warmup-fraction"), ("lr_warmup_samples", "--lr-warmup-samples")):
            if getattr(args, attribute, None):
                problems.append(f"--optimizer schedulefree_adamw takes its warm-up from --lr-warmup-iters, not {flag}")
    if name == "onebit_lamb":
        problems += _onebit_problems(args, schedule, megatron_lm)
    return problems


def _onebit_problems(args, schedule: str, megatron_lm: bool) -> List[str]:
    problems = []
    if args.onebit_freeze_iters is None or args.onebit_freeze_iters < 1:
        problems.append("--optimizer onebit_lamb needs --onebit-freeze-iters N >= 1 (iterations of plain LAMB before compression)")
    why = "the momentum exchange replaces the gradient all-reduce"
    if getattr(args, "fp16", False):
        problems.append(f"--optimizer onebit_lamb cannot be combined with --fp16 ({why}, before loss-scale unscaling); use --bf16")
    if getattr(args, "sequence_parallel", False):
        problems.append(f"--optimizer onebit_lamb cannot be combined with --sequence-parallel ({why}, before the norms' TP gradient sum)")
    if getattr(args, "calculate_per_token_loss", False):
        problems.append(f"--optimizer onebit_lamb cannot be combined with --calculate-per-token-loss ({why})")
    plan_schedules = plan_executed_schedules()
    if schedule not in plan_schedules:
        if megatron_lm:
            problems.append(
                f"--optimizer onebit_lamb runs in Megatron-LM's scripts with --pipeline-schedule {' or '.join(plan_schedules)} only "
                "(megatron's own schedules build a DDP whose gradient all-reduce cannot be replaced)"
            )
        if getattr(args, "overlap_grad_reduce", False):
            problems.append(
                f"--optimizer onebit_lamb cannot be combined with --overlap-grad-reduce under the {schedule} schedule "
                "(megatron's backward hooks would start the gradient all-reduce it replaces)"
            )
        if args.pipeline_model_parallel_size > 1 and not getattr(args, "untie_embeddings_and_output_weights", False):
            problems.append(
                f"--optimizer onebit_lamb with the {schedule} schedule and --pipeline-model-parallel-size > 1 needs "
                "--untie-embeddings-and-output-weights (the tied embedding gradients are summed across ranks after the exchange)"
            )
    return problems
