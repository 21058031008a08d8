"""Synchronous data parallelism, megatron's: :class:`SyncStrategy`, the default mode.

One iteration: zero the gradient buffers, run the forward_backward function on this
data-parallel rank's micro-batches of the global batch (the chunks' DDP all-reduces the
gradients over the data-parallel group), step the optimizer (grad norm and clipping over each
logical parameter once) and, if the update happened, the learning-rate schedule by
``--global-batch-size`` samples. The logged losses are summed over the job, so every rank
holds the global batch's. No state of its own in the checkpoints.
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch

from ..data_parallel_modes import SYNC
from ..optimizers import lr_for_logging
from . import distributed
from .data import microbatches
from .logs import IterationRecord
from .mode import DataParallelStrategy, reduce_losses
from .report import job_peak_memory_mib, reset_peak_memory

__all__ = ["SyncStrategy"]


class SyncStrategy(DataParallelStrategy):
    """Megatron's synchronous iteration. Subclasses add to it through two hooks:
    :meth:`before_optimizer_step` and :meth:`iteration_fields`."""

    modes = (SYNC,)

    def before_optimizer_step(self, reports: List[Dict[str, torch.Tensor]]) -> None:
        """Called with this rank's loss reports of the iteration before the optimizer's step."""

    def iteration_fields(self, iteration: int) -> Dict[str, object]:
        """The record's fields of ``iteration`` after the step (added to the task's)."""
        return {}

    def train_step(self) -> IterationRecord:
        p = self.parts
        device, state, optimizer = p.env.device, p.state, p.optimizer
        global_batch_size = p.run.batches.global_batch_size
        p.synchronize()
        reset_peak_memory(device)
        start = time.perf_counter()
        for chunk in p.model.chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        lr = lr_for_logging(optimizer)
        batches = microbatches(p.train_data, state.consumed_train_samples, p.run, p.model.groups.dp_rank)
        reports = p.schedule.run(p.forward_step, batches, forward_only=False)
        self.before_optimizer_step(reports)
        success, grad_norm, _ = optimizer.step()
        if success:
            p.scheduler.step(increment=global_batch_size)
        losses, extra = p.kind.iteration_losses(p.run, reduce_losses(reports, p.loss_names, p.model.groups.tp_rank, device))
        p.synchronize()
        elapsed = time.perf_counter() - start
        state.iteration += 1
        state.consumed_train_samples += global_batch_size
        if state.iteration == p.run.optimizer.freeze_iteration:
            distributed.log(
                f"1-bit LAMB: variance frozen after iteration {state.iteration}; from now on momenta are averaged "
                "with 1-bit compression instead of all-reducing gradients (--clip-grad no longer applies)"
            )
        on_gpu = device.type == "cuda"
        return IterationRecord(
            iteration=state.iteration,
            consumed_samples=state.consumed_train_samples,
            elapsed_ms=1000.0 * elapsed,
            tokens_per_second=global_batch_size * p.run.batches.seq_length / elapsed,
            lr=float(lr),
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss_scale=float(optimizer.get_loss_scale()),
            skipped=not success,
            losses=losses,
            max_memory_mib=job_peak_memory_mib(device),
            tflops_per_device=p.flops_per_iteration / (elapsed * p.env.world_size * 1e12) if on_gpu else None,
            extra={**extra, **self.iteration_fields(state.iteration)},
        )
