"""Progress output of the training loop: Megatron-style lines, JSON lines, TensorBoard.

Only rank 0 writes; every value it writes is already reduced over the job (losses are
gathered from the loss ranks by the loop, memory is the busiest rank's). Three kinds of
output:

* **start-up** (:meth:`TrainingLogger.startup`): the schedule, the layout, Megatron-LM's
  parameter count per model-parallel rank, the memory after the model and optimizer are
  built (see :mod:`.report` for what memory means on a GPU and on the CPU) and the model
  FLOPs of one iteration;
* **one :class:`IterationRecord` per iteration** (:meth:`TrainingLogger.record`); every
  ``--log-interval`` iterations, and after the first iteration of a run (start or resume),
  Megatron-LM's line (timestamp, throughput, losses averaged over the interval, loss scale
  with ``--fp16``, grad norm, skipped and NaN iterations; as in Megatron-LM the line after the
  first iteration does not end the interval: the next line averages from that iteration) with
  the busiest rank's memory and, with a GPU, TFLOP/s per device; Megatron-LM's validation
  block after an evaluation; a data-parallel mode's own fields (:attr:`IterationRecord.extra`,
  ABS-SGD's ``abs_*``) on the line and in the JSON;
* **the end** (:meth:`TrainingLogger.summary`): the test-set evaluation where there is one,
  and a summary (iterations, total and training time, final validation and test losses,
  peak memory).

``--log-json PATH`` writes one JSON object per line, each with ``event``: ``"startup"``
(``schedule``, ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``data_parallel_size``, ``num_microbatches``, ``padded_vocab_size``, ``memory``,
``model_flops_per_iteration``, ``stage_layers``: the transformer layers of each pipeline stage
in pipeline order, ``ranks``: a list of ``rank``, ``tp_rank``, ``pp_rank``,
``dp_rank``, ``parameters``, ``memory_mib``, ``layers``), ``"iteration"`` (:meth:`IterationRecord.to_json`; ``forward_ms_per_rank`` in a multi-rank job)
or ``"summary"`` (``iterations``, ``iterations_this_run``, ``total_time_s``,
``train_time_s``, ``max_memory_mib`` and ``validation_<loss>`` / ``test_<loss>`` where
evaluated). A resumed run appends.

``--tensorboard-dir``: the iteration scalars, when TensorBoard is installed (a warning otherwise).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Dict, List, Optional, Sequence

from ..run_config import RunConfig
from .distributed import log
from .report import RankReport

__all__ = ["IterationRecord", "TrainingLogger", "json_key", "timestamp"]


def json_key(loss_name: str) -> str:
    """``"lm loss"`` -> ``"lm_loss"``."""
    return loss_name.replace(" ", "_")


def timestamp(seconds: float) -> str:
    """Megatron-LM's timestamp of a time (``time.time()``): local ``YYYY-MM-DD HH:MM:SS.ffffff``."""
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S.%f")


def _perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))


