"""The zero-bubble and DualPipe peers run through the plan executor on megatron-core GPT chunks
and equal single-process training (CPU ranks, gloo).

ZB-V and DualPipeV (one replica on a V: two chunks per rank, embedding and LM head on
rank 0), ZB-H1 (one chunk per rank) and DualPipe (two replicas on Chimera's placement, its
forward/backward pairs run one after the other) with their own split backwards: the loss
of every micro-batch, every gradient, the grad norm and the weights after each optimizer
step equal single-process training from the same seed on the same global batches (fp32),
and evaluation too. ZB-V is also run ordered for a message time (its latency-aware plan).
"""

from __future__ import annotations

from typing import List

import pytest

from megatron_bitpipe.testing.launcher import launch

from runtime_support import Case, assert_equals_reference, launch_references, pipeline

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
]


def _run_cases(cases: List[Case]) -> dict:
    from megatron_bitpipe.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {case.name: pipeline(case) for case in cases}


@pytest.fixture(scope="module")
def references() -> dict:
    return launch_references(CASES_2 + CASES_4)


@pytest.fixture(scope="module")
def two_ranks() -> List[dict]:
    return launch(_run_cases, 2, CASES_2, timeout=400)


@pytest.fixture(scope="module")
def four_ranks() -> List[dict]:
    return launch(_run_cases, 4, CASES_4, timeout=800)


@pytest.mark.parametrize("case", CASES_2 + CASES_4, ids=lambda c: c.name)
def test_peer_equals_single_process_training(case, references, two_ranks, four_ranks):
    records = [r[case.name] for r in (two_ranks if case in CASES_2 else four_ranks)]
    assert_equals_reference(case, records, references[case.reference_key])


def test_cases_split_and_order_for_the_message_time():
    """Every case's plan splits backwards; the message-time case gets a different order."""
    from megatron_bitpipe import schedules
    from megatron_bitpipe.schedules.actions import ActionType

    for case in CASES_2 + CASES_4:
        plan = schedules.generate(case.schedule, case.pp, case.n, costs=schedules.CostModel(t_p2p=case.t_p2p))
        assert any(a.type is ActionType.BACKWARD_WEIGHT for _, a in plan), case.name
    free = schedules.generate("zbv", 4, 4)
    timed = schedules.generate("zbv", 4, 4, costs=schedules.CostModel(t_p2p=0.2))
    assert free.actions != timed.actions
