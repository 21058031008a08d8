"""Gossip graphs of the data-parallel replicas: neighbours and the mixing matrix W (pure Python).

Every graph here is circulant: replica ``i`` averages its own vector with those of the
replicas ``i + s (mod n)`` for each offset ``s`` of :attr:`Topology.offsets`, all with the
same weight ``1 / (len(offsets) + 1)``, and sends its vector to ``i - s``. A row of ``W``
then sums to 1, and so does a column (``W`` is doubly stochastic: the average of all
replicas is what plain averaging would give), because the offsets are distinct modulo ``n``.

* ``ring``: offsets ``{1, n - 1}`` (one offset for ``n = 2``): weights 1/3;
* ``exponential``: offsets ``2^0, 2^1, ... < n`` — the static exponential graph of
  DecentLaM's experiments (log2 n neighbours for a power of two);
* ``complete``: every other replica, weights ``1 / n`` (exact averaging).

One replica sends ``len(offsets)`` copies of its vector per exchange (:attr:`Topology.degree`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["Topology", "topology"]


@dataclass(frozen=True)
class Topology:
    """A circulant gossip graph over ``size`` replicas (see the module docstring)."""

    name: str
    size: int
    offsets: Tuple[int, ...]

    @property
    def degree(self) -> int:
        """Neighbours a replica receives from (and sends to)."""
        return len(self.offsets)

    @property
    def weight(self) -> float:
        """Every nonzero entry of ``W``."""
        return 1.0 / (self.degree + 1)

    def sources(self, replica: int) -> List[int]:
        """The replicas ``replica`` receives from, one per offset (offset order)."""
        return [(replica + s) % self.size for s in self.offsets]

    def destinations(self, replica: int) -> List[int]:
        """The replicas ``replica`` sends to, one per offset (offset order)."""
        return [(replica - s) % self.size for s in self.offsets]

    def matrix(self) -> List[List[float]]:
        """``W[i][j]``: the weight of replica ``j``'s vector in replica ``i``'s average."""
        rows = []
        for i in range(self.size):
            row = [0.0] * self.size
            for j in [i, *self.sources(i)]:
                row[j] = self.weight
            rows.append(row)
        return rows


def topology(name: str, size: int) -> Topology:
    """The graph ``name`` (``ring``, ``exponential``, ``complete``) over ``size`` >= 1 replicas."""
    if size < 1:
        raise ValueError(f"a gossip graph needs at least one replica, got {size}")
    if name == "ring":
        offsets = sorted({1 % size, (size - 1) % size} - {0})
    elif name == "exponential":
        offsets, step = [], 1
        while step < size:
            offsets.append(step)
            step *= 2
    elif name == "complete":
        offsets = list(range(1, size))
    else:
        raise ValueError(f"unknown gossip topology {name!r} (ring, exponential, complete)")
    return Topology(name, size, tuple(offsets))
