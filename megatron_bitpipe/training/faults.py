"""Injected faults for testing how a job ends or slows down: the ``--inject-fault`` flags.

One fault on one rank (``--inject-fault-rank``, a global rank) from one iteration on
(``--inject-fault-iteration``, counted from 1 like the logs), in the spirit of megatron-core's
fault injector (which picks ranks and times at random through nvidia-resiliency-ext); here the
rank and the iteration are fixed, so a test knows what to expect:

* ``hang``: at the start of that iteration's training step the rank stops for good (it sleeps
  until the job is ended); the others wait for it in their next communication with it, and the
  :mod:`.watchdog` ends the job.
* ``crash``: at the start of that iteration's training step the rank prints one line and kills
  itself with SIGKILL (as the kernel's OOM killer or a segmentation fault would: no Python
  clean-up, no error report of its own).
* ``slow``: from that iteration on, the rank sleeps ``--inject-fault-sleep`` seconds in the
  first forward step of each iteration (as a slow device would), so the per-rank forward times
  and the straggler report (:mod:`.straggler`) see it.

``--inject-fault-at save`` moves ``hang`` and ``crash`` into the checkpoint save after that
iteration (which must be a save iteration): after every rank's shards are written and before
the checkpoint's index and metadata are, so the save stays incomplete.

A fault fires on the job's first attempt only: a job started again after a failure (requeued by
SLURM, ``SLURM_RESTART_COUNT`` > 0, or its workers restarted by torchrun,
``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from its checkpoint without it, so that a test can
follow a fault to the job's recovery (:func:`job_restart` tells, :meth:`FaultInjection.from_args`
decides).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional

from ..flag_set import FlagSet

__all__ = ["FAULTS", "FAULT_FLAGS", "FAULT_POINTS", "RESTART_COUNTS", "FaultInjection", "add_fault_args", "fault_problems", "job_restart"]

#: ``--inject-fault`` values
FAULTS = ("hang", "crash", "slow")
#: ``--inject-fault-at`` values: the start of the training step, or inside the checkpoint save
FAULT_POINTS = ("step", "save")
#: the environment variables counting a job's restarts: SLURM's (a requeued job), torchrun's (restarted workers)
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def add_fault_args(parser: argparse.ArgumentParser) -> None:
    """The ``--inject-fault`` flags (testing only)."""
    group = parser.add_argument_group(title="fault injection (testing)")
    group.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default=None,
        help="make one rank fail: hang (stops for good), crash (killed with SIGKILL) or slow (sleeps "
        "--inject-fault-sleep seconds per iteration); for testing how the job ends or reports a straggler. "
        "On the job's first attempt only: a restarted job (SLURM_RESTART_COUNT or TORCHELASTIC_RESTART_COUNT "
        "above 0) resumes without it",
    )
    group.add_argument("--inject-fault-rank", type=int, default=0, metavar="RANK", help="global rank of the fault (default 0)")
    group.add_argument(
        "--inject-fault-iteration",
        type=int,
        default=1,
        metavar="ITERATION",
        help="iteration (counted from 1) in which the fault starts; slow: and every one after (default 1)",
    )
    group.add_argument(
        "--inject-fault-at",
        choices=FAULT_POINTS,
        default="step",
        help="hang or crash at the start of the iteration's training step (step, default) or inside the checkpoint "
        "save after it (save: after every rank's shards are written, before the checkpoint's index)",
    )
    group.add_argument("--inject-fault-sleep", type=float, default=1.0, metavar="SECONDS", help="slow: seconds of sleep per iteration (default 1)")


def fault_problems(args: argparse.Namespace) -> List[str]:
    """The fault flags' rules (no communication)."""
    if args.inject_fault is None:
        return []
    problems = []
    if not 0 <= args.inject_fault_rank < args.world_size:
        problems.append(f"--inject-fault-rank {args.inject_fault_rank} must be a rank of the job (0 to {args.world_size - 1})")
    if not 1 <= args.inject_fault_iteration <= args.train_iters:
        problems.append(f"--inject-fault-iteration {args.inject_fault_iteration} must be in 1..--train-iters {args.train_iters}")
    if args.inject_fault_at == "save":
        if args.inject_fault == "slow":
            problems.append("--inject-fault-at save takes hang or crash, not slow")
        saved = args.save is not None and (
            (args.save_interval and args.inject_fault_iteration % args.save_interval == 0)
            or args.inject_fault_iteration == args.train_iters
        )
        if not saved:
            problems.append(
                f"--inject-fault-at save: iteration {args.inject_fault_iteration} saves no checkpoint (needs --save and a "
                "multiple of --save-interval, or the last iteration)"
            )
    if args.inject_fault == "slow" and args.inject_fault_sleep <= 0:
        problems.append(f"--inject-fault-sleep must be positive (got {args.inject_fault_sleep})")
    return problems


