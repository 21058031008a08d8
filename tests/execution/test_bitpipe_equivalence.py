"""The plan executor on megatron-core equals single-process training (CPU ranks, gloo).

For every case: the loss of every micro-batch, every gradient, the grad norm (which counts
each logical parameter once even though BitPipe holds two replicas) and every weight after
each of STEPS optimizer steps equal single-process training of the same model from the
same seed on the same global batches (fp32, rtol 1e-5); the replicas stay bit-identical;
the forward-only (evaluation) losses are equal too. Tied embeddings are checked through
the shared weight's gradient and value. A gated MLP (``--swiglu``) under TP 2 with the split
backward: its ``[gate; up]`` linear_fc1 is split with stride 2, each rank holding its block of
both halves.

One launch per world size serves all of its cases (``launched``, ``tests/conftest.py``).
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch

from ..equivalence_support import ATOL, RTOL, STEPS, Case, assert_equals_reference, pipeline, run_references  # noqa: F401 - run_references: conftest

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]

CASES_2 = [
    Case("bitpipe_pp2_n2", "bitpipe", pp=2, n=2),
    Case("bitpipe_pp2_n6_overlap_p2p", "bitpipe", pp=2, n=6, overlap_p2p_comm=True, deallocate_pipeline_outputs=True),
]
CASES_4 = [
    Case("bitpipe_pp4_n4_clip", "bitpipe", pp=4, n=4, clip_grad=0.5),
    Case("bitpipe_pp4_n8", "bitpipe", pp=4, n=8),
    Case("bitpipe_pp4_n6_untied_blocking_sync", "bitpipe", pp=4, n=6, tied=False, overlap_grad_reduce=False),
    Case("bitpipe_tp2_pp2_n4", "bitpipe", pp=2, n=4, tp=2, clip_grad=0.5),
    Case("bitpipe_tp2_sp_pp2_n4", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True),
    Case("bitpipe_tp2_pp2_n4_swiglu_split", "bitpipe", pp=2, n=4, tp=2, swiglu=True, split_backward=True),
    Case("bitpipe_dp2_pp2_n2", "bitpipe", pp=2, n=2, dp=2),
    Case("chimera_pp4_n4_untied", "chimera", pp=4, n=4, tied=False),
    Case("1f1b_pp4_n4_untied", "1f1b", pp=4, n=4, tied=False),
]
# Optimus 2D (q=2, tp group of 4) inside every BitPipe stage.
CASES_8 = [
    Case("bitpipe_optimus2d_q2_pp2_n4_clip", "bitpipe", pp=2, n=4, tp=4, clip_grad=0.5, tensor_parallel_mode="optimus2d"),
    Case("bitpipe_optimus2d_q2_pp2_n2_untied", "bitpipe", pp=2, n=2, tp=4, tied=False, tensor_parallel_mode="optimus2d"),
]
CASES = CASES_2 + CASES_4 + CASES_8
INSTRUMENTED = "bitpipe_pp4_n8"


def run_cases(cases: List[Case]) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    out = {}
    for case in cases:
        events: list = []
        out[case.name] = pipeline(case, events if case.name == INSTRUMENTED else None)
        out[case.name]["events"] = events
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_equals_single_process_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])


def test_tied_embedding_is_one_weight(references, launched):
    """The tied weight's gradient (embedding + head) equals the serial one: counted once."""
    case = next(c for c in CASES_4 if c.name == "bitpipe_pp4_n4_clip")
    ref = references[case.reference_key]
    assert "output_layer.weight" not in ref["steps"][0]["grads"]
    holders = [r for r in launched[case] if "embedding.word_embeddings.weight" in r["steps"][0]["grads"]]
    assert sorted(r["pp_rank"] for r in holders) == [0, 3]  # each edge rank holds one replica's
    for record in holders:
        assert "output_layer.weight" not in record["steps"][0]["grads"]
        for step in range(STEPS):
            for key in ("grads", "weights"):
                torch.testing.assert_close(
                    record["steps"][step][key]["embedding.word_embeddings.weight"],
                    ref["steps"][step][key]["embedding.word_embeddings.weight"],
                    rtol=RTOL,
                    atol=ATOL,
                )


def test_grad_norm_counts_replicas_once(references, launched):
    case = next(c for c in CASES_4 if c.name == "bitpipe_pp4_n8")
    ref = references[case.reference_key]
    for record in launched[case]:
        for step in range(STEPS):
            assert record["steps"][step]["grad_norm"] == pytest.approx(ref["steps"][step]["grad_norm"], rel=RTOL)
            assert record["steps"][step]["grad_norm"] != pytest.approx(2**0.5 * ref["steps"][step]["grad_norm"], rel=1e-3)


def test_eager_sync_overlaps_remaining_backwards(launched):
    """Instrumented, not timed: a chunk's all-reduce is issued (and still outstanding) while
    backwards of another chunk of the same rank are yet to run."""
    case = next(c for c in CASES_4 if c.name == INSTRUMENTED)
    for record in launched[case]:
        events = record["events"]
        syncs = [i for i, e in enumerate(events) if e[0] == "S"]
        assert len(syncs) == 4
        first_sync = syncs[0]
        _, chunk, outstanding = events[first_sync]
        assert outstanding, "start_grad_sync must leave an asynchronous all-reduce in flight"
        later_backwards = [e for e in events[first_sync + 1 :] if e[0] == "B" and e[1] != chunk]
        assert later_backwards, f"rank {record['pp_rank']}: no backward of another chunk after the first sync"


def _bf16(case):
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    from ..equivalence_support import bf16_losses

    enable_cpu_megatron()
    return bf16_losses(case)


def test_bf16_losses_are_fp32_on_every_loss_rank(references):
    """bf16 smoke test: the loss chunks on both edge ranks report fp32 losses close to fp32 training."""
    ranks = launch(_bf16, 2, Case("bitpipe_pp2_n2_bf16", "bitpipe", pp=2, n=2), timeout=300)
    ref = references[(True, 2, 0.0)]
    assert [r["dtypes"] for r in ranks] == [{"torch.float32"}] * 2
    for step in range(2):
        losses = ranks[0]["losses"][step] + ranks[1]["losses"][step]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["steps"][step]["losses"]), rtol=3e-2, atol=0)
