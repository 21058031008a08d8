"""megatron-core's distributed optimizer under the BitPipe runtime equals single-process training.

Each chunk's optimizer state is sharded over its grad-sync group (the stage's two replicas x
data parallel); gradients are reduce-scattered and parameters all-gathered over it. For
BitPipe and BitPipe with split backward, each at pipeline 2 x data parallel 2, pipeline 4
and tensor 2 x pipeline 2 (4 ranks, one launch): every micro-batch's loss, the grad norm and
every weight after each of STEPS (3) optimizer steps equal single-process training of the
same model with megatron's non-distributed Adam (fp32, rtol 1e-5), the replicas stay
bit-identical, and the evaluation losses agree.
"""

from __future__ import annotations

from typing import List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from runtime_support import Case, assert_equals_reference, launch_references, pipeline

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]

CASES = [
    Case(f"bitpipe{'_split' if split else ''}_{name}_distopt", "bitpipe", distributed_optimizer=True, split_backward=split, clip_grad=0.5, **layout)
    for split in (False, True)
    for name, layout in (
        ("pp2_dp2_n2", dict(pp=2, dp=2, n=2)),
        ("pp4_n4", dict(pp=4, n=4)),
        ("tp2_pp2_n4", dict(pp=2, tp=2, n=4)),
    )
]


def _run_cases(cases: List[Case]) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {case.name: pipeline(case) for case in cases}


@pytest.fixture(scope="module")
def references() -> dict:
    return launch_references(CASES)


@pytest.fixture(scope="module")
def four_ranks() -> List[dict]:
    return launch(_run_cases, 4, CASES, timeout=800)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_distributed_optimizer_equals_single_process_training(case, references, four_ranks):
    records = [ranks[case.name] for ranks in four_ranks]
    assert {name for r in records for name in r["optimizers"]} == {"DistributedOptimizer"}
    assert_equals_reference(case, records, references[case.reference_key])
