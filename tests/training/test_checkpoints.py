"""Distributed checkpoints of scripts/pretrain_gpt.py across layouts, optimizers and flags (CPU, gloo).

The tiny GPT of ``test_pretrain_gpt.py`` (no dropout: every layout computes the same numbers)
trains 4 iterations and saves at iteration 2; a resumed run must log the uninterrupted run's
losses, grad norms and learning rates for iterations 3 and 4 (rtol 1e-5):

* BitPipe, pipeline 2 x data parallel 2 with the distributed optimizer -> megatron-core's 1F1B,
  tensor 2 (sequence parallel) x pipeline 2, non-distributed optimizer; -> a single process
  with the distributed optimizer (its parameter all-gather overlapped: ``--overlap-param-gather``,
  under megatron-core's own schedule);
* megatron-core's interleaved schedule (pipeline 2, 2 chunks per rank) -> BitPipe with split
  backward and the distributed optimizer (``--overlap-param-gather``);
* a single process, non-distributed optimizer -> a single process with the distributed one;
  -> Optimus 2D, tensor 4 (q = 2);
* BitPipe, pipeline 2 x context parallel 2 with the distributed optimizer (SDPA layers) -> a
  single process (context parallel 1) with the distributed optimizer; -> BitPipe, pipeline 2 x
  context parallel 4 with the distributed optimizer (8 ranks).

(BitPipe pipeline 4 -> single process is in ``test_pretrain_gpt.py``.) The distributed-optimizer
runs themselves train like the single process. ``--no-load-optim``, ``--no-load-rng`` and
``--finetune`` load the weights as Megatron-LM does; ``--override-opt_param-scheduler``,
``--use-checkpoint-opt_param-scheduler`` and a fixed ``--lr-decay-iters`` let a run resume
with a longer ``--train-iters``, which is otherwise refused with a message in samples. Every
checkpoint that exists but cannot be loaded stops both ranks of a 2-rank job with status 1
and one message naming the directory and the problem; an empty ``--load`` starts from scratch
with one warning. A checkpoint of the earlier logical format converts
(``scripts/convert_checkpoint.py``) and continues its run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_bitpipe import megatron_compat
from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import CURVE_KEYS, REPO, assert_same_records, main_with_output, records, tiny_gpt, train_in_process

pytestmark = [pytest.mark.timeout(1500), pytest.mark.multirank]

ITERS, SAVE_AT = 4, 2
MODEL = tiny_gpt(ITERS)
DISTOPT = ["--use-distributed-optimizer"]
#: the distributed optimizer's parameter all-gather overlapped with the next forward
OVERLAPPED = [*DISTOPT, "--overlap-param-gather", "--overlap-grad-reduce"]
BITPIPE_DP2 = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
TP2_1F1B = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]
SPLIT = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--split-backward"]
OPTIMUS = ["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "optimus2d"]


def bitpipe_cp(cp: int) -> List[str]:
    """BitPipe, pipeline 2, each sequence split over ``cp`` context-parallel ranks (SDPA layers)."""
    return [*BITPIPE_DP2, "--context-parallel-size", str(cp), "--attention-backend", "sdpa"]

# The logical-format checkpoint in tests/data: iteration 2 of this run (BitPipe, pipeline 2).
LOGICAL = REPO / "tests" / "data" / "logical_gpt_checkpoint"
LOGICAL_MODEL = [
    "--num-layers", "4", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "60", "--make-vocab-size-divisible-by", "8",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-iters", "4", "--train-iters", "4", "--adam-eps", "1e-4",
    "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip
# (loss, grad norm) of every iteration of the run that saved it (its iterations 3 and 4 continued
# from that checkpoint); the weights of a fresh run now come from another random stream
LOGICAL_RUN = {
    1: (4.147755861282349, 0.7620106455692575),
    2: (4.158015131950378, 0.9591693893933091),
    3: (4.15571653842926, 0.747003689456801),
    4: (4.154773950576782, 0.6231276361147601),
}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def _train(out: Path, name: str, nproc: int, args: List[str], task: str = "gpt") -> Dict[int, dict]:
    log = out / f"{name}.jsonl"
    assert launch(train_in_process, nproc, task, [*MODEL, *args, "--log-json", str(log)], timeout=600) == [None] * nproc
    return records(log)


@pytest.fixture(scope="module")
def runs(out) -> Dict[str, Dict[int, dict]]:
    """Every training run, once: name -> {iteration: --log-json record}."""
    save = ["--save-interval", str(SAVE_AT)]
    step = ["--ckpt-step", str(SAVE_AT)]
    runs = {}
    runs["single"] = _train(out, "single", 1, ["--save", str(out / "single"), *save])
    runs["bitpipe_dp2_distopt"] = _train(out, "bitpipe_dp2_distopt", 4, [*BITPIPE_DP2, *DISTOPT, "--save", str(out / "distopt"), *save])
    runs["1f1b_tp2_from_distopt"] = _train(out, "1f1b_tp2_from_distopt", 4, [*TP2_1F1B, "--load", str(out / "distopt"), *step])
    runs["single_distopt_from_distopt"] = _train(out, "single_distopt_from_distopt", 1, [*OVERLAPPED, "--load", str(out / "distopt"), *step])
    runs["interleaved"] = _train(out, "interleaved", 2, [*INTERLEAVED, "--save", str(out / "interleaved"), *save])
    runs["split_distopt_from_interleaved"] = _train(
        out, "split_distopt_from_interleaved", 2, [*SPLIT, *OVERLAPPED, "--load", str(out / "interleaved"), *step]
    )
    runs["single_distopt_from_single"] = _train(out, "single_distopt_from_single", 1, [*DISTOPT, "--load", str(out / "single"), *step])
    runs["optimus_from_single"] = _train(out, "optimus_from_single", 4, [*OPTIMUS, "--load", str(out / "single"), *step])
    # context parallelism: its ranks hold replicas of the same weights (and, with the
    # distributed optimizer, shards of one state over data x context parallel)
    runs["bitpipe_cp2_distopt"] = _train(out, "bitpipe_cp2_distopt", 4, [*bitpipe_cp(2), *DISTOPT, "--save", str(out / "cp2"), *save])
    runs["single_distopt_from_cp2"] = _train(out, "single_distopt_from_cp2", 1, [*DISTOPT, "--load", str(out / "cp2"), *step])
    runs["bitpipe_cp4_distopt_from_cp2"] = _train(
        out, "bitpipe_cp4_distopt_from_cp2", 8, [*bitpipe_cp(4), *DISTOPT, "--load", str(out / "cp2"), *step]
    )
    return runs


@pytest.mark.parametrize("name", ["bitpipe_dp2_distopt", "interleaved", "bitpipe_cp2_distopt"])
def test_saving_runs_train_like_a_single_process(runs, name):
    assert sorted(runs[name]) == list(range(1, ITERS + 1))
    assert_same_records(runs[name], runs["single"], range(1, ITERS + 1), CURVE_KEYS)


@pytest.mark.parametrize(
    "name",
    [
        "1f1b_tp2_from_distopt", "single_distopt_from_distopt", "split_distopt_from_interleaved", "single_distopt_from_single",
        "optimus_from_single", "single_distopt_from_cp2", "bitpipe_cp4_distopt_from_cp2",
    ],
)  # fmt: skip
def test_resumed_run_continues_the_uninterrupted_curve(runs, name):
    assert sorted(runs[name]) == list(range(SAVE_AT + 1, ITERS + 1)), name
    assert_same_records(runs[name], runs["single"], range(SAVE_AT + 1, ITERS + 1), CURVE_KEYS)


# -- --no-load-optim, --no-load-rng, --finetune ------------------------------------------------


@pytest.fixture(scope="module")
def load_options(runs, out) -> Dict[str, Dict[int, dict]]:
    load = ["--load", str(out / "single"), "--ckpt-step", str(SAVE_AT)]
    return {
        "no_load_optim": _train(out, "no_load_optim", 1, [*load, "--no-load-optim"]),
        "no_load_rng": _train(out, "no_load_rng", 1, [*load, "--no-load-rng"]),
        # learning rate 0: the weights stay the loaded ones, evaluated after iteration 2
        "finetune": _train(out, "finetune", 1, [*load, "--finetune", "--lr", "0", "--train-iters", "2"]),
    }


def test_no_load_optim_loads_weights_and_progress_only(runs, load_options):
    resumed = load_options["no_load_optim"]
    assert sorted(resumed) == [3, 4]
    assert resumed[3]["lm_loss"] == pytest.approx(runs["single"][3]["lm_loss"], rel=1e-5)  # the loaded weights
    assert resumed[3]["consumed_samples"] == runs["single"][3]["consumed_samples"]
    assert resumed[3]["lr"] == 0.0  # a fresh schedule starts its warm-up, as in Megatron-LM


def test_no_load_rng_continues_the_curve(runs, load_options):
    assert sorted(load_options["no_load_rng"]) == [3, 4]
    assert_same_records(load_options["no_load_rng"], runs["single"], [3, 4], CURVE_KEYS)


def test_finetune_loads_weights_and_restarts_at_iteration_zero(runs, load_options):
    finetuned = load_options["finetune"]
    assert sorted(finetuned) == [1, 2] and finetuned[1]["consumed_samples"] == 16
    assert {r["lr"] for r in finetuned.values()} == {0.0}
    assert finetuned[2]["validation_lm_loss"] == pytest.approx(runs["single"][SAVE_AT]["validation_lm_loss"], rel=1e-5)


# -- a longer --train-iters -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def longer(runs, out) -> Dict[str, object]:
    load = ["--load", str(out / "single"), "--ckpt-step", str(SAVE_AT), "--train-iters", "6"]
    refused = launch(main_with_output, 1, "gpt", [*MODEL, *load], timeout=300)[0]
    return {
        "refused": refused,
        "use_checkpoint": _train(out, "use_checkpoint", 1, [*load, "--use-checkpoint-opt_param-scheduler"]),
        "override": _train(out, "override", 1, [*load, "--override-opt_param-scheduler"]),
        "fixed_decay": _train(out, "fixed_decay", 1, [*load, "--lr-decay-iters", str(ITERS)]),
    }


def test_longer_run_is_refused_in_samples_without_a_schedule_flag(longer):
    status, _, stderr = longer["refused"]
    assert status == 1
    assert "has another learning-rate schedule" in stderr
    assert "--lr-decay-iters (default --train-iters): the checkpoint decays the learning rate over 64 samples (4 iterations of 16), this run over 96 samples (6 iterations of 16)" in stderr
    assert "--use-checkpoint-opt_param-scheduler" in stderr and "--override-opt_param-scheduler" in stderr


@pytest.mark.parametrize("name", ["use_checkpoint", "fixed_decay"])
def test_longer_run_keeping_the_schedule_continues_the_curve(runs, longer, name):
    assert sorted(longer[name]) == [3, 4, 5, 6]
    assert_same_records(longer[name], runs["single"], [3, 4], CURVE_KEYS)


def test_override_takes_this_runs_schedule(runs, longer):
    overridden = longer["override"]
    assert sorted(overridden) == [3, 4, 5, 6]
    assert overridden[3]["lm_loss"] == pytest.approx(runs["single"][3]["lm_loss"], rel=1e-5)
    # linear decay over 6 x 16 samples after 16 of warm-up, at sample 32: 1e-3 x (1 - 16 / 80)
    assert overridden[3]["lr"] == pytest.approx(8e-4)


# -- checkpoints that cannot be loaded -------------------------------------------------------------


def _broken_copies(out: Path) -> Dict[str, Path]:
    """--load directories that exist but cannot be loaded, made from the single run's checkpoint."""
    iteration = f"iter_{SAVE_AT:07d}"
    broken = {}
    missing_shard = out / "broken_missing_shard"
    shutil.copytree(out / "single" / iteration, missing_shard / iteration)
    (missing_shard / "latest_checkpointed_iteration.txt").write_text(f"{SAVE_AT}\n")
    next(iter(sorted((missing_shard / iteration).glob("*.distcp")))).unlink()
    broken["missing_shard"] = missing_shard
    unknown = out / "broken_unknown_format"
    (unknown / iteration).mkdir(parents=True)
    (unknown / iteration / "weights.bin").write_bytes(b"\0" * 64)
    (unknown / "latest_checkpointed_iteration.txt").write_text(f"{SAVE_AT}\n")
    broken["unknown_format"] = unknown
    missing_directory = out / "broken_tracker"
    missing_directory.mkdir()
    (missing_directory / "latest_checkpointed_iteration.txt").write_text("7\n")
    broken["tracker"] = missing_directory
    return broken


