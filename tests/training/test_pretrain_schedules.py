"""Every plan schedule through scripts/pretrain_gpt.py's training loop on CPU ranks (gloo,
NCCL's p2p rules: strict p2p).

The zero-bubble family (ZB-H1, ZB-V, DualPipeV), DualPipe and Chimera each train the tiny GPT
on PP 2 x DP 2 with the distributed optimizer and log the single process's per-iteration
losses, grad norms, learning rates and validation losses (rtol 1e-5, from ``--log-json``),
ZB-V with the parameter all-gather overlapped with the next forward (``--overlap-param-gather``);
DualPipe and Chimera hold two replicas whose pipelines end away from their start, so they run
the model with untied embeddings (the tied model is refused, :mod:`tests.plugin.test_plugin_args`)
against an untied single process. A torch_dist checkpoint saved under one schedule at
iteration 2 continues under another schedule and layout (ZB-V PP 2 x DP 2 -> DualPipeV PP 4;
Chimera PP 2 x DP 2 -> DualPipe PP 4) on the uninterrupted curve. The features that compose
with a plan schedule do so under the V schedules too, each against its own single process:
activation recompute, ``--overlap-p2p-comm``, SDPA attention, an HFTA array of two models and
BERT (lm and sop losses).
"""

from __future__ import annotations

from typing import Dict

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import CURVE_KEYS, JsonLogs, assert_same_records, tiny_gpt, train_in_process

ITERS, SAVE_AT = 4, 2
MODEL = tiny_gpt(ITERS)
UNTIED = ["--untie-embeddings-and-output-weights"]
#: schedule -> whether its placement needs untied embeddings
SCHEDULES = {"zb-h1": False, "zbv": False, "dualpipev": False, "dualpipe": True, "chimera": True}
#: the schedules whose run overlaps the distributed optimizer's parameter all-gather
OVERLAP_PARAM_GATHER = {"zbv"}
#: resumed run -> (schedule and layout, the run whose checkpoint it loads)
RESUMES = {
    "resume_dualpipev_pp4_from_zbv": (["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "4"], "zbv"),
    "resume_dualpipe_pp4_from_chimera": (["--pipeline-schedule", "dualpipe", "--pipeline-model-parallel-size", "4", *UNTIED], "chimera"),
}

ZBV_PP2 = ["--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "2"]
#: run -> (task, ranks, flags of both runs, flags of the pipelined run alone)
COMPOSED = {
    "zbv_recompute": ("gpt", 2, [], [*ZBV_PP2, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"]),
    "zbv_overlap_p2p": ("gpt", 2, [], [*ZBV_PP2, "--overlap-p2p-comm"]),
    "zbv_sdpa": ("gpt", 2, ["--attention-backend", "sdpa"], ZBV_PP2),
    "zbv_hfta2": ("gpt", 2, ["--hfta-models", "2"], ZBV_PP2),
    "dualpipev_bert": ("bert", 4, [], ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "4"]),
}

pytestmark = [pytest.mark.timeout(1200), pytest.mark.multirank, pytest.mark.strict_p2p]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Dict[int, dict]]:
    """Every run once: name -> {iteration: JSON record}."""
    out = tmp_path_factory.mktemp("schedules")
    logs = JsonLogs(out)
    log = logs.flags
    launch(train_in_process, 1, "gpt", [*MODEL, *log("single")], timeout=300)
    launch(train_in_process, 1, "gpt", [*MODEL, *UNTIED, *log("single_untied")], timeout=300)
    for schedule, untied in SCHEDULES.items():
        layout = ["--pipeline-schedule", schedule, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
        if schedule in OVERLAP_PARAM_GATHER:
            layout += ["--overlap-param-gather", "--overlap-grad-reduce"]
        save = ["--save", str(out / f"ckpt_{schedule}"), "--save-interval", str(SAVE_AT)]
        launch(train_in_process, 4, "gpt", [*MODEL, *layout, *(UNTIED if untied else []), *save, *log(schedule)], timeout=600)
    for name, (task, ranks, both, pipelined) in COMPOSED.items():
        launch(train_in_process, 1, task, [*MODEL, *both, *log(f"{name}_single")], timeout=300)
        launch(train_in_process, ranks, task, [*MODEL, *both, *pipelined, *log(name)], timeout=600)
    for name, (layout, source) in RESUMES.items():
        load = ["--load", str(out / f"ckpt_{source}"), "--ckpt-step", str(SAVE_AT)]
        launch(train_in_process, 4, "gpt", [*MODEL, *layout, *load, *log(name)], timeout=600)
    return logs.records()


def _assert_same(actual: Dict[int, dict], expected: Dict[int, dict], iterations) -> None:
    assert_same_records(actual, expected, iterations, CURVE_KEYS)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_with_distributed_optimizer_trains_like_one_process(runs, schedule):
    reference = runs["single_untied" if SCHEDULES[schedule] else "single"]
    assert sorted(runs[schedule]) == list(range(1, ITERS + 1))
    _assert_same(runs[schedule], reference, range(1, ITERS + 1))


@pytest.mark.parametrize("name", RESUMES)
def test_checkpoint_resumes_under_another_schedule(runs, name):
    source = RESUMES[name][1]
    resumed = runs[name]
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    _assert_same(resumed, runs[source], range(SAVE_AT + 1, ITERS + 1))


@pytest.mark.parametrize("name", COMPOSED)
def test_composed_feature_trains_like_one_process(runs, name):
    task = COMPOSED[name][0]
    losses = ("lm_loss", "sop_loss") if task == "bert" else ("lm_loss",)
    assert sorted(runs[name]) == list(range(1, ITERS + 1))
    assert_same_records(runs[name], runs[f"{name}_single"], range(1, ITERS + 1), (*losses, "grad_norm", "validation_lm_loss"))
