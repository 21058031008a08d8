"""How many micro-batches each replica runs, and which samples they are (pure Python).

**Streams.** Data-parallel replica ``r`` of ``dp`` reads its own stream: its ``j``-th
micro-batch (counting from the start of training) is the global micro-batch ``j x dp + r``,
i.e. samples ``(j x dp + r) x mbs ... + mbs``. The streams are disjoint, so every sample is
used at most once however many micro-batches each replica runs, and a replica's position
``j`` is all a resume needs. With equal counts the streams give exactly the samples of
synchronous data parallelism (Megatron's order; :func:`megatron_bitpipe.training.data.microbatches`).

**Counts planned before an iteration** (:func:`plan_counts`) come from every replica's
measured speed (micro-batches per second of compute, :class:`SpeedEstimate`), which every
rank knows alike because the speeds travel with the gradients' all-reduce — so all stages
of a pipeline replica, and all ranks of the job, compute the same counts without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .args import CountRule

__all__ = ["stream_samples", "plan_counts", "SpeedEstimate", "SPEED_SMOOTHING"]

#: weight of the newest measurement in the speeds' exponential moving average
SPEED_SMOOTHING = 0.5


def stream_samples(replica: int, position: int, data_parallel_size: int, micro_batch_size: int) -> List[int]:
    """Sample indices of replica ``replica``'s micro-batch at stream position ``position``."""
    first = (position * data_parallel_size + replica) * micro_batch_size
    return list(range(first, first + micro_batch_size))


@dataclass
class SpeedEstimate:
    """Per-replica speed in micro-batches per second, a moving average of the measurements.

    ``update(counts, seconds)`` takes one iteration's counts and compute seconds of every
    replica; ``speeds`` is None until the first measurement.
    """

    smoothing: float = SPEED_SMOOTHING
    speeds: Optional[List[float]] = None

    def update(self, counts: Sequence[float], seconds: Sequence[float]) -> None:
        measured = [c / max(s, 1e-9) for c, s in zip(counts, seconds)]
        if self.speeds is None:
            self.speeds = measured
        else:
            a = self.smoothing
            self.speeds = [a * m + (1 - a) * old for m, old in zip(measured, self.speeds)]

    def state_dict(self) -> dict:
        return {"speeds": self.speeds}

    def load_state_dict(self, state: dict) -> None:
        self.speeds = state["speeds"]


def _floor_allowed(allowed: List[int], value: float) -> int:
    """Largest allowed count <= ``value`` (the smallest allowed one if none)."""
    below = [n for n in allowed if n <= value + 1e-9]
    return below[-1] if below else allowed[0]


def plan_counts(
    trigger: str,
    rule: CountRule,
    speeds: Optional[Sequence[float]],
    *,
    initial: int,
    target: int,
    step_seconds: float,
    data_parallel_size: int,
    fixed: Optional[Sequence[int]] = None,
) -> List[int]:
    """Micro-batches of every replica for the next iteration, each allowed by ``rule``.

    * ``fixed``: the given counts;
    * no speeds measured yet: ``initial`` for every replica;
    * ``count``: ``target`` micro-batches shared in proportion to the speeds (largest
      remainders, in steps of ``rule.multiple``), each clamped to the rule;
    * ``time``: every replica runs what its speed does in ``T = max(step_seconds, the
      slowest replica's time for rule.lowest)``, rounded down to an allowed count — the
      iteration lasts until the slowest replica has done its fewest micro-batches (or
      ``step_seconds``), and the others fill that time.

    Deterministic: the same arguments give the same counts on every rank.
    """
    if trigger == "fixed":
        return list(fixed)
    if speeds is None:
        return [initial] * data_parallel_size
    allowed = rule.allowed()
    if trigger == "time":
        horizon = max(step_seconds, max(rule.lowest / s for s in speeds))
        return [_floor_allowed(allowed, s * horizon) for s in speeds]
    if trigger != "count":
        raise ValueError(f"unknown trigger {trigger!r}")
    total = sum(speeds)
    ideal = [target * s / total for s in speeds]
    counts = [_floor_allowed(allowed, x) for x in ideal]
    step = rule.multiple
    order = sorted(range(len(ideal)), key=lambda r: (-(ideal[r] - counts[r]), r))
    remaining = target - sum(counts)
    while remaining >= step:
        grown = False
        for r in order:
            if remaining < step:
                break
            if counts[r] + step <= rule.highest and counts[r] < math.ceil(ideal[r] - 1e-9):
                counts[r] += step
                remaining -= step
                grown = True
        if not grown:
            break
    return counts
