"""Lazy-greedy facility location and CRAIG's weights, per shard (numpy, float64).

For a shard of m samples with proxies g_1..g_m (:mod:`.proxies`), distances
d_ij = ‖g_i − g_j‖ (Euclidean) and similarities s_ij = D − d_ij with D = max d over the shard
(so s ≥ 0 and s_ii = D), the facility-location objective of a set S is
F(S) = Σ_i max_{j∈S} s_ij (F(∅) = 0). It is monotone submodular; CRAIG maximises it greedily
for a given size, which minimises an upper bound on the gradient-sum approximation error.

**Greedy, exactly.** Step t adds the sample of largest marginal gain
Δ(j | S) = Σ_i max(0, s_ij − c_i), c_i = max_{j∈S} s_ij (c = 0 for S = ∅); ties go to the
lowest index. The lazy variant (Minoux) keeps stale gains as upper bounds in a heap: the
popped sample's gain is recomputed, and it is taken when it still beats the next bound
(ties by index again), else pushed back. Gains only fall as S grows (submodularity; in
floating point too, as every term and every partial sum is monotone), so the lazy greedy
makes exactly the brute-force greedy's choices (tests/training/test_coreset.py checks it).

**Weights.** Each sample of the shard is assigned to the most similar selected sample (ties:
the lowest index); a selected sample to itself. γ_j = the samples assigned to j, so Σγ = m.

**Shards.** The n candidates are cut into consecutive shards of at most ``shard_size``
(megatron's training order is already shuffled); a shard of m samples gets
max(1, round(fraction · m)) of them. Memory per shard: the m x m distances, 8 m² bytes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

__all__ = ["Selection", "facility_location", "assign_weights", "similarities", "shard_bounds", "shard_size_of", "select_shard"]


@dataclass(frozen=True)
class Selection:
    """Selected positions (ascending, into the candidates) and their γ (Σγ = candidates)."""

    indices: np.ndarray
    gamma: np.ndarray


def similarities(proxies: np.ndarray) -> np.ndarray:
    """s_ij = D − ‖g_i − g_j‖ (float64, symmetric, s_ii = D = the largest distance)."""
    g = np.asarray(proxies, dtype=np.float64)
    norms = np.einsum("ij,ij->i", g, g)
    squared = norms[:, None] + norms[None, :] - 2.0 * (g @ g.T)
    distances = np.sqrt(np.maximum(squared, 0.0))
    np.fill_diagonal(distances, 0.0)
    distances = np.maximum(distances, distances.T)  # exact symmetry despite rounding
    return distances.max() - distances


def _gain(row: np.ndarray, cover: np.ndarray) -> float:
    return float(np.maximum(row - cover, 0.0).sum())


def facility_location(sim: np.ndarray, k: int, progress: Optional[Callable[[int], None]] = None) -> List[int]:
    """The greedy choice of ``k`` samples for the symmetric non-negative similarity ``sim``
    (m x m), in the order chosen (lazy evaluation; see the module docstring). ``progress(1)``
    is called after each choice."""
    m = sim.shape[0]
    if not 0 < k <= m:
        raise ValueError(f"k must be in [1, {m}] (got {k})")
    cover = np.zeros(m)
    heap: List[Tuple[float, int]] = [(-_gain(sim[j], cover), j) for j in range(m)]
    heapq.heapify(heap)
    chosen: List[int] = []
    while len(chosen) < k:
        _, j = heapq.heappop(heap)
        entry = (-_gain(sim[j], cover), j)
        if heap and entry > heap[0]:
            heapq.heappush(heap, entry)  # stale bound: j is not the best any more
            continue
        chosen.append(j)
        np.maximum(cover, sim[j], out=cover)
        if progress is not None:
            progress(1)
    return chosen


def assign_weights(sim: np.ndarray, chosen: List[int]) -> Selection:
    """γ of the chosen samples: how many samples of the shard each is the most similar chosen
    one for (ties: lowest index; a chosen sample counts for itself)."""
    selected = np.sort(np.asarray(chosen, dtype=np.int64))
    nearest = selected[np.argmax(sim[:, selected], axis=1)]  # argmax: the first (lowest index) of ties
    nearest[selected] = selected
    gamma = np.bincount(nearest, minlength=sim.shape[0])[selected].astype(np.float64)
    return Selection(selected, gamma)


def shard_size_of(m: int, fraction: float) -> int:
    """Samples chosen from a shard of ``m``: max(1, round(fraction · m))."""
    return max(1, int(round(fraction * m)))


def shard_bounds(n: int, shard_size: int) -> Iterator[Tuple[int, int]]:
    """``[start, stop)`` of the consecutive shards of ``n`` candidates."""
    for start in range(0, n, shard_size):
        yield start, min(start + shard_size, n)


def select_shard(proxies: np.ndarray, fraction: float, progress: Optional[Callable[[int], None]] = None) -> Selection:
    """CRAIG's selection within one shard (positions relative to the shard). All samples with
    γ = 1 when the shard keeps every sample."""
    m = proxies.shape[0]
    k = shard_size_of(m, fraction)
    if k == m:
        if progress is not None:
            progress(m)
        return Selection(np.arange(m, dtype=np.int64), np.ones(m))
    sim = similarities(proxies)
    return assign_weights(sim, facility_location(sim, k, progress))
