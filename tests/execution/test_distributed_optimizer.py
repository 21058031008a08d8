"""megatron-core's distributed optimizer under the BitPipe runtime equals single-process training.

Each chunk's optimizer state is sharded over its grad-sync group (the stage's two replicas x
data parallel); gradients are reduce-scattered and parameters all-gathered over it. For
BitPipe and BitPipe with split backward, each at pipeline 2 x data parallel 2, pipeline 4
and tensor 2 x pipeline 2 (4 ranks, one launch): every micro-batch's loss, the grad norm and
every weight after each of STEPS (3) optimizer steps equal single-process training of the
same model with megatron's non-distributed Adam (fp32, rtol 1e-5), the replicas stay
bit-identical, and the evaluation losses agree. The same with Optimus 2D (q = 2, tensor 4 x
pipeline 2, 8 ranks). ZB-V at pipeline 2 x data parallel 2 the same. With the parameter
all-gather overlapped with the next forward (``overlap_param_gather``; BitPipe and ZB-V at
pipeline 2 x data parallel 2): equal to single-process training as above, and bit for bit
equal to the same run with the gather after the step: the gathers are in flight after
every step and every module's parameters are gathered before its forward uses them. One launch per world size (``launched``, ``tests/conftest.py``). In bf16 (fp32 main weights in the distributed optimizer's shards) the
losses equal those of bf16 training with the non-distributed optimizer and the replicas stay
bit-identical.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch

from ..equivalence_support import Case, assert_equals_reference, pipeline, run_references  # noqa: F401 - run_references: conftest

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank, pytest.mark.strict_p2p]

CASES = [
    Case(f"bitpipe{'_split' if split else ''}_{name}_distopt", "bitpipe", distributed_optimizer=True, split_backward=split, clip_grad=0.5, **layout)
    for split in (False, True)
    for name, layout in (
        ("pp2_dp2_n2", dict(pp=2, dp=2, n=2)),
        ("pp4_n4", dict(pp=4, n=4)),
        ("tp2_pp2_n4", dict(pp=2, tp=2, n=4)),
    )
] + [
    Case(
        "bitpipe_optimus2d_q2_pp2_n4_distopt", "bitpipe", pp=2, n=4, tp=4, clip_grad=0.5, tensor_parallel_mode="optimus2d",
        distributed_optimizer=True,
    )
] + [
    Case(f"zbv_pp2_dp2_n2_distopt{suffix}", "zbv", pp=2, dp=2, n=2, clip_grad=0.5, distributed_optimizer=True, overlap_param_gather=overlap)
    for suffix, overlap in (("", False), ("_overlap_param_gather", True))
] + [
    Case(
        "bitpipe_pp2_dp2_n2_distopt_overlap_param_gather", "bitpipe", pp=2, dp=2, n=2, clip_grad=0.5, distributed_optimizer=True,
        overlap_param_gather=True,
    )
]
#: each overlapped case and the same case without the overlap
OVERLAPPED = [
    (case, next(c for c in CASES if c.name == case.name.replace("_overlap_param_gather", "")))
    for case in CASES
    if case.overlap_param_gather
]
LAUNCH_TIMEOUT = 800


def run_cases(cases: List[Case]) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {case.name: pipeline(case) for case in cases}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_distributed_optimizer_equals_single_process_training(case, references, launched):
    records = launched[case]
    assert {name for r in records for name in r["optimizers"]} == {"DistributedOptimizer"}
    assert_equals_reference(case, records, references[case.reference_key])


@pytest.mark.parametrize("case, plain", OVERLAPPED, ids=lambda c: c.name)
def test_overlapped_param_gather_equals_the_blocking_one(case, plain, launched):
    """Every chunk's gather is still in flight after each step and is waited for by the next
    forward before any module uses a parameter; losses, local gradient shards, grad norms and
    weights equal the run whose steps gather at once, bit for bit."""
    from megatron_bitpipe.schedules import ScheduleChoice

    chunks = ScheduleChoice(case.schedule).placement(case.pp).chunks_per_rank
    overlapped, blocking = launched[case], launched[plain]
    for rank, (mine, theirs) in enumerate(zip(overlapped, blocking)):
        assert [entry["gathers_in_flight"] for entry in theirs["steps"]] == [0] * len(theirs["steps"])
        # one bucket group per chunk, each gathered asynchronously after its chunk's step
        assert [entry["gathers_in_flight"] for entry in mine["steps"]] == [chunks] * len(mine["steps"]), f"rank {rank}"
        assert mine["gathers_in_flight_after_eval"] == 0, f"rank {rank}: the evaluation's forwards waited for every gather"
        assert mine["parameter_uses"]["checked"] > 0 and mine["parameter_uses"]["unwaited"] == 0, f"rank {rank}"
        assert mine["replica_diff"] == theirs["replica_diff"]
        assert mine["eval"] == theirs["eval"]
        for step, (a, b) in enumerate(zip(mine["steps"], theirs["steps"])):
            assert a["losses"] == b["losses"] and a["grad_norm"] == b["grad_norm"], f"rank {rank} step {step}"
            for what in ("grads", "weights"):
                assert a[what].keys() == b[what].keys()
                for name in a[what]:
                    assert torch.equal(a[what][name], b[what][name]), f"rank {rank} step {step} {what} {name}"


def _bf16(case):
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    from ..equivalence_support import bf16_losses

    enable_cpu_megatron()
    return bf16_losses(case)


def test_bf16_distributed_optimizer_equals_the_non_distributed_one():
    runs = {
        distributed: launch(_bf16, 2, Case("bitpipe_pp2_n2_bf16", "bitpipe", pp=2, n=2, distributed_optimizer=distributed), timeout=300)
        for distributed in (False, True)
    }
    for rank, (plain, sharded) in enumerate(zip(runs[False], runs[True])):
        assert sharded["replica_diff"] == 0.0
        torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(plain["losses"]), rtol=1e-3, atol=0, msg=f"rank {rank}")
