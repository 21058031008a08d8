"""A room's own flags on the pretraining scripts' command line and the rules they keep:
:class:`FlagSet`.

The rooms beside the core (the research lines, fault injection) each define one next to their
flag parser and rule check; the scripts' parser (:mod:`megatron_bitpipe.training.arguments`)
lists them once, adds every set's flags and asks every set's rules, so a room's flags are
changed in the room alone. Pure Python, importing nothing of this package: any room may
define one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, List

__all__ = ["FlagSet"]


@dataclass(frozen=True)
class FlagSet:
    """One room's flags and rules.

    Attributes:
        name: the room, as ``--help`` and messages name it.
        add_args: ``add_args(parser)`` adds the room's flags (in an argument group of its own).
        problems: ``problems(args)`` -> one message per broken rule of the parsed, derived
            namespace, each naming its flag; no communication.
        needs_sizes: the rules divide by the model's and the layout's sizes (the data-parallel
            size, the micro-batches): asked only when those sizes passed their own checks.
    """

    name: str
    add_args: Callable[[argparse.ArgumentParser], None]
    problems: Callable[[argparse.Namespace], List[str]]
    needs_sizes: bool = False