@pytest.fixture(scope="module")
def failures(runs, out) -> Dict[str, list]:
    """Two-rank runs (1F1B, pipeline 2) loading checkpoints they cannot load: per case, the
    ranks' (status, stdout, stderr)."""
    broken = _broken_copies(out)
    pipeline = ["--pipeline-model-parallel-size", "2"]
    cases = {
        "wrong_model": ("gpt", ["--hidden-size", "64", "--load", str(out / "single")]),
        "missing_shard": ("gpt", ["--load", str(broken["missing_shard"])]),
        "unknown_format": ("gpt", ["--load", str(broken["unknown_format"])]),
        "tracker": ("gpt", ["--load", str(broken["tracker"])]),
        "logical_format": ("gpt", ["--load", str(LOGICAL)]),
        "other_task": ("bert", ["--load", str(out / "single")]),
        "no_optimizer": ("gpt", ["--load", str(out / "no_optim_saved")]),
        "exit_on_missing": ("gpt", ["--load", str(out / "empty"), "--exit-on-missing-checkpoint"]),
        "empty": ("gpt", ["--load", str(out / "empty"), "--train-iters", "1", "--lr-warmup-iters", "0"]),
    }
    _train(out, "no_optim_saved", 1, ["--save", str(out / "no_optim_saved"), "--no-save-optim", "--train-iters", "1", "--lr-warmup-iters", "0"])
    return {name: launch(main_with_output, 2, task, [*MODEL, *pipeline, *flags], timeout=300) for name, (task, flags) in cases.items()}


