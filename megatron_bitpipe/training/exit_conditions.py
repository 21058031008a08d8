"""Megatron-LM's early exits of a training run: a signal, a time budget, an iteration interval.

* ``--exit-signal-handler``: the ``--exit-signal`` (default SIGTERM; the SLURM templates use
  SIGUSR1, sent before the time limit) only sets a flag; the loop finishes the current
  iteration (and its due evaluation), saves a checkpoint and exits with status 0. A signal
  received by any rank stops every rank after the same iteration.
* ``--exit-duration-in-mins M``: after the first iteration that ends more than ``M`` minutes
  after the script started (on any rank), save and exit 0.
* ``--exit-interval N``: after every iteration divisible by ``N``, save and exit 0.

The handler is installed for the lifetime of :class:`ExitConditions` (a context manager) and
the previous one restored after. :meth:`ExitConditions.reason` is collective over the default
process group (one small all-reduce per iteration) when the signal handler or the time budget
is on, and needs no communication otherwise.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..run_config import Exits

__all__ = ["ExitConditions"]


class ExitConditions:
    """The early exits of a run (:attr:`~megatron_bitpipe.run_config.RunConfig.exits`) that
    started at ``start_time`` (``time.time()`` seconds)."""

    def __init__(self, exits: Exits, start_time: float):
        self.interval: Optional[int] = exits.interval
        self.duration_minutes: Optional[float] = exits.duration_minutes
        self.signal = None if exits.signal is None else signal.Signals[exits.signal]
        self.start_time = start_time
        self._received = False
        self._previous_handler = None

    def __enter__(self) -> "ExitConditions":
        if self.signal is not None:
            self._previous_handler = signal.signal(self.signal, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.signal is not None:
            signal.signal(self.signal, self._previous_handler)

    def _on_signal(self, signum, frame) -> None:
        self._received = True

    def reason(self, iteration: int, device: torch.device) -> Optional[str]:
        """Why the run should stop after ``iteration`` (None: go on); the same on every rank.

        Collective over the default group when the signal handler or the time budget is on.
        """
        if self.signal is not None or self.duration_minutes is not None:
            minutes = (time.time() - self.start_time) / 60.0
            over_time = self.duration_minutes is not None and minutes > self.duration_minutes
            flags = torch.tensor([int(self._received), int(over_time)], dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            received, over_time = (bool(v) for v in flags.tolist())
            if received:
                return f"received {self.signal.name} (--exit-signal-handler)"
            if over_time:
                return f"ran more than --exit-duration-in-mins {self.duration_minutes:g} minutes"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        return None
