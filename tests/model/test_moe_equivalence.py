"""Dropless mixture-of-experts GPT training through the plan executor at expert parallelism 2
equals single-process training (CPU ranks, gloo, strict p2p).

The tiny GPT with every layer an MoE layer (4 routed experts, top-2, a load-balancing and a
z-loss), on PP 2 x DP 2 with the experts split over the two data-parallel ranks of each
pipeline rank (EP 2): BitPipe with and without the split backward, ZB-V, DualPipeV and 1F1B,
each with megatron's allgather and alltoall token dispatchers. Per step: the loss of every
micro-batch, every gradient (each expert's, gathered from the rank holding it, by its global
index), the grad norm and every weight equal one process training the same model from the
same seed on the same global batches (fp32, rtol 1e-5); the weight replicas (BitPipe's
mirror pipelines, the data-parallel copies; each expert's copies in its expert-data-parallel
group) stay bit-identical; evaluation losses agree too. With megatron's distributed optimizer
(dense and expert state sharded apart), also with its parameter all-gather overlapped with the
next forward. The auxiliary losses' gradients are
scaled per micro-batch as megatron's schedules scale them (one process: one over the global
batch's micro-batches). One launch of 4 ranks serves every case (``launched``,
``tests/conftest.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest

from ..equivalence_support import Case, assert_equals_reference, model_config, pipeline, reference_training

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]

NUM_EXPERTS, TOPK = 4, 2
AUX_LOSS_COEFF, Z_LOSS_COEFF = 1e-2, 1e-3


def moe_fields(dispatcher: str, ep: int = 1) -> dict:
    """The tiny GPT's MoE config fields (every layer an MoE layer, no biases: megatron's MoE)."""
    return dict(
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=AUX_LOSS_COEFF,
        moe_z_loss_coeff=Z_LOSS_COEFF,
        expert_model_parallel_size=ep,
        add_bias_linear=False,
    )


@dataclass(frozen=True)
class MoECase(Case):
    """A mixture-of-experts case: ``dispatcher`` is megatron's token dispatcher."""

    dispatcher: str = "alltoall"

    @property
    def reference_key(self):
        return ("moe", self.tied, self.global_microbatches, self.clip_grad)

    def config_overrides(self) -> dict:
        return dict(super().config_overrides(), **moe_fields(self.dispatcher, self.ep))


def _cases() -> List[MoECase]:
    cases = []
    for dispatcher in ("allgather", "alltoall"):
        for schedule, split in (("bitpipe", False), ("bitpipe", True), ("zbv", False), ("dualpipev", False), ("1f1b", False)):
            name = f"{schedule}{'_split' if split else ''}_{dispatcher}_pp2_dp2_ep2"
            cases.append(MoECase(name, schedule, pp=2, n=4 if schedule == "dualpipev" else 2, dp=2, ep=2, split_backward=split, dispatcher=dispatcher,
                                 tied=schedule != "1f1b"))
    # megatron's distributed optimizer, one per chunk: dense state over the stage's grad-sync
    # group, expert state over its expert grad-sync group
    cases.append(MoECase("bitpipe_split_alltoall_pp2_dp2_ep2_distopt", "bitpipe", pp=2, n=2, dp=2, ep=2, split_backward=True,
                         distributed_optimizer=True, clip_grad=0.5))
    cases.append(MoECase("dualpipev_allgather_pp2_dp2_ep2_distopt", "dualpipev", pp=2, n=4, dp=2, ep=2, dispatcher="allgather",
                         distributed_optimizer=True))
    # its parameter all-gather overlapped with the next forward: a chunk's dense and expert
    # optimizers start its gather once (both kinds of bucket groups)
    cases.append(MoECase("bitpipe_alltoall_pp2_dp2_ep2_distopt_overlap_param_gather", "bitpipe", pp=2, n=2, dp=2, ep=2,
                         distributed_optimizer=True, overlap_param_gather=True, clip_grad=0.5))
    return cases


CASES = _cases()


def run_cases(cases: List[MoECase]) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {case.name: pipeline(case) for case in cases}


def run_references(keys) -> dict:
    """One process training the MoE GPT (EP 1, allgather dispatcher) for every reference key."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    out = {}
    for key in keys:
        _, tied, global_microbatches, clip_grad = key
        out[key] = reference_training(tied, global_microbatches, clip_grad, model_config(**moe_fields("allgather")))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_moe_equals_single_process_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])


def test_experts_are_split_over_the_expert_parallel_ranks(launched):
    """Each rank holds two of the four experts of its layers; the two EP ranks of a pipeline rank hold all four."""
    case = CASES[0]
    for record in launched[case]:
        experts = {name.split("local_experts.")[1].split(".")[0] for name in record["initial"] if "local_experts." in name}
        assert len(experts) == NUM_EXPERTS // case.ep
