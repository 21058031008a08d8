"""Activation recompute (megatron-core's ``recompute_granularity`` / ``recompute_method`` /
``recompute_num_layers`` / ``recompute_modules``) with the plan executor equals single-process
training without recompute (CPU ranks, gloo).

For every case: the loss of every micro-batch, every gradient, the grad norm and every weight
after each of STEPS Adam steps equal the single-process reference (fp32, rtol 1e-5), the
replicas stay bit-identical, evaluation losses equal: BitPipe plain and split (full recompute,
uniform and block, and selective recompute of the core attention), TP 2 with
sequence parallelism, and Optimus 2D.

Split backward: megatron's checkpoint recomputes a forward inside the backward of ``I``; the
linears of that recomputed forward defer as the ``F``'s would (``delay_wgrad_compute`` is read
at forward time, the recompute records autograd). Proven here: checkpoints are recomputed, every
linear a recomputation runs defers exactly when the backward is split (full recompute runs
linears in every recomputation; selective recompute of the core attention none), and every
``W`` runs as many queued weight gradients as without recompute (none is computed early in
``I``), with the same gradients at the end.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

import pytest

from ..equivalence_support import Case, assert_equals_reference, pipeline, run_references  # noqa: F401 - run_references: conftest

pytestmark = pytest.mark.timeout(900)


@dataclasses.dataclass(frozen=True)
class RecomputeCase(Case):
    """``recompute``: TransformerConfig fields; ``plain``: the name of the same case without
    recompute, whose deferred weight-gradient counts the split case must repeat."""

    recompute: Tuple[Tuple[str, object], ...] = ()
    plain: str = ""

    def config_overrides(self) -> dict:
        return dict(self.recompute)


def full(method: str, layers: int):
    return (("recompute_granularity", "full"), ("recompute_method", method), ("recompute_num_layers", layers))


def selective(*modules: str):
    return (("recompute_granularity", "selective"), ("recompute_modules", list(modules)))


# 8 layers: a BitPipe chunk holds 2 at pipeline size 2
CASES_2 = [
    RecomputeCase("bitpipe_pp2_n2_full_uniform1", "bitpipe", pp=2, n=2, recompute=full("uniform", 1)),
    RecomputeCase("split_pp2_n4", "bitpipe", pp=2, n=4, split_backward=True),
    RecomputeCase("split_pp2_n4_full_block1", "bitpipe", pp=2, n=4, split_backward=True, recompute=full("block", 1), plain="split_pp2_n4"),
    RecomputeCase("split_pp2_n4_full_uniform2", "bitpipe", pp=2, n=4, split_backward=True, recompute=full("uniform", 2), plain="split_pp2_n4"),
    RecomputeCase(
        "split_pp2_n4_selective", "bitpipe", pp=2, n=4, split_backward=True,
        recompute=selective("core_attn"), plain="split_pp2_n4",
    ),
]  # fmt: skip
CASES_4 = [
    RecomputeCase("split_tp2_sp_pp2_n4", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True, split_backward=True),
    RecomputeCase(
        "split_tp2_sp_pp2_n4_full_uniform1", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True, split_backward=True,
        recompute=full("uniform", 1), plain="split_tp2_sp_pp2_n4",
    ),
    RecomputeCase(
        "optimus2d_q2_n2_full_uniform2", "1f1b", pp=1, n=2, tp=4, tensor_parallel_mode="optimus2d", recompute=full("uniform", 2),
    ),
    RecomputeCase(
        "optimus2d_q2_n2_selective", "1f1b", pp=1, n=2, tp=4, tensor_parallel_mode="optimus2d",
        recompute=selective("core_attn"),
    ),
]  # fmt: skip
CASES = CASES_2 + CASES_4
LAUNCH_TIMEOUT = 800


def run_cases(cases: List[RecomputeCase]) -> dict:
    """Each case's :func:`pipeline` record plus ``deferred_per_W`` (queued entries each ``W``
    ran) and ``recomputed_linears`` (per checkpoint recomputation: how many deferrable linear
    calls it ran, and how many of them deferred)."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution import weight_grad
    from megatron_bitpipe.execution.weight_grad import ChunkWeightGrad, queued_weight_work

    enable_cpu_megatron()
    deferred, recomputed, calls, deferring_calls = [], [], [], []
    chunk_backward_dw, checkpoint_backward = ChunkWeightGrad.backward_dw, CheckpointFunction.backward
    linear_call, deferred_apply = weight_grad._DeferrableForwardImpl.__call__, weight_grad._DeferredWeightGradLinear.apply

    def counted_backward_dw(rollup):
        before = sum(queued_weight_work(module) or 0 for _, module in rollup.modules)
        chunk_backward_dw(rollup)
        deferred.append(before - sum(queued_weight_work(module) or 0 for _, module in rollup.modules))

    def counted_call(impl, *args, **kwargs):
        calls.append(1)
        return linear_call(impl, *args, **kwargs)

    def counted_apply(*args):
        deferring_calls.append(1)
        return deferred_apply(*args)

    def observed_backward(ctx, *grads):
        before = len(calls), len(deferring_calls)
        result = checkpoint_backward(ctx, *grads)
        recomputed.append((len(calls) - before[0], len(deferring_calls) - before[1]))
        return result

    ChunkWeightGrad.backward_dw, weight_grad._DeferrableForwardImpl.__call__ = counted_backward_dw, counted_call
    weight_grad._DeferredWeightGradLinear.apply = counted_apply
    CheckpointFunction.backward = staticmethod(observed_backward)
    out = {}
    try:
        for case in cases:
            deferred.clear()
            recomputed.clear()
            out[case.name] = pipeline(case)
            out[case.name]["deferred_per_W"] = list(deferred)
            out[case.name]["recomputed_linears"] = list(recomputed)
    finally:
        ChunkWeightGrad.backward_dw, weight_grad._DeferrableForwardImpl.__call__ = chunk_backward_dw, linear_call
        weight_grad._DeferredWeightGradLinear.apply = deferred_apply
        CheckpointFunction.backward = staticmethod(checkpoint_backward)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recompute_equals_single_process_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])


@pytest.mark.multirank
@pytest.mark.parametrize("case", [c for c in CASES if c.recompute], ids=lambda c: c.name)
def test_recomputed_forwards_of_a_split_backward_defer_their_weight_gradients(case, launched):
    """Checkpoints are recomputed in backward, every linear they run deferring exactly when the
    backward is split, and each ``W`` then runs as many queued weight gradients as without
    recompute."""
    for rank in launched.ranks(case.world_size):
        record = rank[case.name]
        linears = record["recomputed_linears"]
        assert linears, "no checkpoint was recomputed"
        assert all(deferring == (total if case.split_backward else 0) for total, deferring in linears), linears
        full = dict(case.recompute).get("recompute_granularity") == "full"
        assert all(total > 0 for total, _ in linears) == (full and case.split_backward), linears
        if case.plain:
            assert record["deferred_per_W"] == rank[case.plain]["deferred_per_W"]
            assert sum(record["deferred_per_W"]) > 0
