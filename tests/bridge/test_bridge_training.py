"""Plan schedules in a Megatron-Bridge recipe, trained through Bridge's own ``pretrain`` on CPU
ranks (strict p2p: NCCL's point-to-point rules on gloo), equal one-process Bridge: every
iteration's loss and grad norm, the validation and the test loss (fp32).

Three launches hold every case (one Bridge import per rank each): one process (the references),
2 ranks (BitPipe, BitPipe with split backwards, ZB-V, DualPipeV at pipeline 2; BitPipe on
Bridge's model-config route, a ``BitPipeGPTModelConfig``; BitPipe in Bridge's ``bf16_mixed``), 4 ranks (BitPipe at pipeline 4; pipeline 2 x data parallel 2 with the
distributed optimizer, without and with its parameter all-gather overlapped; tensor parallel 2 x
pipeline 2; a mixture-of-experts model at pipeline 2 x data parallel 2 with its experts over the
data-parallel ranks, expert parallel 2).
"""

from __future__ import annotations

from typing import Dict

import pytest

from megatron_bitpipe.cpu.launcher import launch

from .bridge_support import train_all

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]

TIMEOUT = 1500

# Every layer an MoE layer of 4 routed experts, top-2, dropless, no linear biases (megatron's
# local experts), with a load-balancing loss and a z-loss whose coefficients are large enough
# that a mis-scaled auxiliary gradient shows in the grad norm; tokens exchanged by all-to-all.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1,
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, add_bias_linear=False)  # fmt: skip

# name: (reference, case); the reference names an entry of REFERENCES
REFERENCES = {
    "layers4": dict(schedule="default", pp=1),
    "layers8": dict(schedule="default", pp=1, num_layers=8),
    "moe": dict(schedule="default", pp=1, **MOE),
}
TWO_RANKS = {
    "bitpipe-pp2": ("layers4", dict(schedule="bitpipe", pp=2)),
    "bitpipe-split-pp2": ("layers4", dict(schedule="bitpipe", pp=2, split_backward=True)),
    "zbv-pp2": ("layers4", dict(schedule="zbv", pp=2)),
    "dualpipev-pp2": ("layers4", dict(schedule="dualpipev", pp=2)),
    "bitpipe-pp2-model-config": ("layers4", dict(schedule="bitpipe", pp=2, builder=True)),
}
FOUR_RANKS = {
    "bitpipe-pp4": ("layers8", dict(schedule="bitpipe", pp=4, num_layers=8)),
    "bitpipe-pp2-dp2-distopt": ("layers4", dict(schedule="bitpipe", pp=2, distributed_optimizer=True)),
    "bitpipe-pp2-dp2-distopt-overlap": ("layers4", dict(schedule="bitpipe", pp=2, distributed_optimizer=True, overlap_param_gather=True)),
    "bitpipe-tp2-pp2": ("layers4", dict(schedule="bitpipe", pp=2, tp=2)),
    "bitpipe-pp2-dp2-ep2-moe": ("moe", dict(schedule="bitpipe", pp=2, expert_model_parallel_size=2, **MOE)),
}
BF16 = dict(schedule="bitpipe", pp=2, mixed_precision="bf16_mixed")


@pytest.fixture(scope="module")
def references() -> Dict[str, Dict]:
    records = launch(train_all, 1, list(REFERENCES.values()), timeout=TIMEOUT)[0]
    return dict(zip(REFERENCES, records))


@pytest.fixture(scope="module")
def two_ranks() -> Dict[str, list]:
    ranks = launch(train_all, 2, [case for _, case in TWO_RANKS.values()] + [BF16], timeout=TIMEOUT)
    return {name: [rank[i] for rank in ranks] for i, name in enumerate([*TWO_RANKS, "bf16"])}


@pytest.fixture(scope="module")
def four_ranks() -> Dict[str, list]:
    ranks = launch(train_all, 4, [case for _, case in FOUR_RANKS.values()], timeout=TIMEOUT)
    return {name: [rank[i] for rank in ranks] for i, name in enumerate(FOUR_RANKS)}


def _assert_equal(record, reference, *, validation: bool):
    assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    if validation:
        assert record["valid"] == pytest.approx(reference["valid"], rel=1e-5)
    assert record["test"] == pytest.approx(reference["test"], rel=1e-5)
    assert len(record["loss"]) == 3 and record["valid"] and record["test"]


def _assert_run(ranks, reference):
    # Bridge's validation loader of a GPT dataset is "cyclic" (megatron's random sampler), which
    # draws each data-parallel rank's samples from its own bucket of the set: with data
    # parallelism the validation batches are other samples than one process's, by Bridge's design
    # (its training and test loaders, "single", are not). The validation loss is compared where
    # the layout has no data parallelism.
    data_parallel = len(ranks) // (ranks[-1]["pp"] * ranks[-1]["tp"]) > 1
    _assert_equal(ranks[-1], reference, validation=not data_parallel)  # Bridge logs the losses of the last pipeline rank
    assert all(rank["grad_norm"] == ranks[-1]["grad_norm"] for rank in ranks)
    assert all(rank["hooks"] for rank in ranks), "grad_scale_func, finalize_model_grads_func or timers missed a chunk"


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_equal_one_process(references, two_ranks, name):
    _assert_run(two_ranks[name], references[TWO_RANKS[name][0]])


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_ranks_equal_one_process(references, four_ranks, name):
    _assert_run(four_ranks[name], references[FOUR_RANKS[name][0]])
    distributed = "distopt" in name
    assert all((rank["optimizer"] == "ChunkDistributedOptimizer") == distributed for rank in four_ranks[name])


def test_bf16_chunks_get_bridges_loss_scaling_hooks(references, two_ranks):
    """Bridge's bf16_mixed: every chunk is wrapped for bf16 and its model config holds
    grad_scale_func, finalize_model_grads_func and timers; the curve is bf16's, near fp32's
    (a sanity bound, not an equivalence: bf16 rounds differently in another layout)."""
    ranks = two_ranks["bf16"]
    assert all(rank["hooks"] for rank in ranks), "grad_scale_func, finalize_model_grads_func or timers missed a chunk"
    assert all(rank["chunks"] == ["ChunkFloat16Module"] for rank in ranks)
    assert ranks[-1]["loss"] == pytest.approx(references["layers4"]["loss"], rel=2e-2)
    assert ranks[-1]["loss"] != pytest.approx(references["layers4"]["loss"], rel=1e-6), "bf16 ran in fp32"
