"""State files of a data-parallel mode next to a checkpoint: what megatron's checkpoint does not
hold (ABS-SGD's gradients in flight, the decentralized modes' per-replica weights).

A mode's state is one JSON file written by rank 0 (``<name>.json``: the format version, the
rank layout that saved it, :func:`~megatron_bitpipe.training.checkpoint.rank_layout`, and the
mode's own fields) and one ``torch.save`` file per rank that has state
(``<name>_rank00000.pt``, by global rank). The mode writes them before the checkpoint itself,
which then makes them part of the latest checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..checkpoint_rules import CheckpointError

__all__ = ["RankStateFiles"]


@dataclass(frozen=True)
class RankStateFiles:
    """The state files of mode ``name`` in format ``version`` (see the module docstring)."""

    name: str
    version: int

    @property
    def common_file(self) -> str:
        """The JSON file's name."""
        return f"{self.name}.json"

    def rank_file(self, rank: int) -> str:
        """Global rank ``rank``'s file name."""
        return f"{self.name}_rank{rank:05d}.pt"

    def save(self, directory: str, rank: int, layout: dict, common: dict, rank_state: Optional[dict]) -> None:
        """Write ``rank_state`` (if any) as this rank's file and, on rank 0, ``common`` with the
        version and ``layout`` as the JSON file."""
        os.makedirs(directory, exist_ok=True)
        if rank_state is not None:
            torch.save(rank_state, os.path.join(directory, self.rank_file(rank)))
        if rank == 0:
            with open(os.path.join(directory, self.common_file), "w", encoding="utf-8") as f:
                json.dump({"version": self.version, "layout": layout, **common}, f, indent=1)

    def read_common(self, directory: str) -> Optional[dict]:
        """The JSON file of checkpoint ``directory``, None when it has none (another mode saved
        it); CheckpointError for another format version."""
        path = os.path.join(directory, self.common_file)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            common = json.load(f)
        if common.get("version") != self.version:
            raise CheckpointError(f"{directory}: {self.common_file} is not version {self.version}")
        return common

    def load_rank(self, directory: str, rank: int) -> dict:
        """Global rank ``rank``'s file of checkpoint ``directory``."""
        return torch.load(os.path.join(directory, self.rank_file(rank)), weights_only=False)
