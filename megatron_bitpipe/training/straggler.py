"""Per-rank step times and the straggler report of a multi-rank job.

A rank's step time here is the time of its own **forward steps** in the iteration (the task's
``forward_step`` of every micro-batch, on a GPU measured with CUDA events): unlike the
iteration's wall time, which every rank of a pipeline shares because each waits for the
others, it leaves out the waits for other ranks' tensors (received before a forward step
starts). With tensor parallelism the forward holds the TP group's collectives, so a TP group
is timed together.

:class:`ForwardTimer` times them; :meth:`ForwardTimer.gather` (collective over the job) gives
every rank's milliseconds of the iteration, logged as ``forward_ms_per_rank`` (``--log-json``)
and, after each progress line, as ``forward time per rank (ms, rank 0 first): a b ...`` (the
interval's mean).

:class:`StragglerDetector` keeps the last :data:`WINDOW` iterations and, as NVRx's
straggler detection does, scores each rank relative to the median rank: ``score = median /
rank's time`` (1 typical, below 1 slower). A rank whose score is below :data:`THRESHOLD` in every
iteration of the window is a straggler; rank 0 logs one line when the set of stragglers
changes. Pipeline stages of unequal work (the embedding's, the loss's) differ by design;
the uneven-layout flags balance them.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from typing import Callable, Deque, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["THRESHOLD", "WINDOW", "ForwardTimer", "StragglerDetector"]

#: iterations a straggler must be slower in, in a row
WINDOW = 5
#: relative score (median / rank's time) below which a rank is slower than the median rank
THRESHOLD = 0.7


class ForwardTimer:
    """This rank's seconds in forward steps since the last :meth:`gather`."""

    def __init__(self, device: torch.device):
        self.device = device
        self._seconds = 0.0
        self._events: List[tuple] = []

    def wrap(self, forward_step: Callable) -> Callable:
        """``forward_step``, timed."""
        cuda = self.device.type == "cuda"

        @functools.wraps(forward_step)
        def timed_forward_step(*args, **kwargs):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = forward_step(*args, **kwargs)
                end.record()
                self._events.append((start, end))
                return result
            started = time.perf_counter()
            result = forward_step(*args, **kwargs)
            self._seconds += time.perf_counter() - started
            return result

        return timed_forward_step

    def gather(self, world_size: int) -> List[float]:
        """Every rank's milliseconds in forward steps since the last call, by rank
        (collective over the default group); this rank's count starts again."""
        ms = 1000.0 * self._seconds
        if self._events:
            torch.cuda.synchronize()
            ms += sum(start.elapsed_time(end) for start, end in self._events)
        self._seconds, self._events = 0.0, []
        everyone = torch.zeros(world_size, dtype=torch.float64, device=self.device)
        everyone[dist.get_rank()] = ms
        dist.all_reduce(everyone)  # each rank fills its own slot
        return everyone.tolist()


class StragglerDetector:
    """Relative scores over the last :data:`WINDOW` iterations (see the module docstring)."""

    def __init__(self, window: int = WINDOW, threshold: float = THRESHOLD):
        self.window, self.threshold = window, threshold
        self._scores: Deque[List[float]] = deque(maxlen=window)
        self.stragglers: List[int] = []

    @staticmethod
    def scores(times_ms: Sequence[float]) -> List[float]:
        """``median / time`` of each rank (1.0 for a rank that took no time)."""
        median = statistics.median(times_ms)
        return [median / t if t > 0 else 1.0 for t in times_ms]

    def add(self, iteration: int, times_ms: Sequence[float]) -> Optional[str]:
        """Add an iteration's per-rank times; the line to log when the stragglers changed, else None."""
        self._scores.append(self.scores(times_ms))
        if len(self._scores) < self.window:
            return None
        slow = [r for r in range(len(times_ms)) if all(s[r] < self.threshold for s in self._scores)]
        if slow == self.stragglers:
            return None
        self.stragglers = slow
        first = iteration - self.window + 1
        if not slow:
            return f" straggler: none after iteration {iteration} (every rank within 1/{self.threshold:g} of the median rank's forward time)"
        parts = []
        for r in slow:
            mean = statistics.fmean(s[r] for s in self._scores)
            parts.append(f"rank {r} (relative score {mean:.2f}: {1 / mean:.1f}x the median rank's forward time)")
        return (
            f" straggler: {', '.join(parts)} in each of iterations {first}-{iteration}; scores below {self.threshold:g} "
            f"in {self.window} iterations in a row"
        )