@dataclass
class IterationRecord:
    """What one training iteration produced (values reduced over the job).

    Units: ``elapsed_ms`` wall-clock milliseconds of the iteration on rank 0; ``lr`` the
    learning rate of this iteration's update; ``grad_norm`` the global L2 norm before clipping
    (None when megatron did not compute it); ``max_memory_mib`` the busiest rank's memory
    (:mod:`.report`); ``tflops_per_device`` model TFLOP/s per device (None without a GPU);
    ``time`` when the iteration ended (``time.time()``); ``validation`` the losses of an
    evaluation run right after this iteration, if any; ``extra`` further JSON fields of a data-parallel
    mode, also shown on the progress line (lists as ``a/b/c``); ``forward_ms_per_rank`` every
    rank's milliseconds in its forward steps (multi-rank jobs, :mod:`.straggler`), in the JSON
    and on a compact line of its own after the progress line (the interval's mean per rank).
    """

    iteration: int
    consumed_samples: int
    elapsed_ms: float
    tokens_per_second: float
    lr: float
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool
    losses: Dict[str, float]
    max_memory_mib: Optional[float] = None
    tflops_per_device: Optional[float] = None
    time: float = field(default_factory=time.time)
    validation: Dict[str, float] = field(default_factory=dict)
    extra: Dict[str, object] = field(default_factory=dict)
    forward_ms_per_rank: Optional[List[float]] = None

    @property
    def nan(self) -> bool:
        """Whether a loss of the iteration is NaN or infinite."""
        return not all(math.isfinite(value) for value in self.losses.values())

    def to_json(self) -> dict:
        out = {
            "event": "iteration",
            "timestamp": datetime.fromtimestamp(self.time).isoformat(),
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "elapsed_ms": self.elapsed_ms,
            "tokens_per_second": self.tokens_per_second,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "loss_scale": self.loss_scale,
            "skipped": self.skipped,
            "nan": self.nan,
            "max_memory_mib": self.max_memory_mib,
            "tflops_per_device": self.tflops_per_device,
        }
        out.update({json_key(name): value for name, value in self.losses.items()})
        out.update({f"validation_{json_key(name)}": value for name, value in self.validation.items()})
        out.update(self.extra)
        if self.forward_ms_per_rank is not None:
            out["forward_ms_per_rank"] = self.forward_ms_per_rank
        return out


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(_shown(v) for v in value)
    if not isinstance(value, float):
        return str(value)
    return f"{value:.1f}" if value == 0 or abs(value) >= 0.05 else f"{value:.3e}"  # small values keep their digits


