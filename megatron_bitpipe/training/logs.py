"""Progress output of the training loop: Megatron-style lines, JSON lines, TensorBoard.

Only rank 0 writes; every value it writes is already reduced over the job (losses are
gathered from the loss ranks by the loop). One :class:`IterationRecord` per iteration:

* stdout, every ``--log-interval`` iterations and after the last one: Megatron-LM's line
  (time, throughput and losses averaged over the interval), and Megatron-LM's validation block after an evaluation;
* ``--log-json PATH``: one JSON object per iteration with ``iteration``,
  ``consumed_samples``, ``elapsed_ms``, ``tokens_per_second``, ``lr``, ``grad_norm``,
  ``loss_scale``, ``skipped``, one key per loss (``"lm loss"`` -> ``lm_loss``) and, after an
  evaluation, ``validation_<loss>`` (e.g. ``validation_lm_loss``), and the mode's own
  fields (:attr:`IterationRecord.extra`; ABS-SGD's ``abs_*``). A resumed run appends;
* ``--tensorboard-dir``: the same scalars, when TensorBoard is installed (a warning otherwise).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .distributed import log

__all__ = ["IterationRecord", "TrainingLogger", "json_key"]


def json_key(loss_name: str) -> str:
    """``"lm loss"`` -> ``"lm_loss"``."""
    return loss_name.replace(" ", "_")


@dataclass
class IterationRecord:
    """What one training iteration produced (values reduced over the job).

    Units: ``elapsed_ms`` wall-clock milliseconds of the iteration on rank 0; ``lr`` the
    learning rate of this iteration's update; ``grad_norm`` the global L2 norm before clipping
    (None when megatron did not compute it); ``validation`` the losses of an evaluation run
    right after this iteration, if any; ``extra`` further JSON fields of a data-parallel
    mode, also shown on the progress line (lists as ``a/b/c``).
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
    validation: Dict[str, float] = field(default_factory=dict)
    extra: Dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "elapsed_ms": self.elapsed_ms,
            "tokens_per_second": self.tokens_per_second,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "loss_scale": self.loss_scale,
            "skipped": self.skipped,
        }
        out.update({json_key(name): value for name, value in self.losses.items()})
        out.update({f"validation_{json_key(name)}": value for name, value in self.validation.items()})
        out.update(self.extra)
        return out


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(_shown(v) for v in value)
    return f"{value:.1f}" if isinstance(value, float) else str(value)


class TrainingLogger:
    """Writes :class:`IterationRecord` s on rank 0 (a no-op elsewhere)."""

    def __init__(self, args, rank: int, resumed: bool):
        self.args = args
        self.active = rank == 0
        self.interval: List[IterationRecord] = []
        self.json = None
        self.tensorboard = None
        if not self.active:
            return
        if args.log_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
            self.json = open(args.log_json, "a" if resumed else "w", encoding="utf-8")
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log("WARNING: --tensorboard-dir given but TensorBoard is not installed (pip install tensorboard); not writing it")
            else:
                self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)

    def record(self, record: IterationRecord) -> None:
        if not self.active:
            return
        if self.json is not None:
            self.json.write(json.dumps(record.to_json()) + "\n")
            self.json.flush()
        if self.tensorboard is not None:
            self._tensorboard(record)
        self.interval.append(record)
        if record.iteration % self.args.log_interval == 0 or record.iteration == self.args.train_iters:
            self._line()
        if record.validation:
            self._validation(record)

    def _line(self) -> None:
        records, self.interval = self.interval, []
        last = records[-1]
        done = [r for r in records if not r.skipped]
        fields = [
            f"iteration {last.iteration:8d}/{self.args.train_iters:8d}",
            f"consumed samples: {last.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {sum(r.elapsed_ms for r in records) / len(records):.1f}",
            f"tokens per second: {sum(r.tokens_per_second for r in records) / len(records):.1f}",
            f"learning rate: {last.lr:.6E}",
            f"global batch size: {self.args.global_batch_size:5d}",
        ]
        for name in last.losses:
            if done:
                fields.append(f"{name}: {sum(r.losses[name] for r in done) / len(done):.6E}")
        if self.args.fp16:
            fields.append(f"loss scale: {last.loss_scale:.1f}")
        if last.grad_norm is not None:
            fields.append(f"grad norm: {last.grad_norm:.3f}")
        fields.append(f"number of skipped iterations: {len(records) - len(done):3d}")
        fields += [f"{key.replace('_', ' ')}: {_shown(value)}" for key, value in last.extra.items() if value is not None]
        log(" " + " | ".join(fields) + " |")

    def _validation(self, record: IterationRecord) -> None:
        parts = [f"validation loss at iteration {record.iteration}"]
        for name, value in record.validation.items():
            parts.append(f"{name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.6E}")
        line = " " + " | ".join(parts) + " |"
        log("-" * len(line) + "\n" + line + "\n" + "-" * len(line))

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

    def finish_interval(self) -> None:
        """Print the line of the iterations logged since the last one (a run that stops early)."""
        if self.active and self.interval:
            self._line()

    def close(self) -> None:
        self.finish_interval()
        if self.json is not None:
            self.json.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
