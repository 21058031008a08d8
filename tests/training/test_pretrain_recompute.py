"""Activation recompute through scripts/pretrain_gpt.py's flags on CPU ranks (gloo).

The tiny GPT trained with Megatron's recompute flags — full recompute (uniform and block) and
selective recompute (``--recompute-activations``, ``--recompute-modules``) — under
megatron-core's 1F1B and interleaved schedules and BitPipe with the split backward logs the
same per-iteration losses, grad norms, learning rates and validation losses as a single
process without recompute (rtol 1e-5, from ``--log-json``). Gradients and weights of the same
combinations are compared tensor by tensor in ``test_recompute_equivalence.py``.
"""

from __future__ import annotations

from typing import Dict

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import CURVE_KEYS, assert_same_records, records, train_in_process

ITERS = 3
MODEL = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--train-iters", str(ITERS),
    "--adam-eps", "1e-4", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
    "--disable-bias-linear",  # megatron-core's MLP recompute needs linears without bias
]  # fmt: skip
PP2 = ["--pipeline-model-parallel-size", "2"]
# name -> (ranks, flags); chunks hold 8 / (2 x 2) = 2 layers under interleaving and BitPipe
RUNS: Dict[str, tuple] = {
    "single": (1, []),
    "interleaved_full_uniform": (2, [*PP2, "--virtual-pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                                     "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "1f1b_selective": (2, [*PP2, "--recompute-activations", "--recompute-modules", "core_attn", "mlp"]),
    "bitpipe_split_full_block": (2, [*PP2, "--pipeline-schedule", "bitpipe", "--split-backward", "--recompute-granularity",
                                     "full", "--recompute-method", "block", "--recompute-num-layers", "1"]),
}  # fmt: skip

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Dict[str, Dict[int, dict]]:
    out = tmp_path_factory.mktemp("recompute")
    result = {}
    for name, (ranks, flags) in RUNS.items():
        log = out / f"{name}.jsonl"
        launch(train_in_process, ranks, "gpt", [*MODEL, *flags, "--log-json", str(log)], timeout=400)
        result[name] = records(log)
    return result


@pytest.mark.parametrize("name", [n for n in RUNS if n != "single"])
def test_recompute_trains_like_a_single_process(logs, name):
    single = logs["single"]
    assert sorted(single) == list(range(1, ITERS + 1))
    assert "validation_lm_loss" in single[2]
    assert_same_records(logs[name], single, range(1, ITERS + 1), CURVE_KEYS)
