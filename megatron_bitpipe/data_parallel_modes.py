"""The data-parallel modes by name: the one list ``--data-parallel-mode``, the run
configuration and the training loop read.

:data:`REGISTRY` (a :class:`~megatron_bitpipe.registry.Registry`) maps each name to its
:class:`DataParallelMode` (what is decided by the mode's name alone, before any model exists),
in the order listings show them;
:func:`register` adds one (a name may be registered once); :func:`data_parallel_mode` looks
one up with a message listing the names; :func:`add_data_parallel_mode_arg` defines the flag.
What a mode does inside the training loop (its iteration, checkpoint state, evaluated
weights, log fields) is its implementation,
:class:`megatron_bitpipe.training.mode.DataParallelStrategy`, registered under the same name
(:mod:`megatron_bitpipe.training.mode_registry`).

Pure Python (no torch): the flag parser and :class:`~megatron_bitpipe.run_config.RunConfig`
import it before ``torch.distributed`` starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, Tuple

from .registry import Registry
__all__ = [
    "ABS_SGD",
    "DECENTLAM",
    "DMSGD",
    "LSGD",
    "REGISTRY",
    "SYNC",
    "DataParallelMode",
    "add_data_parallel_mode_arg",
    "data_parallel_mode",
    "decentralized_modes",
    "mode_names",
    "register",
    "selected_mode",
]

#: what the model chunks' DDP reduces gradients over (the values of
#: :func:`megatron_bitpipe.execution.replicas.wrap_ddp`'s ``gradient_reduction``)
GRADIENT_REDUCTIONS = ("data-parallel", "replicas", "none")


@dataclass(frozen=True)
class DataParallelMode:
    """One value of ``--data-parallel-mode``.

    Attributes:
        name: the flag's value.
        gradient_reduction: what the chunks' DDP reduces gradients over, fixed when the model
            is built: ``data-parallel`` (megatron's all-reduce over the data-parallel group),
            ``replicas`` (within each data-parallel replica only: BitPipe's weight replicas)
            or ``none`` (the mode reduces them itself).
        decentralized: every data-parallel replica keeps weights of its own and the
            optimizer's step is the mode's update (``--optimizer sgd``).
        help: what the mode does, for ``--help`` (modes with the same text are listed together).
        lockstep: the replicas end every iteration together, so a collective over all ranks
            at an iteration's end makes none of them wait (ABS-SGD's replicas run micro-batch
            counts of their own and never wait for one another: false).
    """

    name: str
    gradient_reduction: str
    decentralized: bool
    help: str
    lockstep: bool = True

    def __post_init__(self):
        if self.gradient_reduction not in GRADIENT_REDUCTIONS:
            raise ValueError(f"gradient_reduction {self.gradient_reduction!r} is not one of {GRADIENT_REDUCTIONS}")


#: mode name -> mode, in listing order
REGISTRY: Registry[DataParallelMode] = Registry(
    "a data-parallel mode", lambda name, names: ValueError(f"--data-parallel-mode: unknown mode {name!r}; choose from {names}")
)


#: ``register(mode)``: add a mode under its name (:class:`ValueError` if the name is taken)
register = REGISTRY.add
#: ``data_parallel_mode(name)``: the mode called ``name`` (:class:`ValueError` naming the choices)
data_parallel_mode = REGISTRY.lookup
#: ``mode_names()``: every registered mode's name, in listing order
mode_names = REGISTRY.names


def decentralized_modes() -> Tuple[DataParallelMode, ...]:
    """The modes whose replicas keep weights of their own."""
    return tuple(mode for mode in REGISTRY.values() if mode.decentralized)


SYNC = register(
    DataParallelMode(
        "sync",
        gradient_reduction="data-parallel",
        decentralized=False,
        help="every iteration all-reduces and applies its own gradients (Megatron's data parallelism).",
    )
)
ABS_SGD = register(
    DataParallelMode(
        "abs-sgd",
        gradient_reduction="none",
        decentralized=False,
        help="each iteration applies the previous iteration's gradients, Σ gradient sums / Σ samples over the "
        "replicas, while their all-reduce overlaps this iteration's compute, and each replica processes as many "
        "micro-batches as its speed allows (heterogeneous clusters; see docs/heterogeneous.md).",
        lockstep=False,
    )
)
_DECENTRALIZED_HELP = (
    "decentralized, the replicas' weights differ (--optimizer sgd; see docs/decentralized.md): decentlam averages "
    "with its --gossip-topology neighbours inside its bias-corrected momentum, dmsgd is plain decentralized momentum "
    "SGD, lsgd pulls every replica toward the replicas of lowest loss (leaders)"
)
DECENTLAM = register(DataParallelMode("decentlam", gradient_reduction="replicas", decentralized=True, help=_DECENTRALIZED_HELP))
DMSGD = register(DataParallelMode("dmsgd", gradient_reduction="replicas", decentralized=True, help=_DECENTRALIZED_HELP))
LSGD = register(DataParallelMode("lsgd", gradient_reduction="replicas", decentralized=True, help=_DECENTRALIZED_HELP))


def selected_mode(args: argparse.Namespace) -> DataParallelMode:
    """The mode of a parsed namespace (:data:`SYNC` where the parser has no such flag:
    Megatron-LM's)."""
    return data_parallel_mode(getattr(args, "data_parallel_mode", SYNC.name))


def _help() -> str:
    """Each mode's help, modes of the same text listed together."""
    names_by_text: Dict[str, list] = {}
    for mode in REGISTRY.values():
        names_by_text.setdefault(mode.help, []).append(mode.name)
    return " ".join(f"{', '.join(names)}: {text}" for text, names in names_by_text.items())


def add_data_parallel_mode_arg(parser) -> None:
    """Add ``--data-parallel-mode`` (default :data:`SYNC`) to ``parser`` (a parser or an
    argument group)."""
    parser.add_argument("--data-parallel-mode", choices=mode_names(), default=SYNC.name, help=_help())
