"""The zero-bubble and DualPipe peers run through the plan executor on megatron-core GPT chunks
and equal single-process training (CPU ranks, gloo).

ZB-V and DualPipeV (one replica on a V: two chunks per rank, embedding and LM head on
rank 0), ZB-H1 (one chunk per rank) and DualPipe (two replicas on Chimera's placement), whose
overlapped forward/backward pairs run as ``OVERLAP_F_B`` actions, with their own split backwards: the loss
of every micro-batch, every gradient, the grad norm and the weights after each optimizer
step equal single-process training from the same seed on the same global batches (fp32),
and evaluation too. ZB-V is also run ordered for a message time (its latency-aware plan);
the peers also run with TP 2 (sequence parallel, a gated MLP) and DP 2 with megatron's
distributed optimizer.
One launch per world size serves all of its cases (``launched``, ``tests/conftest.py``).
"""

from __future__ import annotations

from typing import List

import pytest

from ..equivalence_support import Case, assert_equals_reference, pipeline, run_references  # noqa: F401 - run_references: conftest

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]

CASES_2 = [
    Case("zbv_pp2_n4", "zbv", pp=2, n=4),
    Case("dualpipev_pp2_n4_overlap_p2p", "dualpipev", pp=2, n=4, overlap_p2p_comm=True,
         deallocate_pipeline_outputs=True),
]
CASES_4 = [
    Case("zbv_pp4_n4_p2p", "zbv", pp=4, n=4, t_p2p=0.2),
    Case("zbv_pp4_n8_clip", "zbv", pp=4, n=8, clip_grad=0.5),
    Case("dualpipev_pp4_n8", "dualpipev", pp=4, n=8),
    Case("zb-h1_pp4_n4_untied", "zb-h1", pp=4, n=4, tied=False),
    Case("dualpipe_pp4_n8_untied", "dualpipe", pp=4, n=8, tied=False),
    Case("zbv_tp2_sp_pp2_n4", "zbv", pp=2, n=4, tp=2, sequence_parallel=True),
    Case("dualpipev_dp2_pp2_n4_distopt", "dualpipev", pp=2, n=4, dp=2, distributed_optimizer=True, clip_grad=0.5),
    Case("zb-h1_tp2_pp2_n4_swiglu", "zb-h1", pp=2, n=4, tp=2, swiglu=True),
    Case("dualpipe_dp2_pp2_n4_untied_distopt", "dualpipe", pp=2, n=4, dp=2, tied=False, distributed_optimizer=True),
]
CASES = CASES_2 + CASES_4


def run_cases(cases: List[Case]) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {case.name: pipeline(case) for case in cases}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_peer_equals_single_process_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])
