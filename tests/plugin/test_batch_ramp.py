"""Batch-size ramps (pure): megatron-core's calculator gives every step's N, each schedule's rules
are checked for every N a ramp reaches, and the first step that breaks one is named in one line.

megatron-core 0.16 implements ``--rampup-batch-size``, 0.19 ``--step-batch-size-schedule``; each
test runs the ramp the installed megatron-core has (both are covered by the two CI legs), and the
other one is refused naming its flag.
"""

from __future__ import annotations

import argparse

import pytest

from megatron_bitpipe.batch_ramp import BatchRamp, batch_ramp_of, ramp_problems, ramp_segments
from megatron_bitpipe.megatron_compat import BatchRampUnsupported, batch_size_calculator, has_batch_ramp
from megatron_bitpipe.schedules import ScheduleChoice

RAMPUP = has_batch_ramp("--rampup-batch-size")
STEP = has_batch_ramp("--step-batch-size-schedule")


def test_exactly_one_ramp_per_megatron_core_release():
    assert RAMPUP != STEP


def ramp(start: int, increment: int, samples: int, final: int) -> BatchRamp:
    """The installed megatron-core's ramp of the same global batches: the ramp-up START INCR
    SAMPLES to ``final`` or, on 0.19, the step schedule with the thresholds 0.16's ramp-up
    switches at (in tokens of 16-token samples)."""
    if RAMPUP:
        return BatchRamp("--rampup-batch-size", rampup=(start, increment, samples), final_global_batch_size=final)
    per_increment = samples / ((final - start) // increment)
    thresholds = [0] + [int(-(-k * per_increment // 1)) for k in range(1, (final - start) // increment + 1)]
    entries = " ".join(f"{t * 16}:{start + k * increment}" for k, t in enumerate(thresholds))
    return BatchRamp("--step-batch-size-schedule", step_schedule=entries, seq_length=16)


def test_segments_follow_megatron_cores_calculator():
    """4, 4, 8, 12, 12 samples at data-parallel size 2: N = 2, 2, 4, 6, 6; Megatron-LM's
    sample-based count (--train-samples 40) gives 5 iterations, and so do 5 --train-iters."""
    r = ramp(4, 4, 16, 12)
    for segments in (ramp_segments(r, 1, 2, train_samples=40), ramp_segments(r, 1, 2, train_iters=5)):
        assert [(s.first_iteration, s.iterations, s.consumed_samples, s.global_batch_size, s.num_microbatches) for s in segments] == [
            (1, 2, 0, 4, 2), (3, 1, 8, 8, 4), (4, 2, 16, 12, 6)]  # fmt: skip
    # the calculator itself, step by step, agrees (the ramp's N are megatron-core's, not a formula here)
    calculator = r.calculator(1, 2)
    consumed, ns = 0, []
    for _ in range(5):
        calculator.update(consumed, True)
        ns.append(calculator.get())
        consumed += calculator.get() * 2
    assert ns == [2, 2, 4, 6, 6]


def test_a_long_ramp_is_counted_in_segments():
    """GPT-3's ramp (32 to 1536 by 32 over 5,859,375 samples of 146,484,375) at data-parallel
    size 32: N = 1, 2, ..., 48, the last for the rest of the 146,484,375 samples."""
    segments = ramp_segments(ramp(32, 32, 5859375, 1536), 1, 32, train_samples=146484375)
    assert [s.num_microbatches for s in segments] == list(range(1, 49))
    assert segments[-1].iterations > 90000 and segments[-1].consumed_samples > 5859375


@pytest.mark.parametrize(
    "schedule, pp, start, rule",
    [
        ("bitpipe", 2, 2, "bitpipe splits the micro-batches between two pipelines and needs an even number of micro-batches"),
        ("dualpipe", 2, 4, "dualpipe needs an even number of micro-batches, at least 2 x --pipeline-model-parallel-size = 4"),
        ("zbv", 4, 4, "zbv needs at least"),
    ],
)
def test_the_first_step_that_breaks_a_rule_is_named_in_one_line(schedule, pp, start, rule):
    """Data-parallel size 2, micro-batch 1; the ramp starts at ``start`` samples (N = start / 2),
    which the schedule refuses, and ends at a size it accepts."""
    r = ramp(start, 2, 8, start + 8)
    (line,) = ramp_problems(r, ScheduleChoice(schedule), pp, 1, 2, train_iters=20)
    assert line.startswith(f"{r.text}: iteration 1 (0 samples consumed) has a global batch of {start}, ")
    assert f"(--micro-batch-size 1 x data-parallel size 2) = {start // 2}: " in line
    assert rule in line
    assert "\n" not in line


def test_a_later_step_is_named_with_its_iteration_and_samples():
    """8, 10, 12 samples at DP 2 give N = 4, 5, 6: ZB-V on 4 ranks (N >= 4) takes them all,
    BitPipe refuses the odd N = 5, which is not the first step."""
    r = ramp(8, 2, 40, 12)
    assert ramp_problems(r, ScheduleChoice("zbv"), 4, 1, 2, train_iters=10) == []
    (line,) = ramp_problems(r, ScheduleChoice("bitpipe"), 2, 1, 2, train_iters=10)
    segments = ramp_segments(r, 1, 2, train_iters=10)
    odd = next(s for s in segments if s.num_microbatches % 2)
    assert line.startswith(f"{r.text}: iteration {odd.first_iteration} ({odd.consumed_samples} samples consumed) has a global batch of {odd.global_batch_size}")
    assert odd.first_iteration > 1 and f"= {odd.num_microbatches}: bitpipe" in line


def test_a_global_batch_not_divisible_by_the_data_parallel_ranks():
    r = ramp(2, 2, 8, 8)
    (line,) = ramp_problems(r, ScheduleChoice("bitpipe"), 2, 1, 4, train_iters=10)
    assert line == f"{r.text}: iteration 1 (0 samples consumed) has a global batch of 2, not divisible by --micro-batch-size 1 x data-parallel size 4"


def test_ramps_every_schedule_accepts_pass():
    r = ramp(4, 4, 16, 12)
    for schedule in ("bitpipe", "zb-h1", "zbv", "chimera"):
        assert ramp_problems(r, ScheduleChoice(schedule), 2, 1, 2, train_samples=40) == [], schedule


def test_the_missing_ramp_is_refused_naming_its_flag():
    missing = "--step-batch-size-schedule" if RAMPUP else "--rampup-batch-size"
    other = BatchRamp(missing, step_schedule="0:4 160:8", seq_length=16) if RAMPUP else BatchRamp(missing, rampup=(4, 4, 16), final_global_batch_size=12)
    with pytest.raises(BatchRampUnsupported, match=f"^{missing}: the installed megatron-core has no such batch-size ramp"):
        other.calculator(1, 2)
    (line,) = ramp_problems(other, ScheduleChoice("bitpipe"), 2, 1, 2, train_iters=4)
    assert line.startswith(f"{missing}: the installed megatron-core has no such batch-size ramp")


def test_a_malformed_ramp_gives_megatrons_reason_after_the_flag():
    bad = BatchRamp("--rampup-batch-size", rampup=(2, 3, 16), final_global_batch_size=12) if RAMPUP else BatchRamp(
        "--step-batch-size-schedule", step_schedule="16:4 32:8", seq_length=16)  # fmt: skip
    (line,) = ramp_problems(bad, ScheduleChoice("bitpipe"), 2, 1, 2, train_iters=4)
    assert line.startswith(bad.text + ": ") and ("divisible" in line if RAMPUP else "threshold 0" in line)


def test_flags_to_ramp():
    args = argparse.Namespace(rampup_batch_size=["4", "4", "16"], global_batch_size=12, seq_length=16)
    assert batch_ramp_of(args) == BatchRamp("--rampup-batch-size", rampup=(4, 4, 16), final_global_batch_size=12)
    assert (batch_ramp_of(args, implemented_only=True) is None) is (not RAMPUP)  # core_v0.19.0 trains at --global-batch-size
    args = argparse.Namespace(step_batch_size_schedule="0:4 1K:8", global_batch_size=1, seq_length=16)
    assert batch_ramp_of(args) == BatchRamp("--step-batch-size-schedule", step_schedule="0:4 1K:8", seq_length=16)
    assert batch_ramp_of(argparse.Namespace(global_batch_size=8)) is None


def test_constant_calculator():
    calculator = batch_size_calculator(global_batch_size=8, micro_batch_size=1, data_parallel_size=2)
    calculator.update(100, True)
    assert calculator.get() == 4 and calculator.get_current_global_batch_size() == 8
