"""A mixture-of-experts GPT's torch_dist checkpoint resumes in another expert-parallel size,
schedule and layout: BitPipe PP 2 x DP 2 at expert parallelism 2 saves at iteration 2 (each
routed expert under its global index, written once), and ZB-V PP 2 x DP 2 at expert
parallelism 1 (every expert on every rank, one optimizer instead of a dense and an expert one)
loads it and continues the single process's curve (losses, grad norms, learning rates,
validation losses and the auxiliary-loss fields, rtol 1e-5; from ``--log-json``) — the weights
and Adam's state of every expert carried over.
"""

from __future__ import annotations

from typing import Dict

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import CURVE_KEYS, JsonLogs, assert_same_records, tiny_gpt, train_in_process

ITERS = 4
SAVE_AT = 2
MODEL = tiny_gpt(ITERS, num_layers=4)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
       "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall"]  # fmt: skip
MOE_KEYS = (*CURVE_KEYS, "load_balancing_loss", "z_loss")
SAVING = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "bitpipe", "--expert-model-parallel-size", "2"]
RESUMING = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--expert-model-parallel-size", "1"]

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank, pytest.mark.strict_p2p]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Dict[int, dict]]:
    """The single process, the saving run and the resumed run: name -> {iteration: JSON record}."""
    out = tmp_path_factory.mktemp("moe_checkpoints")
    logs = JsonLogs(out)
    checkpoint = str(out / "bitpipe_ep2")
    assert launch(train_in_process, 1, "gpt", [*MODEL, *MOE, *logs.flags("single")], timeout=300) == [None]
    saving = [*MODEL, *MOE, *SAVING, "--save", checkpoint, "--save-interval", str(SAVE_AT), *logs.flags("bitpipe_ep2")]
    assert launch(train_in_process, 4, "gpt", saving, timeout=600) == [None] * 4
    resuming = [*MODEL, *MOE, *RESUMING, "--load", checkpoint, "--ckpt-step", str(SAVE_AT), *logs.flags("zbv_ep1")]
    assert launch(train_in_process, 4, "gpt", resuming, timeout=600) == [None] * 4
    return logs.records()


def test_saving_run_trains_like_one_process(runs):
    assert sorted(runs["bitpipe_ep2"]) == list(range(1, ITERS + 1))
    assert_same_records(runs["bitpipe_ep2"], runs["single"], range(1, ITERS + 1), MOE_KEYS)


def test_resumed_run_in_another_expert_layout_continues_the_curve(runs):
    assert sorted(runs["zbv_ep1"]) == list(range(SAVE_AT + 1, ITERS + 1))
    assert_same_records(runs["zbv_ep1"], runs["single"], range(SAVE_AT + 1, ITERS + 1), MOE_KEYS)
