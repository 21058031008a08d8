"""ABS-SGD's flags, rules, planned counts and sample streams (pure Python, no ranks)."""

from __future__ import annotations

import pytest

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.run_config import RunConfig
from megatron_bitpipe.training.abs_sgd import AbsSgdSettings, train_samples_of
from megatron_bitpipe.training.abs_sgd.args import CountRule
from megatron_bitpipe.training.abs_sgd.counts import SpeedEstimate, plan_counts, stream_samples
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.data import microbatches
from megatron_bitpipe.training.gpt import GPTTask

BASE = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip
ABS = ["--data-parallel-mode", "abs-sgd"]
BITPIPE = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4"]


def parse(*extra, world_size=4, cuda=False):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=cuda)


BAD = [
    (["--abs-trigger", "count", "--abs-step-seconds", "1"], 4, "--abs-trigger, --abs-step-seconds need --data-parallel-mode abs-sgd"),
    (["--emulate-replica-slowdown", "1,2"], 4, "--emulate-replica-slowdown needs one factor per data-parallel replica (4), got 2"),
    (["--emulate-replica-slowdown", "1,1,0.5,1"], 4, "factors must be >= 1"),
    ([*ABS, "--overlap-grad-reduce"], 4, "drop --overlap-grad-reduce"),
    ([*ABS, "--abs-trigger", "count", "--abs-step-seconds", "2"], 4, "--abs-step-seconds belongs to --abs-trigger time"),
    ([*ABS, "--abs-step-seconds", "-1"], 4, "--abs-step-seconds must be >= 0"),
    ([*ABS, "--abs-trigger", "fixed"], 4, "--abs-trigger fixed needs --abs-replica-microbatches"),
    ([*ABS, "--abs-trigger", "fixed", "--abs-replica-microbatches", "2,2"], 4, "--abs-replica-microbatches needs one count per data-parallel replica (4), got 2"),
    ([*ABS, "--abs-trigger", "fixed", "--abs-replica-microbatches", "2,2,2,2", "--abs-max-microbatches", "4"], 4, "--abs-max-microbatches does not apply to --abs-trigger fixed"),
    ([*ABS, "--abs-replica-microbatches", "2,2,2,2"], 4, "--abs-replica-microbatches needs --abs-trigger fixed"),
    ([*ABS, "--abs-min-microbatches", "4", "--abs-max-microbatches", "2"], 4, "--abs-min-microbatches 4 exceeds --abs-max-microbatches 2"),
    ([*ABS, "--abs-min-microbatches", "0"], 4, "--abs-min-microbatches must be >= 1"),
    ([*ABS, *BITPIPE, "--abs-min-microbatches", "3"], 4, "--abs-min-microbatches = 3: bitpipe splits the micro-batches between two pipelines"),
    ([*ABS, *BITPIPE, "--abs-min-microbatches", "2"], 4, "--abs-min-microbatches = 2: bitpipe needs at least --pipeline-model-parallel-size=4"),
    ([*ABS, *BITPIPE, "--global-batch-size", "8", "--abs-trigger", "fixed", "--abs-replica-microbatches", "5"], 4, "--abs-replica-microbatches (replica 0) = 5"),
    ([*ABS, "--abs-trigger", "count", "--abs-min-microbatches", "3"], 4, "too few for --abs-min-microbatches 3"),
]  # fmt: skip


@pytest.mark.parametrize("extra,world_size,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_flags_name_the_flag(extra, world_size, message):
    with pytest.raises(BitPipeConfigError, match=None) as error:
        parse(*extra, world_size=world_size)
    assert message in str(error.value)


def test_fp16_is_refused_with_a_delayed_gradient():
    with pytest.raises(BitPipeConfigError) as error:
        parse(*ABS, "--fp16", cuda=True)
    assert "--data-parallel-mode abs-sgd does not support --fp16" in str(error.value)


def test_defaults():
    sync = AbsSgdSettings.from_args(parse())
    assert not sync.enabled and sync.slowdown is None
    settings = AbsSgdSettings.from_args(parse(*ABS, "--emulate-replica-slowdown", "1,1,2,4"))
    assert settings.enabled and (settings.trigger, settings.delay, settings.step_seconds) == ("time", 1, 0.0)
    assert settings.rule == CountRule(1, 8, 1)  # the schedule's fewest; 4 x the synchronous 2
    assert (settings.reference_microbatches, settings.initial_microbatches, settings.slowdown) == (8, 2, (1, 1, 2, 4))
    bitpipe = AbsSgdSettings.from_args(parse(*ABS, *BITPIPE, world_size=4))
    assert bitpipe.rule == CountRule(4, 32, 2) and bitpipe.initial_microbatches == 8


def test_dataset_holds_the_furthest_stream():
    assert train_samples_of(parse()) == 4 * 16
    # 4 iterations x at most 8 micro-batches x 4 replicas x 2 samples
    assert train_samples_of(parse(*ABS)) == 4 * 8 * 4 * 2
    assert train_samples_of(parse(*ABS, "--abs-trigger", "fixed", "--abs-replica-microbatches", "1,1,1,3")) == 4 * 3 * 4 * 2


def test_streams_are_disjoint_and_equal_counts_give_synchronous_order():
    dp, mbs = 4, 2
    seen = [i for r in range(dp) for p in range(10) for i in stream_samples(r, p, dp, mbs)]
    assert sorted(seen) == list(range(10 * dp * mbs))
    args = parse()
    dataset = list(range(1000))
    for iteration in range(3):
        first = iteration * args.global_batch_size
        for r in range(dp):
            sync = [batch.tolist() for batch in microbatches([{"x": i} for i in dataset], first, RunConfig.from_args(args), r) for batch in [batch["x"]]]
            positions = range(iteration * args.num_microbatches, (iteration + 1) * args.num_microbatches)
            assert sync == [stream_samples(r, p, dp, mbs) for p in positions]


RULE = CountRule(2, 16, 2)


def test_count_trigger_shares_the_target_by_speed():
    counts = plan_counts("count", RULE, [1.0, 1.0, 0.5, 0.25], initial=4, target=22, step_seconds=0, data_parallel_size=4)
    assert sum(counts) == 22 and all(RULE.accepts(c) for c in counts)
    assert counts == [8, 8, 4, 2]
    assert plan_counts("count", RULE, None, initial=4, target=22, step_seconds=0, data_parallel_size=4) == [4] * 4
    clamped = plan_counts("count", RULE, [100.0, 1.0], initial=4, target=40, step_seconds=0, data_parallel_size=2)
    assert clamped == [16, 2]  # at most --abs-max-microbatches, at least the fewest


def test_time_trigger_fills_the_slowest_replicas_time():
    # the slowest (0.25 mb/s) needs 8 s for its fewest 2; the others fill 8 s
    assert plan_counts("time", RULE, [1.0, 1.0, 0.5, 0.25], initial=4, target=0, step_seconds=0, data_parallel_size=4) == [8, 8, 4, 2]
    assert plan_counts("time", RULE, [1.0, 0.5], initial=4, target=0, step_seconds=11, data_parallel_size=2) == [10, 4]
    assert plan_counts("fixed", RULE, [1.0], initial=4, target=0, step_seconds=0, data_parallel_size=2, fixed=(6, 2)) == [6, 2]


def test_speed_estimate_is_a_moving_average():
    speeds = SpeedEstimate(smoothing=0.5)
    speeds.update([4, 2], [1.0, 1.0])
    assert speeds.speeds == [4.0, 2.0]
    speeds.update([2, 2], [1.0, 2.0])
    assert speeds.speeds == [3.0, 1.5]