@pytest.mark.parametrize(
    "case,directory,problem",
    [
        ("wrong_model", "single/iter_0000004", "holds a different model: --hidden-size is 32 there, 64 here"),
        ("missing_shard", "broken_missing_shard/iter_0000002", "cannot be read: shard file __0_0.distcp is missing"),
        ("unknown_format", "broken_unknown_format/iter_0000002", "holds no checkpoint in a known format"),
        ("tracker", "broken_tracker", "the checkpoint of iteration 7"),
        ("logical_format", "logical_gpt_checkpoint/iter_0000002", "scripts/convert_checkpoint.py"),
        ("other_task", "single/iter_0000004", "holds another model: it holds a gpt model, this run trains bert"),
        ("no_optimizer", "no_optim_saved/iter_0000001", "has no optimizer state (saved with --no-save-optim): pass --no-load-optim"),
        ("exit_on_missing", "empty", "--exit-on-missing-checkpoint is set"),
    ],
)
def test_unloadable_checkpoint_stops_every_rank_with_one_message(failures, case, directory, problem):
    ranks = failures[case]
    assert [status for status, _, _ in ranks] == [1, 1], ranks
    messages = [line for _, _, stderr in ranks for line in stderr.splitlines() if "error:" in line]
    assert len(messages) == 1, messages  # once, from rank 0
    assert directory in messages[0] and problem in messages[0], messages[0]
    assert not any(" iteration " in stdout for _, stdout, _ in ranks)  # before training