class TrainingLogger:
    """Writes the start-up report, :class:`IterationRecord` s and the summary of ``run``, which
    trains to iteration ``train_iters``, on rank 0 (a no-op elsewhere)."""

    def __init__(self, run: RunConfig, train_iters: int, rank: int, resumed: bool):
        self.run, self.train_iters = run, train_iters
        self.active = rank == 0
        self.interval: List[IterationRecord] = []
        self.first = True  # no iteration of this run recorded yet
        self.shown: Optional[IterationRecord] = None  # the record of the last line printed
        self.max_memory_mib: Optional[float] = None  # over the iterations of this run
        self.json = None
        self.tensorboard = None
        if not self.active:
            return
        logging = run.logging
        if logging.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(logging.json_path)), exist_ok=True)
            self.json = open(logging.json_path, "a" if resumed else "w", encoding="utf-8")
        if logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log("WARNING: --tensorboard-dir given but TensorBoard is not installed (pip install tensorboard); not writing it")
            else:
                self.tensorboard = SummaryWriter(log_dir=logging.tensorboard_dir, max_queue=1000)

    def record(self, record: IterationRecord) -> None:
        if not self.active:
            return
        self._json(record.to_json())
        if record.max_memory_mib is not None:
            self.max_memory_mib = max(record.max_memory_mib, self.max_memory_mib or 0.0)
        if self.tensorboard is not None:
            self._tensorboard(record)
        self.interval.append(record)
        if record.iteration % self.run.logging.interval == 0 or record.iteration == self.train_iters:
            self._line()
        elif self.first:  # Megatron-LM's line after a run's first iteration; the interval goes on
            self._line(keep_interval=True)
        self.first = False
        if record.validation:
            self._validation(record)

    def startup(
        self,
        ranks: Sequence[RankReport],
        memory: str,
        flops_per_iteration: float,
        schedule: str,
        models: int = 1,
        stage_layers: Optional[Sequence[int]] = None,
    ) -> None:
        """The start-up report: parameters per model-parallel rank (data-parallel rank 0, as
        Megatron-LM prints them), memory after setup (``memory`` says what it measures),
        the model FLOPs of one iteration (of all ``models`` models of an HFTA array) and the
        schedule (its :attr:`~megatron_bitpipe.run_config.RunConfig.label`, in the JSON event) with
        the layers of each pipeline stage (``stage_layers``, pipeline order; in the JSON event and,
        when the stages are uneven, on a line)."""
        if not self.active:
            return
        layout = self.run.layout
        # one line per (tensor, pipeline) rank: data- and context-parallel ranks hold the same weights
        first = {(r.pp_rank, r.tp_rank): r for r in reversed(ranks) if r.dp_rank == 0}
        for r in (first[key] for key in sorted(first)):
            log(f" > number of parameters on (tensor, pipeline) model parallel rank ({r.tp_rank}, {r.pp_rank}): {r.parameters}")
        most, least = max(ranks, key=lambda r: r.memory_mib), min(ranks, key=lambda r: r.memory_mib)
        if len(ranks) == 1:
            log(f" > memory after setup (MiB, {memory}): {most.memory_mib:.1f}")
        else:
            log(
                f" > memory after setup (MiB, {memory}): max {most.memory_mib:.1f} (rank {most.rank}), "
                f"min {least.memory_mib:.1f} (rank {least.rank})"
            )
        if stage_layers is not None and len(set(stage_layers)) > 1:
            log(f" > transformer layers per pipeline stage (pipeline order): {', '.join(map(str, stage_layers))}")
        array = f", the {models} models of the array" if models > 1 else ""
        log(f" > model FLOPs per iteration: {flops_per_iteration:.3E} (matrix products, forward and backward{array})")
        self._json(
            {
                "event": "startup",
                "timestamp": datetime.now().isoformat(),
                "schedule": schedule,
                "tensor_model_parallel_size": layout.tensor,
                "tensor_parallel_mode": layout.tensor_parallel_mode,
                "pipeline_model_parallel_size": layout.pipeline,
                "data_parallel_size": layout.data,
                "num_microbatches": self.run.batches.num_microbatches,
                "padded_vocab_size": self.run.padded_vocab_size,
                "memory": memory,
                "model_flops_per_iteration": flops_per_iteration,
                "stage_layers": None if stage_layers is None else list(stage_layers),
                "ranks": [vars(r) for r in ranks],
            }
        )

    def _line(self, keep_interval: bool = False) -> None:
        """The iteration line of the records since the last one (kept for the next one with
        ``keep_interval``)."""
        records = self.interval
        if not keep_interval:
            self.interval = []
        last = self.shown = records[-1]
        done = [r for r in records if not r.skipped]
        fields = [
            f"[{timestamp(last.time)}] iteration {last.iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {last.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {sum(r.elapsed_ms for r in records) / len(records):.1f}",
        ]
        if last.tflops_per_device is not None:  # the rate of the mean time: a harmonic mean
            fields.append(f"throughput per GPU (TFLOP/s/GPU): {len(records) / sum(1 / r.tflops_per_device for r in records):.1f}")
        fields += [
            f"tokens per second: {sum(r.tokens_per_second for r in records) / len(records):.1f}",
            f"learning rate: {last.lr:.6E}",
            f"global batch size: {self.run.batches.global_batch_size:5d}",
        ]
        for name in last.losses:
            if done:
                fields.append(f"{name}: {sum(r.losses[name] for r in done) / len(done):.6E}")
        if self.run.precision.fp16:
            fields.append(f"loss scale: {last.loss_scale:.1f}")
        if last.grad_norm is not None:
            fields.append(f"grad norm: {last.grad_norm:.3f}")
        fields.append(f"number of skipped iterations: {len(records) - len(done):3d}")
        fields.append(f"number of nan iterations: {sum(r.nan for r in records):3d}")
        if last.max_memory_mib is not None:
            fields.append(f"max memory (MiB): {max(r.max_memory_mib for r in records):.1f}")
        fields += [f"{key.replace('_', ' ')}: {_shown(value)}" for key, value in last.extra.items() if value is not None]
        log(" " + " | ".join(fields) + " |")
        timed = [r.forward_ms_per_rank for r in records if r.forward_ms_per_rank is not None]
        if timed:
            means = [sum(ms) / len(timed) for ms in zip(*timed)]
            log(f" forward time per rank (ms, rank 0 first): {' '.join(f'{ms:.1f}' for ms in means)}")

    def evaluation(self, label: str, losses: Dict[str, float]) -> None:
        """Megatron-LM's block of an evaluation, e.g. ``label`` ``iteration 20 on test set``."""
        if not self.active:
            return
        parts = [f"validation loss at {label}"]
        for name, value in losses.items():
            parts.append(f"{name} value: {value:.6E} | {name} PPL: {_perplexity(value):.6E}")
        line = " " + " | ".join(parts) + " |"
        log("-" * len(line) + "\n" + line + "\n" + "-" * len(line))

    def final_evaluation(self, label: str, iterations: int, seconds: float) -> None:
        """What the evaluation after the last iteration cost, e.g. ``final evaluation on the
        validation set: 100 iterations (--eval-iters), 12.3 s``."""
        if not self.active:
            return
        log(f" final evaluation on the {label}: {iterations} iterations (--eval-iters), {seconds:.1f} s")

    def _validation(self, record: IterationRecord) -> None:
        self.evaluation(f"iteration {record.iteration}", record.validation)

    def summary(
        self,
        iteration: int,
        iterations_this_run: int,
        total_time_s: float,
        train_time_s: float,
        validation: Dict[str, float],
        test: Dict[str, float],
    ) -> None:
        """The end-of-training summary: iterations, total time (set-up included) and training
        time in seconds, the final validation and test losses (where evaluated), the busiest
        rank's memory over this run's iterations."""
        if not self.active:
            return
        log(f"[after training is done] datetime: {timestamp(time.time())}")
        fields = [
            f"training summary | iterations: {iteration} ({iterations_this_run} in this run)",
            f"total time (s): {total_time_s:.1f}",
            f"training time (s): {train_time_s:.1f}",
        ]
        fields += [f"validation {name}: {value:.6E}" for name, value in validation.items()]
        fields += [f"test {name}: {value:.6E}" for name, value in test.items()]
        if self.max_memory_mib is not None:
            fields.append(f"max memory (MiB): {self.max_memory_mib:.1f}")
        log(" " + " | ".join(fields) + " |")
        out = {
            "event": "summary",
            "timestamp": datetime.now().isoformat(),
            "iterations": iteration,
            "iterations_this_run": iterations_this_run,
            "total_time_s": total_time_s,
            "train_time_s": train_time_s,
            "max_memory_mib": self.max_memory_mib,
        }
        out.update({f"validation_{json_key(name)}": value for name, value in validation.items()})
        out.update({f"test_{json_key(name)}": value for name, value in test.items()})
        self._json(out)

    def _json(self, out: dict) -> None:
        if self.json is not None:
            self.json.write(json.dumps(out) + "\n")
            self.json.flush()

    def _tensorboard(self, record: IterationRecord) -> None:
        step, writer = record.iteration, self.tensorboard
        for name, value in record.losses.items():
            writer.add_scalar(name, value, step)
        for name, value in record.validation.items():
            writer.add_scalar(f"{name} validation", value, step)
        writer.add_scalar("learning-rate", record.lr, step)
        writer.add_scalar("tokens-per-second", record.tokens_per_second, step)
        writer.add_scalar("iteration-time-ms", record.elapsed_ms, step)
        if record.grad_norm is not None:
            writer.add_scalar("grad-norm", record.grad_norm, step)
        if record.max_memory_mib is not None:
            writer.add_scalar("max-memory-mib", record.max_memory_mib, step)
        if record.tflops_per_device is not None:
            writer.add_scalar("throughput-tflops-per-device", record.tflops_per_device, step)

    def finish_interval(self) -> None:
        """Print the line of the iterations logged since the last one (a run that stops early)."""
        if self.active and self.interval and self.interval[-1] is not self.shown:
            self._line()

    def close(self) -> None:
        self.finish_interval()
        if self.json is not None:
            self.json.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
