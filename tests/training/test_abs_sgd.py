"""ABS-SGD (``--data-parallel-mode abs-sgd``) end to end on 4 CPU ranks (gloo).

* **Zero delay, equal counts = synchronous.** ``--abs-gradient-delay 0`` with every replica
  running the synchronous count reproduces today's synchronous data parallelism bit for bit
  (losses, grad norms, learning rates, weights): pure data parallelism (DP 4) and BitPipe
  (PP 2 x DP 2).
* **Exact replay.** Runs with unequal emulated slowdowns record every rank's sample indices;
  a single process replays the same delayed update in float64 from those indices and the
  logged counts and matches the weights: DP 4 with the adaptive time trigger (slowdowns
  1,1,2,4), and BitPipe PP 2 x DP 2 with counts planned from the measured speeds (count
  trigger, slowdowns 1,3). Every sample is read by one replica only, as whole micro-batches
  of its own stream.
* **Checkpoints.** A run that saves mid-way (a gradient in flight: the save waits for its
  all-reduce) still replays exactly, and resuming from that checkpoint continues bit for bit
  like the uninterrupted run; a synchronous run refuses it, naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch

from .abs_sgd_support import replay, replica_batches, train_case

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1800)]

MBS = 2
MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", str(MBS), "--global-batch-size", "16", "--vocab-size", "127", "--seed", "1234",
    "--lr", "2e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--adam-eps", "1e-4",
    "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip
BITPIPE = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
ABS = ["--data-parallel-mode", "abs-sgd"]


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple
    iterations: int


def _case(name: str, iterations: int, *argv: str) -> Case:
    return Case(name, (*MODEL, "--train-iters", str(iterations), *argv), iterations)


ZERO_DELAY = ["--abs-gradient-delay", "0", "--abs-trigger", "fixed"]
CASES: List[Case] = [
    _case("sync_dp4", 4),
    _case("zero_delay_dp4", 4, *ABS, *ZERO_DELAY, "--abs-replica-microbatches", "2,2,2,2"),
    _case("sync_bitpipe", 4, *BITPIPE),
    _case("zero_delay_bitpipe", 4, *BITPIPE, *ABS, *ZERO_DELAY, "--abs-replica-microbatches", "4,4"),
    _case("time_dp4", 6, *ABS, "--emulate-replica-slowdown", "1,1,2,4", "--abs-max-microbatches", "6"),
    _case("count_bitpipe", 6, *BITPIPE, *ABS, "--abs-trigger", "count", "--emulate-replica-slowdown", "1,3"),
    _case("fixed_uninterrupted", 5, *ABS, "--abs-trigger", "fixed", "--abs-replica-microbatches", "3,2,2,1"),
]
SAVED_AT = 3


def run_all(root: str) -> dict:
    """Rank body: every case in one launch; ``fixed_uninterrupted`` also saves checkpoints
    (iteration 3, with a gradient in flight, and the last), which the last two runs load."""
    out = {}
    ckpt = f"{root}/ckpt"
    for case in CASES:
        argv = list(case.argv)
        if case.name == "fixed_uninterrupted":
            argv += ["--save", ckpt, "--save-interval", str(SAVED_AT)]
        out[case.name] = train_case(argv, f"{root}/{case.name}.jsonl")
    fixed = _case_named("fixed_uninterrupted")
    resume = ["--load", ckpt, "--ckpt-step", str(SAVED_AT)]
    out["fixed_resumed"] = train_case([*fixed.argv, *resume], f"{root}/fixed_resumed.jsonl")
    out["sync_refuses"] = train_case([*MODEL, "--train-iters", str(fixed.iterations), *resume], f"{root}/sync_refuses.jsonl")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("abs_sgd")
    ranks = launch(run_all, 4, str(root), timeout=1500)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def _records(per_rank: List[dict]) -> dict:
    return per_rank[0]["records"]


def _case_named(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


@pytest.mark.parametrize("layout", ["dp4", "bitpipe"])
def test_zero_delay_with_equal_counts_is_synchronous_bit_for_bit(runs, layout):
    sync, zero = runs[f"sync_{layout}"], runs[f"zero_delay_{layout}"]
    for it, want in _records(sync).items():
        got = _records(zero)[it]
        for key in ("lm_loss", "grad_norm", "lr", "consumed_samples"):
            assert got[key] == want[key], f"iteration {it} {key}: {got[key]!r} != {want[key]!r}"
        assert got["abs_staleness"] == 0 and got["abs_applied_iteration"] == it
    for rank_sync, rank_zero in zip(sync, zero):
        for name, value in rank_sync["params"].items():
            assert torch.equal(rank_zero["params"][name], value), name


#: fp32 ranks vs the fp64 replay: the largest difference measured was 2e-7
REPLAY_ATOL = 1e-6


def _max_difference(per_rank: List[dict], expected: dict) -> float:
    return max((value.double() - expected[param]).abs().max().item() for rank in per_rank for param, value in rank["params"].items())


def _assert_replayed(runs, name: str, delay: int = 1):
    case = _case_named(name)
    per_rank = runs[name]
    records = _records(per_rank)
    batches = replica_batches(per_rank, records, MBS)
    assert len(batches) == case.iterations - delay
    model = [*MODEL, "--train-iters", str(case.iterations)]  # the single process: no parallelism flags
    expected = launch(replay, 1, model, batches, delay, case.iterations, timeout=600)[0]
    assert _max_difference(per_rank, expected) <= REPLAY_ATOL
    return records, batches


def _assert_streams(per_rank: List[dict], dp: int):
    """Each replica read whole micro-batches of its own stream, in order, and no sample twice."""
    seen = {}
    for rank in per_rank:
        if rank["pp_rank"] or rank["tp_rank"]:
            continue
        r, indices = rank["dp_rank"], rank["indices"]
        expected = [(j * dp + r) * MBS + i for j in range(len(indices) // MBS) for i in range(MBS)]
        assert indices == expected, f"replica {r} read {indices[:12]}..."
        seen[r] = set(indices)
    union = set().union(*seen.values())
    assert len(union) == sum(len(s) for s in seen.values())


def test_adaptive_time_trigger_replays_exactly(runs):
    records, batches = _assert_replayed(runs, "time_dp4")
    # the check discriminates: the same batches applied without delay end elsewhere
    model = [*MODEL, "--train-iters", "6"]
    undelayed = launch(replay, 1, model, batches, 0, len(batches), timeout=600)[0]
    assert _max_difference(runs["time_dp4"], undelayed) > 100 * REPLAY_ATOL
    _assert_streams(runs["time_dp4"], dp=4)
    counts = [len(batch[r]) for batch in batches for r in range(4)]
    assert min(counts) >= 1 and max(counts) <= 6
    assert any(len(set(len(replica) for replica in batch)) > 1 for batch in batches), "the slowdowns should make the counts unequal"
    for it, record in records.items():
        if it == 1:
            assert record["skipped"] and record["abs_staleness"] is None
        else:
            assert record["abs_staleness"] == 1 and len(record["abs_sync_wait_ms_per_replica"]) == 4
            assert record["consumed_samples"] == sum(sum(r["abs_samples_per_replica"]) for i, r in records.items() if 1 < i <= it)


def test_bitpipe_count_trigger_replays_exactly(runs):
    records, batches = _assert_replayed(runs, "count_bitpipe")
    _assert_streams(runs["count_bitpipe"], dp=2)
    for batch in batches:
        counts = [len(replica) for replica in batch]
        assert all(c % 2 == 0 and c >= 2 for c in counts), counts  # bitpipe: even, >= D
        assert sum(counts) == 8  # the count trigger shares --global-batch-size / --micro-batch-size
    assert any(batch[0] != batch[1] and len(batch[0]) > len(batch[1]) for batch in batches), "the faster replica should run more"


def test_unequal_fixed_counts_replay_exactly(runs):
    _, batches = _assert_replayed(runs, "fixed_uninterrupted")
    assert all([len(r) for r in batch] == [3, 2, 2, 1] for batch in batches)


def test_resume_with_a_gradient_in_flight_is_exact(runs):
    uninterrupted, resumed = _records(runs["fixed_uninterrupted"]), _records(runs["fixed_resumed"])
    assert sorted(resumed) == list(range(SAVED_AT + 1, 6))
    for it in resumed:
        for key in ("lm_loss", "grad_norm", "lr", "consumed_samples", "abs_samples_per_replica", "abs_applied_iteration"):
            assert resumed[it][key] == uninterrupted[it][key], (it, key)
    for a, b in zip(runs["fixed_uninterrupted"], runs["fixed_resumed"]):
        assert a["indices"][-len(b["indices"]) :] == b["indices"]
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name


def test_synchronous_run_refuses_an_abs_sgd_checkpoint(runs):
    for rank in runs["sync_refuses"]:
        assert "--data-parallel-mode abs-sgd" in rank["error"] and "in flight" in rank["error"]
