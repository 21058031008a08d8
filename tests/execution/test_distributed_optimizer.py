"""megatron-core's distributed optimizer under the BitPipe runtime equals single-process training.

Each chunk's optimizer state is sharded over its grad-sync group (the stage's two replicas x
data parallel); gradients are reduce-scattered and parameters all-gathered over it. For
BitPipe and BitPipe with split backward, each at pipeline 2 x data parallel 2, pipeline 4
and tensor 2 x pipeline 2 (4 ranks, one launch): every micro-batch's loss, the grad norm and
every weight after each of STEPS (3) optimizer steps equal single-process training of the
same model with megatron's non-distributed Adam (fp32, rtol 1e-5), the replicas stay
bit-identical, and the evaluation losses agree. The same with Optimus 2D (q = 2, tensor 4 x
pipeline 2, 8 ranks). One launch per world size (``launched``, ``tests/conftest.py``). In bf16 (fp32 main weights in the distributed optimizer's shards) the
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
