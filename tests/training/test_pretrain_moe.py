"""A mixture-of-experts GPT through scripts/pretrain_gpt.py's training loop on CPU ranks (gloo,
strict p2p): expert parallelism 2 inside PP 2 x DP 2 under BitPipe with the split backward,
ZB-V (with megatron's distributed optimizer), DualPipeV, ZB-H1, megatron's interleaved
schedule, and Chimera and DualPipe (two replicas whose pipelines end away from their start:
untied embeddings, against an untied single process), with the alltoall and allgather token
dispatchers, logs the single
process's per-iteration losses, grad norms, learning rates, validation losses and Megatron-LM's
auxiliary-loss fields (``load_balancing_loss``, ``z_loss``; rtol 1e-5, from ``--log-json``).
A run with ``--moe-expert-capacity-factor`` (tokens beyond an expert's capacity dropped) trains
too: its first iteration's losses equal the dropless run's only where nothing was dropped, so
it is checked for finite, falling losses rather than against one process (which drops other
tokens: capacity is counted per micro-batch of a rank).
"""

from __future__ import annotations

import math
from typing import Dict

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import CURVE_KEYS, JsonLogs, assert_same_records, tiny_gpt, train_in_process

ITERS = 3
MODEL = tiny_gpt(ITERS, num_layers=4)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
       "--disable-bias-linear"]  # fmt: skip
MOE_KEYS = (*CURVE_KEYS, "load_balancing_loss", "z_loss")
PP2_EP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
#: run -> flags of the 4-rank run besides the model
RUNS = {
    "bitpipe_split_alltoall": ["--pipeline-schedule", "bitpipe", "--split-backward", "--moe-token-dispatcher-type", "alltoall"],
    "zbv_allgather_distopt": ["--pipeline-schedule", "zbv", "--moe-token-dispatcher-type", "allgather", "--use-distributed-optimizer"],
    "dualpipev_alltoall": ["--pipeline-schedule", "dualpipev", "--moe-token-dispatcher-type", "alltoall"],
    "zb-h1_alltoall": ["--pipeline-schedule", "zb-h1", "--moe-token-dispatcher-type", "alltoall"],
    "interleaved_alltoall": ["--virtual-pipeline-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
}
UNTIED = ["--untie-embeddings-and-output-weights"]
#: runs of two replicas whose pipelines end away from their start, against the untied single process
UNTIED_RUNS = {
    "chimera_split_allgather": ["--pipeline-schedule", "chimera", "--split-backward", "--moe-token-dispatcher-type", "allgather"],
    "dualpipe_alltoall": ["--pipeline-schedule", "dualpipe", "--moe-token-dispatcher-type", "alltoall"],
}
CAPACITY = ["--pipeline-schedule", "bitpipe", "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.0"]

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank, pytest.mark.strict_p2p]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Dict[int, dict]]:
    """Every run once: name -> {iteration: JSON record}."""
    logs = JsonLogs(tmp_path_factory.mktemp("moe"))
    launch(train_in_process, 1, "gpt", [*MODEL, *MOE, *logs.flags("single")], timeout=300)
    launch(train_in_process, 1, "gpt", [*MODEL, *MOE, *UNTIED, *logs.flags("single_untied")], timeout=300)
    for name, flags in RUNS.items():
        launch(train_in_process, 4, "gpt", [*MODEL, *MOE, *PP2_EP2, *flags, *logs.flags(name)], timeout=600)
    for name, flags in UNTIED_RUNS.items():
        launch(train_in_process, 4, "gpt", [*MODEL, *MOE, *UNTIED, *PP2_EP2, *flags, *logs.flags(name)], timeout=600)
    launch(train_in_process, 4, "gpt", [*MODEL, *MOE, *PP2_EP2, *CAPACITY, *logs.flags("capacity")], timeout=600)
    return logs.records()


@pytest.mark.parametrize("name", [*RUNS, *UNTIED_RUNS])
def test_moe_run_trains_like_one_process(runs, name):
    reference = runs["single_untied" if name in UNTIED_RUNS else "single"]
    assert sorted(runs[name]) == list(range(1, ITERS + 1))
    assert_same_records(runs[name], reference, range(1, ITERS + 1), MOE_KEYS)


def test_auxiliary_losses_are_logged(runs):
    for record in runs["single"].values():
        assert record["load_balancing_loss"] > 0 and record["z_loss"] > 0


def test_capacity_factor_run_trains(runs):
    losses = [runs["capacity"][it]["lm_loss"] for it in range(1, ITERS + 1)]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