def test_empty_load_directory_starts_from_scratch_with_one_warning(failures):
    ranks = failures["empty"]
    assert [status for status, _, _ in ranks] == [0, 0]
    stdout = "".join(out for _, out, _ in ranks)
    assert stdout.count("WARNING: no checkpoint in --load") == 1
    assert "iteration        1/       1" in stdout


# -- the earlier logical format ----------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(out) -> Dict[int, dict]:
    command = [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), str(LOGICAL), str(out / "converted")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    log = out / "logical_resumed.jsonl"
    flags = [*LOGICAL_MODEL, "--load", str(out / "converted"), "--log-json", str(log)]
    assert launch(train_in_process, 1, "gpt", flags, timeout=300) == [None]
    return records(log)


@pytest.mark.skipif(
    megatron_compat.reads_common_state_in_index(),
    reason="scripts/convert_checkpoint.py runs under megatron-core 0.16 only (its inputs were written with 0.16)",
)
def test_converted_logical_checkpoint_continues_its_run(converted):
    assert sorted(converted) == [3, 4]
    for iteration in (3, 4):
        loss, grad_norm = LOGICAL_RUN[iteration]
        assert converted[iteration]["lm_loss"] == pytest.approx(loss, rel=1e-5)
        assert converted[iteration]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
        assert converted[iteration]["consumed_samples"] == 8 * iteration
