"""``--hfta-models``, ``--hfta-lr``, ``--hfta-seeds``: the flags of a horizontally fused array
of GPT or BERT models, their rules and :class:`HftaSettings`, the one place they are read.

Pure Python (no torch): the scripts check the flags before anything heavy is imported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..data_parallel_modes import SYNC
from ..flag_set import FlagSet

__all__ = ["HFTA_FLAGS", "HftaSettings", "add_hfta_args", "hfta_problems", "hfta_settings"]


def _float_list(text: str) -> Tuple[float, ...]:
    try:
        return tuple(float(value) for value in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _int_list(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(value) for value in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_hfta_args(parser: argparse.ArgumentParser) -> None:
    """The HFTA flags (group ``HFTA``)."""
    group = parser.add_argument_group(title="HFTA (horizontally fused training array)")
    group.add_argument(
        "--hfta-models",
        type=int,
        default=None,
        metavar="B",
        help="train B GPT (or BERT) models of the same shape at once as one horizontally fused array (every weight "
        "gets a leading model dimension, linears become batched GEMMs; docs/hfta.md). Default: off",
    )
    group.add_argument(
        "--hfta-lr",
        type=_float_list,
        default=None,
        metavar="LR0,LR1,...",
        help="the B models' peak learning rates; model k's schedule is the one --lr LR_k gives. Default: --lr for all",
    )
    group.add_argument(
        "--hfta-seeds",
        type=_int_list,
        default=None,
        metavar="S0,S1,...",
        help="the B models' initialisation seeds; model k starts from the weights the unfused model gets "
        "with --seed S_k. Default: --seed for all",
    )


@dataclass(frozen=True)
class HftaSettings:
    """A fused array of ``num_models`` models: model ``k`` trains with peak learning rate
    ``lrs[k]`` and starts from the weights of seed ``seeds[k]``."""

    num_models: int
    lrs: Tuple[float, ...]
    seeds: Tuple[int, ...]

    def __post_init__(self):
        if self.num_models < 1 or len(self.lrs) != self.num_models or len(self.seeds) != self.num_models:
            raise ValueError(f"{self.num_models} models need as many learning rates ({self.lrs}) and seeds ({self.seeds})")


def hfta_settings(args: argparse.Namespace) -> Optional[HftaSettings]:
    """The run's :class:`HftaSettings`, or None without ``--hfta-models`` (flags already checked)."""
    if getattr(args, "hfta_models", None) is None:
        return None
    b = args.hfta_models
    return HftaSettings(b, tuple(args.hfta_lr or (args.lr,) * b), tuple(args.hfta_seeds or (args.seed,) * b))


#: argument -> (the values that compose with HFTA, the flag it refuses): what a fused array
#: does not support yet
_NOT_YET = {
    "tensor_parallel_mode": (("1d",), "--tensor-parallel-mode optimus2d"),
    "transformer_impl": ((None, "local"), "--transformer-impl transformer_engine (HFTA's batched layers are local ones)"),
    "fp16": ((False,), "--fp16 (the B models would need one dynamic loss scale; --bf16 composes)"),
    "optimizer": (("adam",), "--optimizer other than adam"),
    "data_parallel_mode": ((SYNC.name,), f"--data-parallel-mode other than {SYNC.name}"),
    "qk_layernorm": ((False,), "--qk-layernorm"),
    "overlap_param_gather": ((False,), "--overlap-param-gather (a fused array's optimizer shards its state itself and gathers nothing)"),
    "apply_layernorm_1p": ((False,), "--apply-layernorm-1p"),
}

#: what a fused BERT array does not support yet, besides :data:`_NOT_YET`
_NOT_YET_BERT = {
    "tensor_model_parallel_size": ((1,), "--tensor-model-parallel-size > 1 for BERT (its heads are megatron's unsplit linears)"),
}


def hfta_problems(args: argparse.Namespace) -> List[str]:
    """Problems with the HFTA flags, each naming its flag (no communication)."""
    b = getattr(args, "hfta_models", None)
    if b is None:
        given = [flag for flag, dest in (("--hfta-lr", "hfta_lr"), ("--hfta-seeds", "hfta_seeds")) if getattr(args, dest, None)]
        return [f"{flag} needs --hfta-models B" for flag in given]
    if b < 1:
        return [f"--hfta-models must be >= 1 (got {b})"]
    problems = []
    for flag, values in (("--hfta-lr", args.hfta_lr), ("--hfta-seeds", args.hfta_seeds)):
        if values is not None and len(values) != b:
            problems.append(f"{flag} gives {len(values)} values for --hfta-models {b}")
    for lr in args.hfta_lr or ():
        if lr <= 0:
            problems.append(f"--hfta-lr {lr}: learning rates must be positive")
        elif lr < args.min_lr:
            problems.append(f"--hfta-lr {lr} is below --min-lr {args.min_lr}")
        elif lr < args.lr_warmup_init:
            problems.append(f"--hfta-lr {lr} is below --lr-warmup-init {args.lr_warmup_init}")
    rules = {**_NOT_YET, **_NOT_YET_BERT} if hasattr(args, "bert_binary_head") else _NOT_YET  # pretrain_bert.py
    refused = [flag for dest, (allowed, flag) in rules.items() if getattr(args, dest, allowed[0]) not in allowed]
    if refused:
        problems.append("--hfta-models does not compose yet with: " + "; ".join(refused))
    return problems


#: HFTA's flags and rules on the pretraining scripts' command line
HFTA_FLAGS = FlagSet("hfta", add_hfta_args, hfta_problems)
