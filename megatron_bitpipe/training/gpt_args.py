"""``scripts/pretrain_gpt.py``'s own flags and their checks (pure Python).

:class:`GPTArguments` adds ``--coreset`` (:mod:`.coreset`: train on a CRAIG weighted subset of
the training samples) and Megatron-LM's mixture-of-experts flags
(:mod:`megatron_bitpipe.moe_settings`), and checks them with the common flags;
:class:`~.gpt.GPTTask` inherits these methods.
"""

from __future__ import annotations

import argparse
from typing import List

from ..moe_settings import add_moe_args, moe_problems
from .coreset.identity import add_coreset_args, coreset_problems
from .task import TaskArguments

__all__ = ["GPTArguments"]


class GPTArguments(TaskArguments):
    """GPT's own flags: ``--coreset`` and the mixture-of-experts flags."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_coreset_args(parser)
        add_moe_args(parser)

    def validate(self, args: argparse.Namespace) -> List[str]:
        return coreset_problems(args) + moe_problems(args)
