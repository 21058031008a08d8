"""Gossip graphs of the data-parallel replicas: neighbours and the mixing matrix W (pure Python).

Every graph here is circulant and symmetric: replica ``i`` averages its own vector (weight
:attr:`Topology.self_weight`) with those of the replicas ``i + s (mod n)``, one per offset ``s``
of :attr:`Topology.offsets` (weight ``weights[s]``), and sends its vector to ``i - s``. The
offsets come in pairs ``s, n - s`` of equal weight, so ``W`` is symmetric and doubly
stochastic: the replicas' average evolves as with exact averaging, and W's eigenvalues are
real, which DecentLaM needs (its analysis assumes a symmetric W; on a directed graph, whose
circulant W has complex eigenvalues, its consensus iteration grows without bound — the
directed exponential graph of one peer per offset does that).

* ``ring``: offsets 1 and ``n - 1``, weights 1/3 (one neighbour of weight 1/2 for ``n = 2``);
* ``exponential``: the symmetric exponential graph, offsets ``±2^0, ±2^1, ... (< n)``; ``W``
  is ``(E + Eᵀ) / 2`` for the directed exponential graph ``E`` of DecentLaM's experiments
  (weights ``1 / (L + 1)`` for the ``L`` powers of two below ``n``): self weight
  ``1 / (L + 1)``, each ``±2^k`` neighbour ``1 / (2 (L + 1))`` (twice that where ``2^k`` and
  ``n - 2^j`` coincide, e.g. ``n / 2``). ``2 L - 1`` neighbours for a power of two ``n``
  (3 for 4 replicas, 5 for 8);
* ``complete``: every other replica, weights ``1 / n`` (exact averaging).

One replica sends :attr:`Topology.degree` copies of its vector per exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Tuple

__all__ = ["Topology", "topology"]


@dataclass(frozen=True)
class Topology:
    """A symmetric circulant gossip graph over ``size`` replicas (see the module docstring);
    ``weights`` pairs each offset with its weight, increasing offsets."""

    name: str
    size: int
    weights: Tuple[Tuple[int, float], ...]
    self_weight: float

    @property
    def offsets(self) -> Tuple[int, ...]:
        return tuple(s for s, _ in self.weights)

    @property
    def degree(self) -> int:
        """Neighbours a replica receives from (and sends to)."""
        return len(self.weights)

    def sources(self, replica: int) -> List[int]:
        """The replicas ``replica`` receives from, one per offset (offset order)."""
        return [(replica + s) % self.size for s in self.offsets]

    def destinations(self, replica: int) -> List[int]:
        """The replicas ``replica`` sends to, one per offset (offset order)."""
        return [(replica - s) % self.size for s in self.offsets]

    def row(self, replica: int) -> Dict[int, float]:
        """``{j: W[replica][j]}`` for the nonzero entries."""
        out = {replica: self.self_weight}
        for s, w in self.weights:
            out[(replica + s) % self.size] = w
        return out

    def matrix(self) -> List[List[float]]:
        """``W[i][j]``: the weight of replica ``j``'s vector in replica ``i``'s average."""
        rows = []
        for i in range(self.size):
            row = [0.0] * self.size
            for j, w in self.row(i).items():
                row[j] = w
            rows.append(row)
        return rows


def topology(name: str, size: int) -> Topology:
    """The graph ``name`` (``ring``, ``exponential``, ``complete``) over ``size`` >= 1 replicas."""
    if size < 1:
        raise ValueError(f"a gossip graph needs at least one replica, got {size}")
    weights: Dict[int, Fraction] = {}
    if name in ("ring", "complete"):
        offsets = {1 % size, (size - 1) % size} if name == "ring" else set(range(size))
        offsets.discard(0)
        share = Fraction(1, len(offsets) + 1)
        weights = {s: share for s in offsets}
        self_weight = share
    elif name == "exponential":
        powers, step = [], 1
        while step < size:
            powers.append(step)
            step *= 2
        share = Fraction(1, len(powers) + 1)
        for s in powers:  # (E + Eᵀ) / 2
            for offset in (s, size - s):
                weights[offset] = weights.get(offset, Fraction(0)) + share / 2
        self_weight = share
    else:
        raise ValueError(f"unknown gossip topology {name!r} (ring, exponential, complete)")
    return Topology(name, size, tuple((s, float(weights[s])) for s in sorted(weights)), float(self_weight))
