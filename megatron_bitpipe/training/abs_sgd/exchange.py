"""One iteration's gradient sums and statistics on their way through the all-reduce.

A :class:`GradientExchange` is launched right after an iteration's compute. Each chunk's
gradient buffer then holds ``G_c / d_c``: the sum ``G_c`` of the gradients of the
micro-batches that went through the chunk, divided by the divisor ``d_c`` the schedule
applied to each loss (the micro-batches it ran in one call, over all its pipelines; 1 when
a replica runs its micro-batches one call each). The exchange copies every DDP bucket, scales the
copy by ``d_c / M_ref`` (``M_ref`` = ``--global-batch-size / --micro-batch-size``) and
all-reduces it (sum) asynchronously over the chunk's grad-sync group (every replica of the
stage x data parallel), with megatron DDP's own coalesced collective. Once complete the
copy holds ``sum of G / M_ref`` over the job; :meth:`GradientExchange.write_gradients` puts
``sum of G / M`` into the buffers, ``M`` the micro-batches of the iteration over all
replicas (a multiplication by ``M_ref / M``, skipped when they are equal).

Synchronous data parallelism scales each bucket by ``1 / dp`` (megatron's ``1 / (replicas x
dp)`` times the replicas, whose gradients it sums: :mod:`megatron_bitpipe.execution.replicas`)
and all-reduces it with the same collective; with equal counts summing to ``M_ref``, ``d_c / M_ref`` is that
very number, so a zero-delay exchange reproduces it bit for bit.

The statistics (a float64 vector, summed over the job on the default group alongside) are
laid out by :class:`StatsLayout`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

__all__ = ["StatsLayout", "IterationStats", "GradientExchange", "bucket_groups"]


def bucket_groups(chunk) -> list:
    """The megatron DDP bucket groups of ``chunk`` (dense, then expert-parallel)."""
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


@dataclass(frozen=True)
class IterationStats:
    """What every replica did in one iteration (per-replica lists indexed by replica).

    ``counts`` in micro-batches; ``compute_seconds`` the time its ranks computed (mean over
    the replica's ranks); ``wait_seconds`` the time its ranks blocked on a gradient
    all-reduce (see :class:`~.step.AbsSgdStrategy`); ``loss_totals`` ``{name: (sum, count)}``
    over the iteration's micro-batches.
    """

    counts: List[int]
    compute_seconds: List[float]
    wait_seconds: List[float]
    loss_totals: Dict[str, tuple]

    @property
    def microbatches(self) -> int:
        return sum(self.counts)

    def losses(self) -> Dict[str, float]:
        return {name: s / max(c, 1.0) for name, (s, c) in self.loss_totals.items()}


@dataclass(frozen=True)
class StatsLayout:
    """Slots of the statistics vector: ``[counts | compute s | wait s]`` per replica, then
    ``(sum, count)`` per loss name. Every rank of replica ``r`` adds its values to slot
    ``r``; the sums are divided by the ranks per replica when read."""

    data_parallel_size: int
    ranks_per_replica: int
    loss_names: tuple

    def encode(self, replica: int, count: int, compute_s: float, wait_s: float, loss_totals: torch.Tensor) -> torch.Tensor:
        dp = self.data_parallel_size
        vector = torch.zeros(3 * dp + 2 * len(self.loss_names), dtype=torch.float64)
        vector[replica] = count
        vector[dp + replica] = compute_s
        vector[2 * dp + replica] = wait_s
        vector[3 * dp :] = loss_totals.reshape(-1).to(torch.float64)
        return vector

    def decode(self, vector: torch.Tensor) -> IterationStats:
        dp, per = self.data_parallel_size, self.ranks_per_replica
        values = vector.tolist()
        counts = [round(v / per) for v in values[:dp]]
        totals = values[3 * dp :]
        return IterationStats(
            counts=counts,
            compute_seconds=[v / per for v in values[dp : 2 * dp]],
            wait_seconds=[v / per for v in values[2 * dp : 3 * dp]],
            loss_totals={name: (totals[2 * i], totals[2 * i + 1]) for i, name in enumerate(self.loss_names)},
        )


class GradientExchange:
    """The all-reduce of one iteration's scaled gradient sums and statistics.

    Build with :meth:`launch` (collective: every rank, same order) or
    :meth:`from_state_dict` (a completed exchange from a checkpoint).
    """

    def __init__(self, pending: List[torch.Tensor], stats: torch.Tensor, works: list, iteration: int):
        self.pending = pending
        self.stats = stats
        self.works = works
        #: the iteration that computed these gradients
        self.iteration = iteration

    @classmethod
    def launch(cls, chunks: Sequence, groups, scales: Sequence[float], stats: torch.Tensor, iteration: int) -> "GradientExchange":
        """Copy, scale (``scales[c]`` for chunk ``c``) and all-reduce every chunk's buckets
        over its grad-sync group, and ``stats`` (on the collective's device) over the job;
        asynchronous."""
        pending, works = [], []
        for c, chunk in enumerate(chunks):
            group = groups.grad_sync_group(c)
            for bucket_group in bucket_groups(chunk):
                copies = []
                for bucket in bucket_group.buckets:
                    copy = bucket.grad_data.detach().clone()
                    if scales[c] != 1.0:
                        copy *= scales[c]
                    copies.append(copy)
                with _coalescing_manager(group, async_ops=True) as manager:
                    for copy in copies:
                        dist.all_reduce(copy, group=group, async_op=True)
                works += manager.works
                pending += copies
        works.append(dist.all_reduce(stats, async_op=True))
        return cls(pending, stats, works, iteration)

    def completed(self) -> bool:
        """Whether every all-reduce has completed (never blocks)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> float:
        """Block until complete; the seconds it blocked."""
        started = time.perf_counter()
        for work in self.works:
            work.wait()
        self.works = []
        if self.stats.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def write_gradients(self, chunks: Sequence, factor: float) -> None:
        """Put the reduced sums, times ``factor``, into the chunks' gradient buffers (waits first)."""
        self.wait()
        copies = iter(self.pending)
        for chunk in chunks:
            for bucket_group in bucket_groups(chunk):
                for bucket in bucket_group.buckets:
                    bucket.grad_data.copy_(next(copies))
                    if factor != 1.0:
                        bucket.grad_data *= factor

    def state_dict(self) -> dict:
        """The completed exchange (waits first): reduced sums and statistics, on the CPU."""
        self.wait()
        return {"pending": [t.cpu() for t in self.pending], "stats": self.stats.cpu(), "iteration": self.iteration}

    @classmethod
    def from_state_dict(cls, state: dict, chunks: Sequence) -> "GradientExchange":
        """A completed exchange from :meth:`state_dict`, its tensors on the buckets' devices
        (ValueError if they do not fit the chunks' buckets)."""
        buckets = [b for chunk in chunks for g in bucket_groups(chunk) for b in g.buckets]
        pending = state["pending"]
        shapes = [tuple(b.grad_data.shape) for b in buckets]
        if [tuple(t.shape) for t in pending] != shapes:
            raise ValueError(f"gradient buffers of shapes {[tuple(t.shape) for t in pending]} do not fit this model's {shapes}")
        moved = [t.to(device=b.grad_data.device, dtype=b.grad_data.dtype) for t, b in zip(pending, buckets)]
        device = buckets[0].grad_data.device if buckets else torch.device("cpu")
        return cls(moved, state["stats"].to(device), [], state["iteration"])
