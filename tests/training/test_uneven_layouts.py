"""Uneven pipeline stages through scripts/pretrain_gpt.py's training loop on CPU ranks (gloo,
NCCL's p2p rules: strict p2p).

Each of Megatron-LM's uneven-layout flags, under BitPipe, BitPipe with ``--split-backward``,
ZB-V, DualPipeV and megatron-core's 1F1B, trains the tiny GPT of 6 layers on PP 2 and logs the
single process's per-iteration losses, grad norms and validation losses (rtol 1e-5, from
``--log-json``): the initial weights depend on the seed and the model alone. The layouts include
stages without transformer layers (ZB-V's first stage holds only the embedding, DualPipeV's last
only the loss; BERT's DualPipeV run too, against BERT's single process). torch_dist checkpoints continue across layouts on the uninterrupted curve: the
single process's (one even stage) under DualPipeV's uneven V, and ZB-V's uneven V under ZB-H1's
even stages.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import CURVE_KEYS, JsonLogs, assert_same_records, events, records, tiny_gpt, train_in_process

ITERS, SAVE_AT = 4, 2
MODEL = tiny_gpt(ITERS, num_layers=6, global_batch_size=8)
PP2 = ["--pipeline-model-parallel-size", "2"]
#: run -> flags
UNEVEN = {
    "bitpipe_first": ["--pipeline-schedule", "bitpipe", *PP2, "--decoder-first-pipeline-num-layers", "3"],  # 3,1,1,1
    "bitpipe_split_accounted": [
        "--pipeline-schedule", "bitpipe", "--split-backward", *PP2,
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    ],  # 1,2,2,1
    "zbv_layout": ["--pipeline-schedule", "zbv", *PP2, "--pipeline-model-parallel-layout", "E|tt|ttt|tL"],  # 0,2,3,1
    "dualpipev_layout": ["--pipeline-schedule", "dualpipev", *PP2, "--pipeline-model-parallel-layout", "Et|t*3|tt|L"],  # 1,3,2,0
    "1f1b_last": ["--pipeline-schedule", "1f1b", *PP2, "--decoder-last-pipeline-num-layers", "2"],  # 4,2
    "bert_dualpipev_layout": ["--pipeline-schedule", "dualpipev", *PP2, "--pipeline-model-parallel-layout", "Et|t*3|tt|L"],
}  # fmt: skip
#: run -> (layers per stage in pipeline order, transformer layers on pipeline rank 0 and 1)
LAYERS = {
    "bitpipe_first": ([3, 1, 1, 1], [6, 6]),  # each rank holds every stage once (ranks d and D-1-d alike)
    "bitpipe_split_accounted": ([1, 2, 2, 1], [6, 6]),
    "zbv_layout": ([0, 2, 3, 1], [1, 5]),
    "dualpipev_layout": ([1, 3, 2, 0], [1, 5]),
    "1f1b_last": ([4, 2], [4, 2]),
    "bert_dualpipev_layout": ([1, 3, 2, 0], [1, 5]),
}
SAVES = {"single": [], "zbv_layout": UNEVEN["zbv_layout"]}
#: resumed run -> (its layout, the run whose checkpoint it loads)
RESUMES = {
    "dualpipev_uneven_from_single": (UNEVEN["dualpipev_layout"], "single"),
    "zbh1_even_from_zbv_uneven": (["--pipeline-schedule", "zb-h1", *PP2], "zbv_layout"),
}

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank, pytest.mark.strict_p2p]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Dict[int, dict]]:
    """Every run once: name -> {iteration: JSON record}."""
    out = tmp_path_factory.mktemp("uneven")
    logs = JsonLogs(out)
    log = logs.flags

    def save(name: str) -> List[str]:
        return ["--save", str(out / f"ckpt_{name}"), "--save-interval", str(SAVE_AT)] if name in SAVES else []

    launch(train_in_process, 1, "gpt", [*MODEL, *save("single"), *log("single")], timeout=300)
    launch(train_in_process, 1, "bert", [*MODEL, *log("bert_single")], timeout=300)
    for name, flags in UNEVEN.items():
        launch(train_in_process, 2, _task(name), [*MODEL, *flags, *save(name), *log(name)], timeout=300)
    for name, (flags, source) in RESUMES.items():
        load = ["--load", str(out / f"ckpt_{source}"), "--ckpt-step", str(SAVE_AT)]
        launch(train_in_process, 2, "gpt", [*MODEL, *flags, *load, *log(name)], timeout=300)
    return {name: (records(path), events(path, "startup")[0]) for name, path in logs.paths.items()}


#: task -> its single-process run
SINGLE = {"gpt": "single", "bert": "bert_single"}


def _task(name: str) -> str:
    return "bert" if name.startswith("bert") else "gpt"


@pytest.mark.parametrize("name", UNEVEN)
def test_uneven_layout_trains_like_one_process(runs, name):
    logged, startup = runs[name]
    stages, per_rank = LAYERS[name]
    assert startup["stage_layers"] == stages
    assert [r["layers"] for r in sorted(startup["ranks"], key=lambda r: r["pp_rank"])] == per_rank
    assert sorted(logged) == list(range(1, ITERS + 1))
    keys = (*CURVE_KEYS, "sop_loss") if _task(name) == "bert" else CURVE_KEYS
    assert_same_records(logged, runs[SINGLE[_task(name)]][0], range(1, ITERS + 1), keys)


@pytest.mark.parametrize("name", RESUMES)
def test_checkpoint_resumes_across_even_and_uneven_layouts(runs, name):
    resumed, _ = runs[name]
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    assert_same_records(resumed, runs["single"][0], range(SAVE_AT + 1, ITERS + 1), CURVE_KEYS)
