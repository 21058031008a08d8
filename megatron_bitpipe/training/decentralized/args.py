"""Flags of the decentralized data-parallel modes and their rules (pure Python, no torch).

``--data-parallel-mode decentlam | dmsgd | lsgd`` (the flag and its modes:
:mod:`megatron_bitpipe.data_parallel_modes`):

* ``--gossip-topology {ring,exponential,complete}`` (default exponential): the graph whose
  neighbours a DecentLaM / DmSGD replica averages with;
* ``--lsgd-group-size`` (replicas per local group, default: all of them),
  ``--lsgd-pull-local`` / ``--lsgd-pull-global`` (λ_l, λ_g, default 0.1 each) and
  ``--lsgd-period`` (τ, iterations between leader elections, default 1).

:func:`decentralized_problems` lists every broken rule, naming the flags; the rule shared by
all three modes is that they are SGD methods: they need ``--optimizer sgd`` (β =
``--sgd-momentum``), and they keep replicas that differ, so no ``--use-distributed-optimizer``
(it shards one model's state over the data-parallel replicas) and no ``--fp16`` (a replica
whose dynamic loss scale overflows skips its step while its neighbours wait for its
parameters). :class:`DecentralizedSettings` holds the values with defaults filled in.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List

from ...data_parallel_modes import DECENTLAM, DMSGD, LSGD, data_parallel_mode, decentralized_modes, selected_mode
from ...flag_set import FlagSet

__all__ = [
    "GOSSIP_MODES",
    "TOPOLOGIES",
    "DecentralizedSettings",
    "DECENTRALIZED_FLAGS",
    "add_decentralized_args",
    "decentralized_problems",
]

#: the modes that average with graph neighbours every iteration (the others: LSGD's leaders)
GOSSIP_MODES = (DECENTLAM, DMSGD)
TOPOLOGIES = ("ring", "exponential", "complete")
_LSGD_FLAGS = {
    "lsgd_group_size": "--lsgd-group-size",
    "lsgd_pull_local": "--lsgd-pull-local",
    "lsgd_pull_global": "--lsgd-pull-global",
    "lsgd_period": "--lsgd-period",
}
DEFAULT_PULL = 0.1


def add_decentralized_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the decentralized modes' flags to ``parser`` (returns it)."""
    group = parser.add_argument_group(title="decentralized data parallelism (decentlam, dmsgd, lsgd)")
    group.add_argument(
        "--gossip-topology",
        choices=TOPOLOGIES,
        default=None,
        help="decentlam, dmsgd: the graph of the data-parallel replicas; each averages with its neighbours by "
        "batched p2p. ring: 2 neighbours (weights 1/3); exponential (default): the replicas 2^0, 2^1, ... ahead "
        "(log2 n neighbours, weights 1/(log2 n + 1)); complete: all (weights 1/n; decentlam is then synchronous "
        "momentum SGD)",
    )
    group.add_argument(
        "--lsgd-group-size",
        type=int,
        default=None,
        help="lsgd: replicas per local group (consecutive data-parallel ranks, e.g. one node), each with its local "
        "leader (default: the data-parallel size, one group)",
    )
    group.add_argument(
        "--lsgd-pull-local",
        type=float,
        default=None,
        help=f"lsgd: λ_l, the pull toward the local leader: x <- x - lr (g + λ_l (x - x_local) + λ_g (x - x_global)) "
        f"(default {DEFAULT_PULL})",
    )
    group.add_argument("--lsgd-pull-global", type=float, default=None, help=f"lsgd: λ_g, the pull toward the global leader (default {DEFAULT_PULL})")
    group.add_argument(
        "--lsgd-period",
        type=int,
        default=None,
        help="lsgd: τ, iterations between leader elections (default 1): every τ iterations the replicas with the "
        "lowest mean training loss over the period become the leaders and only they send their parameters",
    )
    return parser


@dataclass(frozen=True)
class DecentralizedSettings:
    """The decentralized flags with defaults filled in (``mode``: the name; the LSGD values
    unused by the gossip modes, ``topology`` by lsgd)."""

    mode: str
    topology: str
    group_size: int
    pull_local: float
    pull_global: float
    period: int
    momentum: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DecentralizedSettings":
        return cls(
            mode=args.data_parallel_mode,
            topology=args.gossip_topology or "exponential",
            group_size=args.lsgd_group_size or args.data_parallel_size,
            pull_local=DEFAULT_PULL if args.lsgd_pull_local is None else args.lsgd_pull_local,
            pull_global=DEFAULT_PULL if args.lsgd_pull_global is None else args.lsgd_pull_global,
            period=args.lsgd_period or 1,
            momentum=args.sgd_momentum,
        )

    @property
    def gossip(self) -> bool:
        """Whether the mode averages with graph neighbours (else it pulls toward LSGD's leaders)."""
        return data_parallel_mode(self.mode) in GOSSIP_MODES


def decentralized_problems(args: argparse.Namespace) -> List[str]:
    """Every rule the decentralized flags break, one message each naming the flags; no
    communication. Needs the derived ``data_parallel_size``."""
    problems: List[str] = []
    mode = selected_mode(args)
    if args.gossip_topology is not None and mode not in GOSSIP_MODES:
        problems.append(f"--gossip-topology needs --data-parallel-mode {' or '.join(m.name for m in GOSSIP_MODES)} (got {mode.name})")
    given = [flag for dest, flag in _LSGD_FLAGS.items() if getattr(args, dest) is not None]
    if given and mode is not LSGD:
        problems.append(f"{', '.join(given)} need --data-parallel-mode {LSGD.name} (got {mode.name})")
    if mode not in decentralized_modes():
        return problems
    flag = f"--data-parallel-mode {mode.name}"
    if args.optimizer != "sgd":
        problems.append(
            f"{flag} needs --optimizer sgd (got {args.optimizer}): its update is defined on SGD with momentum "
            "(β = --sgd-momentum)"
        )
    if getattr(args, "use_distributed_optimizer", False):
        problems.append(
            f"{flag} keeps data-parallel replicas whose weights differ: drop --use-distributed-optimizer (it shards "
            "one model's optimizer state over the replicas)"
        )
    if args.fp16:
        problems.append(
            f"{flag} does not support --fp16: a replica whose dynamic loss scale overflows skips its step while the "
            "others wait for its parameters; use --bf16 or fp32"
        )
    if mode is LSGD:
        dp = args.data_parallel_size
        size = args.lsgd_group_size
        if size is not None and (size < 1 or dp % size):
            problems.append(f"--lsgd-group-size {size} must be >= 1 and divide the data-parallel size {dp}")
        for dest in ("lsgd_pull_local", "lsgd_pull_global"):
            value = getattr(args, dest)
            if value is not None and not value >= 0:
                problems.append(f"{_LSGD_FLAGS[dest]} must be >= 0 (got {value})")
        if args.lsgd_period is not None and args.lsgd_period < 1:
            problems.append(f"--lsgd-period must be >= 1 (got {args.lsgd_period})")
    return problems


#: the decentralized modes' flags and rules on the pretraining scripts' command line
DECENTRALIZED_FLAGS = FlagSet("decentralized", add_decentralized_args, decentralized_problems, needs_sizes=True)
