"""Megatron-LM's batch-size ramps: the number of micro-batches of every step, and each schedule's
rules for every number a ramp reaches.

Two ramps, by Megatron-LM's flags (megatron-core implements each with its own calculator,
:func:`~megatron_bitpipe.megatron_compat.batch_size_calculator`):

* ``--rampup-batch-size START INCR SAMPLES`` (megatron-core 0.16): the global batch grows from
  START by INCR over SAMPLES consumed samples up to ``--global-batch-size``;
* ``--step-batch-size-schedule "THRESHOLD:BS ..."`` (megatron-core 0.19): the global batch is
  BS from THRESHOLD consumed tokens on (samples where no sequence length is given).

Iteration ``i`` (1-based) trains on the global batch megatron-core's calculator gives for the
samples consumed before it, ``N_i = batch / (--micro-batch-size x data-parallel size)``
micro-batches per data-parallel rank, and the samples consumed grow by ``N_i x
--micro-batch-size x data-parallel size`` (Megatron-LM's training loop). A plan-executed
schedule runs one plan per N (each made and validated once, cached by the step function that
runs it: :func:`~megatron_bitpipe.execution.forward_backward.make_step_func`), so every N a
ramp reaches must satisfy the schedule's rules: :func:`ramp_problems` checks them all before
any communication and names the first iteration that breaks one.

Pure Python; megatron-core's calculator module only (no torch.distributed).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from .megatron_compat import BATCH_RAMPS, batch_size_calculator, has_batch_ramp, ramp_end_samples
from .schedules import ScheduleChoice

__all__ = ["BatchRamp", "RampSegment", "batch_ramp_of", "ramp_problems", "ramp_segments"]

#: Megatron-LM's namespace attribute of each ramp flag
_ATTRIBUTES = {"--rampup-batch-size": "rampup_batch_size", "--step-batch-size-schedule": "step_batch_size_schedule"}


@dataclass(frozen=True)
class BatchRamp:
    """One run's batch-size ramp, as given.

    Attributes:
        flag: ``--rampup-batch-size`` or ``--step-batch-size-schedule``.
        rampup: START, INCR, SAMPLES of ``--rampup-batch-size`` (None for the other flag).
        step_schedule: the ``--step-batch-size-schedule`` string (None for the other flag).
        seq_length: tokens per sample: the step schedule's thresholds are tokens (Megatron-LM
            passes ``--seq-length``); None: samples.
        final_global_batch_size: ``--global-batch-size``, the ramp-up's last size (unused by the
            step schedule, whose last entry is its last size).
    """

    flag: str
    rampup: Optional[Tuple[int, int, int]] = None
    step_schedule: Optional[str] = None
    seq_length: Optional[int] = None
    final_global_batch_size: Optional[int] = None

    @property
    def text(self) -> str:
        """The flag with its value, as typed."""
        value = " ".join(map(str, self.rampup)) if self.rampup is not None else f'"{self.step_schedule}"'
        return f"{self.flag} {value}"

    def calculator(self, micro_batch_size: int, data_parallel_size: int):
        """A new megatron-core calculator of this ramp (ValueError for a malformed ramp,
        :class:`~megatron_bitpipe.megatron_compat.BatchRampUnsupported` where the installed
        megatron-core lacks it)."""
        return batch_size_calculator(
            global_batch_size=self.final_global_batch_size,
            micro_batch_size=micro_batch_size,
            data_parallel_size=data_parallel_size,
            rampup_batch_size=self.rampup,
            step_batch_size_schedule=self.step_schedule,
            seq_length=self.seq_length if self.step_schedule is not None else None,
        )


def batch_ramp_of(args: argparse.Namespace, *, implemented_only: bool = False) -> Optional[BatchRamp]:
    """The ramp of the flags (Megatron-LM's names; None without one). ``implemented_only``: the
    ramp megatron-core's calculator applies, as Megatron-LM's training code builds it — None for
    a flag the installed megatron-core does not implement (core_v0.19.0 accepts
    ``--rampup-batch-size`` and trains at ``--global-batch-size``)."""
    for flag in BATCH_RAMPS:
        value = getattr(args, _ATTRIBUTES[flag], None)
        if value is None or (implemented_only and not has_batch_ramp(flag)):
            continue
        if flag == "--rampup-batch-size":
            return BatchRamp(flag, rampup=tuple(int(v) for v in value), final_global_batch_size=args.global_batch_size)
        return BatchRamp(flag, step_schedule=str(value), seq_length=getattr(args, "seq_length", None))
    return None


@dataclass(frozen=True)
class RampSegment:
    """Consecutive iterations of one global batch.

    Attributes:
        first_iteration: the first of them (1-based).
        iterations: how many.
        consumed_samples: samples consumed before the first of them.
        global_batch_size: the calculator's global batch of each.
        num_microbatches: micro-batches per data-parallel rank of each (N).
    """

    first_iteration: int
    iterations: int
    consumed_samples: int
    global_batch_size: int
    num_microbatches: int


def _steps(ramp: BatchRamp, micro_batch_size: int, data_parallel_size: int, train_iters: Optional[int], train_samples: Optional[int]) -> Iterator[Tuple[int, int, int, int]]:
    """(consumed samples before it, global batch, N, repeats) of every stretch of iterations:
    one by one while the ramp changes, then the rest at the final batch as one. With
    ``train_iters`` that many iterations; else, from ``train_samples``, the iterations
    Megatron-LM's ``update_train_iters`` counts: the ramp-up's while the consumed samples are <=
    both SAMPLES and ``train_samples`` and then whole final batches; the step schedule's while
    they are below ``train_samples``."""
    calculator = ramp.calculator(micro_batch_size, data_parallel_size)
    end = ramp_end_samples(calculator)
    per_microbatch = micro_batch_size * data_parallel_size
    consumed, done = 0, 0

    def at(samples: int) -> Tuple[int, int]:
        calculator.update(samples, False)
        return calculator.get_current_global_batch_size(), calculator.get()

    if train_iters is not None:
        while done < train_iters:
            batch, n = at(consumed)
            if consumed >= end:
                yield consumed, batch, n, train_iters - done
                return
            yield consumed, batch, n, 1
            consumed, done = consumed + n * per_microbatch, done + 1
        return
    samples = train_samples or 0
    if ramp.rampup is not None:
        while consumed <= ramp.rampup[2] and consumed <= samples:
            batch, n = at(consumed)
            yield consumed, batch, n, 1
            consumed += batch
        rest = max(samples - consumed, 0) // ramp.final_global_batch_size
        if rest:
            yield (consumed, *at(consumed), rest)
        return
    while consumed < samples:
        batch, n = at(consumed)
        if consumed >= end:
            yield consumed, batch, n, -(-(samples - consumed) // batch)
            return
        yield consumed, batch, n, 1
        consumed += batch


def ramp_segments(
    ramp: BatchRamp, micro_batch_size: int, data_parallel_size: int, *, train_iters: Optional[int] = None, train_samples: Optional[int] = None
) -> List[RampSegment]:
    """The run's iterations through ``ramp``, one :class:`RampSegment` per stretch of one global
    batch (see :func:`_steps` for how many iterations). ValueError for a malformed ramp."""
    segments: List[RampSegment] = []
    iteration = 1
    for consumed, batch, n, repeats in _steps(ramp, micro_batch_size, data_parallel_size, train_iters, train_samples):
        last = segments[-1] if segments else None
        if last is not None and last.global_batch_size == batch:
            segments[-1] = RampSegment(last.first_iteration, last.iterations + repeats, last.consumed_samples, batch, n)
        else:
            segments.append(RampSegment(iteration, repeats, consumed, batch, n))
        iteration += repeats
    return segments


def ramp_problems(
    ramp: BatchRamp,
    choice: ScheduleChoice,
    pipeline_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    *,
    train_iters: Optional[int] = None,
    train_samples: Optional[int] = None,
) -> List[str]:
    """One line for the first iteration of ``ramp`` whose global batch breaks a rule (``[]`` if
    none): not divisible by ``--micro-batch-size x data-parallel size``, or an N that
    ``choice``'s rules on ``pipeline_size`` ranks refuse (:meth:`ScheduleChoice.problems`). The
    line names the flag, the iteration, the consumed samples, N and the rule. A malformed ramp
    (megatron-core's calculator refuses it) or one the installed megatron-core lacks: one line
    naming the flag."""
    try:
        segments = ramp_segments(ramp, micro_batch_size, data_parallel_size, train_iters=train_iters, train_samples=train_samples)
    except ValueError as error:  # BatchRampUnsupported included
        message = str(error)
        return [message if message.startswith(ramp.flag) else f"{ramp.text}: {message}"]
    per_microbatch = micro_batch_size * data_parallel_size
    fixed_rules = choice.problems(pipeline_size)
    for segment in segments:
        where = f"{ramp.text}: iteration {segment.first_iteration} ({segment.consumed_samples} samples consumed) has a global batch of {segment.global_batch_size}"
        if segment.global_batch_size % per_microbatch:
            return [f"{where}, not divisible by --micro-batch-size {micro_batch_size} x data-parallel size {data_parallel_size}"]
        label = f"{where}, so N = global batch / (--micro-batch-size {micro_batch_size} x data-parallel size {data_parallel_size})"
        broken = [p for p in choice.problems(pipeline_size, segment.num_microbatches, microbatches=label) if p not in fixed_rules]
        if broken:
            return [broken[0]]
    return []
