"""ABS-SGD inside the pretraining loop: :class:`AbsSgdStrategy`.

Iteration ``k`` on every rank:

1. zero the gradient buffers and compute this replica's micro-batches at the weights
   ``w_k`` — a count planned before the iteration (:func:`~.counts.plan_counts`), or, for a
   replica of one rank with ``--abs-trigger time``, one micro-batch per call until the
   trigger fires: at least ``--abs-min-microbatches``, at most ``--abs-max-microbatches``,
   otherwise until the previous iteration's all-reduce has completed and
   ``--abs-step-seconds`` have passed;
2. wait for the previous iteration's exchange (delay 1), then launch this iteration's
   (:class:`~.exchange.GradientExchange`: scaled gradient sums plus statistics, asynchronous);
3. apply the previous iteration's gradient — ``sum of G / sum of n`` over all replicas,
   computed at ``w_{k-1}`` — with the optimizer (clipping included) and advance the
   learning-rate schedule by its samples; iteration 1 has nothing to apply yet.

With ``--abs-gradient-delay 0`` step 2 waits for this iteration's own exchange and step 3
applies it: synchronous data parallelism with per-replica counts (with equal counts summing
to ``--global-batch-size`` it is Megatron's synchronous step, bit for bit).

**Progress counters.** ``consumed_train_samples`` counts the samples whose gradients have
been applied (what the learning-rate schedule counts); each replica's stream position
counts the micro-batches it has computed, the ones in flight included.

**Logs** (``IterationRecord.extra``; ``None`` before the first update), for the batch the
iteration applied: ``abs_applied_iteration`` (the iteration that computed it),
``abs_staleness`` (iterations between computing and applying: the delay),
``abs_samples_per_replica``, ``abs_compute_ms_per_replica`` (its ranks' compute time) and
``abs_sync_wait_ms_per_replica`` (time its ranks blocked on a gradient all-reduce before
launching that batch's: with delay 1 the wait for the batch before it; with delay 0 the wait
for the previous iteration's own exchange). The losses are the applied batch's.

**Checkpoints** carry the exchange in flight: a save waits for it to complete (which does
not change the math) and stores the reduced sums and statistics per rank
(``abs_sgd_rank<r>.pt``) with the stream positions and speeds (``abs_sgd.json``), so a resume
in the same layout continues the exact trajectory. See ``docs/heterogeneous.md``.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from ...data_parallel_modes import ABS_SGD, DataParallelMode
from ...optimizers import lr_for_logging
from ...checkpoint_rules import CheckpointError
from ..checkpoint import rank_layout
from ..data import collate
from ..distributed import log
from ..logs import IterationRecord
from ..mode import DataParallelStrategy, TrainingParts
from ..rank_state import RankStateFiles
from .args import AbsSgdSettings
from .counts import SpeedEstimate, plan_counts, stream_samples
from .exchange import GradientExchange, StatsLayout

__all__ = ["AbsSgdStrategy", "COMMON_FILE"]

#: ABS-SGD's state next to a checkpoint: the streams' positions and speeds, the gradients in flight
STATE_FILES = RankStateFiles("abs_sgd", version=1)
COMMON_FILE = STATE_FILES.common_file


class AbsSgdStrategy(DataParallelStrategy):
    """ABS-SGD's iteration, state and checkpoints (see the module docstring)."""

    modes = (ABS_SGD,)
    state_files = STATE_FILES

    def __init__(self, mode: DataParallelMode, parts: TrainingParts):
        super().__init__(mode, parts)
        self.settings = AbsSgdSettings.from_args(parts.args)
        groups = parts.model.groups
        grid = groups.grid
        self.dp, self.replica = grid.dp, groups.dp_rank
        self.layout = StatsLayout(grid.dp, grid.tp * grid.pp, tuple(parts.loss_names))
        self.adaptive = self.settings.trigger == "time" and grid.tp * grid.pp == 1
        self.micro_batch_size = parts.run.batches.micro_batch_size
        self.speeds = SpeedEstimate()
        start = parts.state.consumed_train_samples // (self.micro_batch_size * grid.dp)
        #: every replica's stream position after the last applied batch
        self.positions: List[int] = [start] * grid.dp
        #: this replica's next stream position (the batch in flight included)
        self.next_position = start
        self.in_flight: Optional[GradientExchange] = None
        self.last_wait_s = 0.0

    # -- one iteration ----------------------------------------------------------------------

    def _microbatch(self, position: int) -> dict:
        samples = stream_samples(self.replica, position, self.dp, self.micro_batch_size)
        return collate([self.parts.train_data[i] for i in samples])

    def _run(self, positions: range) -> list:
        p = self.parts
        return p.schedule.run(p.forward_step, [self._microbatch(i) for i in positions], forward_only=False)

    def _compute(self, started: float):
        """Run this replica's micro-batches; ``(count, loss divisor, loss reports)``."""
        s = self.settings
        if self.adaptive:
            reports, count = [], 0
            while True:
                reports += self._run(range(self.next_position, self.next_position + 1))
                self.next_position += 1
                count += 1
                if count >= s.rule.highest:
                    break
                if count < s.rule.lowest or (self.in_flight is not None and not self.in_flight.completed()):
                    continue
                if time.perf_counter() - started >= s.step_seconds:
                    break
            return count, 1, reports
        counts = plan_counts(
            s.trigger,
            s.rule,
            self.speeds.speeds,
            initial=s.initial_microbatches,
            target=s.reference_microbatches,
            step_seconds=s.step_seconds,
            data_parallel_size=self.dp,
            fixed=s.replica_microbatches,
        )
        count = counts[self.replica]
        reports = self._run(range(self.next_position, self.next_position + count))
        self.next_position += count
        return count, count, reports

    def _loss_totals(self, reports) -> torch.Tensor:
        """``[sum, count]`` per loss name of this rank's reports (TP rank 0 only: every TP
        rank of a loss stage holds the same reports)."""
        names = self.layout.loss_names
        totals = torch.zeros(len(names), 2, dtype=torch.float64)
        if self.parts.model.groups.tp_rank == 0:
            for report in reports:
                for i, name in enumerate(names):
                    totals[i] += report[name].detach().to(totals)
        return totals

    def train_step(self) -> IterationRecord:
        p, s = self.parts, self.settings
        chunks = p.model.chunks
        iteration = p.state.iteration + 1
        p.synchronize()
        started = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        p.optimizer.zero_grad()
        lr = lr_for_logging(p.optimizer)
        count, divisor, reports = self._compute(started)
        p.synchronize()
        compute_s = time.perf_counter() - started
        if self.in_flight is not None:
            self.last_wait_s = self.in_flight.wait()
        stats = self.layout.encode(self.replica, count, compute_s, self.last_wait_s, self._loss_totals(reports))
        scale = divisor / s.reference_microbatches
        exchange = GradientExchange.launch(chunks, p.model.groups, [scale] * len(chunks), stats.to(p.env.device), iteration)
        if s.delay == 0:
            self.last_wait_s = exchange.wait()
            applying = exchange
        else:
            applying, self.in_flight = self.in_flight, exchange
        return self._apply(applying, iteration, lr, started)

    def _apply(self, applying: Optional[GradientExchange], iteration: int, lr: float, started: float) -> IterationRecord:
        """Apply ``applying``'s gradient (None: nothing yet) and describe the iteration."""
        p = self.parts
        mbs = self.micro_batch_size
        grad_norm, skipped, losses, samples = None, True, {}, 0
        extra = dict.fromkeys(
            ("abs_applied_iteration", "abs_staleness", "abs_samples_per_replica", "abs_compute_ms_per_replica", "abs_sync_wait_ms_per_replica")
        )
        if applying is not None:
            stats = self.layout.decode(applying.stats)
            total = stats.microbatches
            applying.write_gradients(p.model.chunks, self.settings.reference_microbatches / total)
            success, norm, _ = p.optimizer.step()
            samples = total * mbs
            if success:
                p.scheduler.step(increment=samples)
            grad_norm, skipped, losses = (None if norm is None else float(norm)), not success, stats.losses()
            self.speeds.update(stats.counts, stats.compute_seconds)
            self.positions = [p + c for p, c in zip(self.positions, stats.counts)]
            p.state.consumed_train_samples += samples
            extra.update(
                abs_applied_iteration=applying.iteration,
                abs_staleness=iteration - applying.iteration,
                abs_samples_per_replica=[c * mbs for c in stats.counts],
                abs_compute_ms_per_replica=[1000.0 * x for x in stats.compute_seconds],
                abs_sync_wait_ms_per_replica=[1000.0 * x for x in stats.wait_seconds],
            )
        p.synchronize()
        elapsed = time.perf_counter() - started
        p.state.iteration = iteration
        return IterationRecord(
            iteration=iteration,
            consumed_samples=p.state.consumed_train_samples,
            elapsed_ms=1000.0 * elapsed,
            tokens_per_second=samples * p.run.batches.seq_length / elapsed,
            lr=float(lr),
            grad_norm=grad_norm,
            loss_scale=float(p.optimizer.get_loss_scale()),
            skipped=skipped,
            losses=losses,
            extra=extra,
        )

    def finish(self) -> None:
        """Say what is still in flight at the end of training (rank 0)."""
        if self.in_flight is None:
            return
        stats = self.layout.decode(self.in_flight.state_dict()["stats"])
        where = "it is in the checkpoint; a resume applies it" if self.parts.run.checkpointing.save else "without --save it is not applied"
        log(
            f"abs-sgd: the gradients of iteration {self.in_flight.iteration} "
            f"({stats.microbatches * self.micro_batch_size} samples) were computed and not yet applied; {where}"
        )

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """Write this rank's ABS-SGD state into checkpoint ``directory`` (before the
        checkpoint itself, which makes it the latest). Waits for the exchange in flight
        (``abs_sgd.json``: the streams' positions and speeds; each rank's file: the reduced
        gradient sums and statistics in flight)."""
        in_flight = self.in_flight.state_dict() if self.in_flight is not None else None
        common = {
            "positions": self.positions,
            "speeds": self.speeds.state_dict(),
            "last_wait_s": self.last_wait_s,
            "in_flight_iteration": None if in_flight is None else in_flight["iteration"],
        }
        STATE_FILES.save(directory, self.parts.env.rank, rank_layout(self.parts.run), common, in_flight)

    def resume(self, directory: str, common: Optional[dict]) -> None:
        """Restore the state :meth:`save` wrote (``common``: its ``abs_sgd.json``); from a
        checkpoint without it (a synchronous one) every stream starts where that run stopped.
        CheckpointError naming the flags when this run cannot continue it."""
        if common is None:
            log(f"abs-sgd: {directory} is a synchronous checkpoint; every replica's stream starts at micro-batch {self.positions[0]}")
            return
        pending = common["in_flight_iteration"]
        if pending is not None:
            if common["layout"] != rank_layout(self.parts.run):
                raise CheckpointError(
                    f"{directory} holds abs-sgd gradients in flight for another layout ({common['layout']}); resume it with "
                    "the same world size, --tensor-model-parallel-size, --pipeline-model-parallel-size, schedule and "
                    "--tensor-parallel-mode"
                )
            if self.settings.delay == 0:
                raise CheckpointError(
                    f"{directory} holds the gradients of iteration {pending} still to be applied: resume it with "
                    "--abs-gradient-delay 1"
                )
        if len(common["positions"]) != self.dp:
            raise CheckpointError(f"{directory}: abs-sgd streams of {len(common['positions'])} replicas, this run has {self.dp}")
        self.positions = list(common["positions"])
        self.speeds.load_state_dict(common["speeds"])
        self.last_wait_s = common["last_wait_s"]
        self.next_position = self.positions[self.replica]
        if pending is not None:
            state = STATE_FILES.load_rank(directory, self.parts.env.rank)
            try:
                self.in_flight = GradientExchange.from_state_dict(state, self.parts.model.chunks)
            except ValueError as error:
                raise CheckpointError(f"{directory}: {error}") from None
            self.next_position += self.layout.decode(self.in_flight.stats.cpu()).counts[self.replica]
        log(f"abs-sgd: resumed the replicas' streams at micro-batches {self.positions}" + ("" if pending is None else f", gradients of iteration {pending} in flight"))


    @classmethod
    def refusal(cls, directory: str, common: dict) -> str:
        """Another mode cannot load an ABS-SGD checkpoint: its replicas read their own streams,
        and gradients may be in flight."""
        pending = common.get("in_flight_iteration")
        return (
            f"{directory} was saved with --data-parallel-mode {ABS_SGD.name} (each replica reads its own sample stream"
            + ("" if pending is None else f"; the gradients of iteration {pending} are in flight")
            + f"): resume it with --data-parallel-mode {ABS_SGD.name}"
        )