#: the fault-injection flags and rules on the pretraining scripts' command line
FAULT_FLAGS = FlagSet("fault injection", add_fault_args, fault_problems)


def job_restart(environ: Mapping[str, str]) -> Optional[str]:
    """The restart count that says this process belongs to a restarted job, as ``NAME=count``
    (the first of :data:`RESTART_COUNTS` above 0), or None on the job's first attempt."""
    for name in RESTART_COUNTS:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return f"{name}={int(value)}"
    return None


@dataclass(frozen=True)
class FaultInjection:
    """The fault of the ``--inject-fault`` flags on this rank (``kind`` None: none here).

    Attributes:
        kind: ``hang``, ``crash``, ``slow`` or None.
        iteration: the iteration (from 1) in which it starts.
        point: ``step`` or ``save`` (hang and crash).
        sleep_s: ``slow``'s seconds of sleep per iteration.
    """

    kind: Optional[str] = None
    iteration: int = 1
    point: str = "step"
    sleep_s: float = 0.0

    @classmethod
    def from_args(cls, args: argparse.Namespace, rank: int, restart: Optional[str] = None) -> "FaultInjection":
        """This rank's fault: the flags' when ``rank`` is ``--inject-fault-rank`` on the job's
        first attempt, else none. ``restart``: :func:`job_restart`'s answer; when it names a
        restart, the fault's rank prints one line on stderr saying it is skipped."""
        if args.inject_fault is None or rank != args.inject_fault_rank:
            return cls()
        if restart is not None:
            print(
                f"[rank {rank}] --inject-fault {args.inject_fault} skipped: the job was restarted ({restart}); "
                "an injected fault fires on the job's first attempt only",
                file=sys.stderr,
                flush=True,
            )
            return cls()
        return cls(args.inject_fault, args.inject_fault_iteration, args.inject_fault_at, args.inject_fault_sleep)

    def before_step(self, iteration: int) -> None:
        """Called at the start of the training step of ``iteration`` (from 1)."""
        if self.point == "step" and iteration == self.iteration:
            self._fail(f"at the start of iteration {iteration}")

    def during_save(self, iteration: int) -> None:
        """Called inside the checkpoint save after ``iteration``, once this rank's shards are written."""
        if self.point == "save" and iteration == self.iteration:
            self._fail(f"in the checkpoint save after iteration {iteration}, its shards written")

    def slowed(self, forward_step: Callable, iteration: Callable[[], int]) -> Callable:
        """``forward_step``, sleeping :attr:`sleep_s` in its first call of each iteration from
        :attr:`iteration` on (``iteration()``: the one running); ``forward_step`` itself without
        a ``slow`` fault."""
        if self.kind != "slow":
            return forward_step
        slept = set()

        @functools.wraps(forward_step)
        def slow_forward_step(*args, **kwargs):
            now = iteration()
            if now >= self.iteration and now not in slept:
                slept.add(now)
                time.sleep(self.sleep_s)
            return forward_step(*args, **kwargs)

        return slow_forward_step

    def _fail(self, where: str) -> None:
        if self.kind not in ("hang", "crash"):
            return
        rank = os.environ.get("RANK", "0")
        action = "stops here for good" if self.kind == "hang" else "is killed with SIGKILL"
        print(f"[rank {rank}] --inject-fault {self.kind} {where}: this rank {action}", file=sys.stderr, flush=True)
        if self.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600.0)
