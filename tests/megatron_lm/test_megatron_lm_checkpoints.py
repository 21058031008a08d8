"""Checkpoints between megatron-bitpipe's scripts/pretrain_gpt.py and Megatron-LM's pretrain_gpt.py,
and Megatron-LM's loader behind the plugin's checks (CPU ranks, gloo).

Needs a Megatron-LM checkout (tag core_v0.16.1) in ``MEGATRON_LM_PATH``; skipped otherwise.
Both scripts train the same tiny GPT (same flags, seed-only initial weights, no dropout) on the
same Megatron indexed dataset written here, 4 iterations, saving ``torch_dist`` checkpoints at
iteration 2:

* the two routes log the same losses and grad norms (our BitPipe pipeline 2, Megatron-LM's
  default 1F1B pipeline 2);
* Megatron-LM's default schedule resumes our BitPipe checkpoint, and our script with BitPipe
  resumes Megatron-LM's, each continuing the uninterrupted curve;
* through the runtime route, with BitPipe: ``--no-load-optim`` loads the weights (iteration 3's
  loss is the uninterrupted one), ``--no-load-rng`` continues the curve, ``--finetune`` at learning
  rate 0 computes the loss our script computes with ``--finetune`` from the same checkpoint;
* model 1 of a fused array (``--hfta-models 2``) extracted by ``scripts/hfta_extract.py``
  loads into Megatron-LM's script (pipeline 2, ``--no-load-optim --no-load-rng``), whose
  iteration-3 loss is the array's model-1 loss at iteration 3;
* a ``--load`` without a checkpoint starts from scratch with Megatron-LM's one warning; a
  checkpoint that exists but cannot be loaded (another model, a missing shard, an unknown
  format, another model family, legacy per-rank files of another layout or with bitpipe, no
  checkpoint with ``--exit-on-missing-checkpoint``) stops both ranks with status 1 and one
  ``megatron_bitpipe: error:`` line naming the directory and the problem, before training.

Megatron-LM logs its running average at the second iteration after a (re)start: that logged
value is the mean of the two iterations' losses (for every schedule and checkpoint).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.megatron_lm.checkout import find_checkout

from .megatron_lm_support import Run, checkout_or_skip, checkpoint_writer_problem, torchrun, write_indexed_dataset
from ..pretrain_support import records, train_in_process

pytestmark = [pytest.mark.timeout(2400), pytest.mark.multirank]
RTOL = 1e-5
BITPIPE_PP2 = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]


def _model(data: Path) -> List[str]:
    """The flags both scripts run with (4 iterations on the indexed dataset, no evaluation)."""
    return (
        "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 1e-3 --tokenizer-type NullTokenizer "
        "--vocab-size 100 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 1000 "
        f"--eval-iters 0 --split 100,0,0 --data-path {data}"
    ).split()


@pytest.fixture(scope="module")
def loading_checkout() -> Path:
    """The checkout, for tests where Megatron-LM only loads checkpoints."""
    return find_checkout(checkout_or_skip()).root


@pytest.fixture(scope="module")
def checkout(loading_checkout):
    """The checkout, for tests where Megatron-LM saves checkpoints too."""
    if checkpoint_writer_problem(loading_checkout):
        pytest.skip(checkpoint_writer_problem(loading_checkout))
    return loading_checkout


@pytest.fixture(scope="module")
def workdir(loading_checkout, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("megatron_lm_checkpoints")
    write_indexed_dataset(directory / "text_document")
    return directory


def _megatron_lm(checkout: Path, workdir: Path, name: str, nproc: int, flags: List[str]) -> Run:
    cache = ["--data-cache-path", str(workdir / f"cache_{name}")]
    return torchrun(checkout / "pretrain_gpt.py", nproc, [*_model(workdir / "text_document"), *cache, "--layout-independent-init", *flags], workdir)


def _ours(workdir: Path, name: str, nproc: int, flags: List[str]) -> Dict[int, dict]:
    log = workdir / f"{name}.jsonl"
    cache = ["--data-cache-path", str(workdir / f"cache_{name}")]
    argv = [*_model(workdir / "text_document"), *cache, *flags, "--log-json", str(log)]
    assert launch(train_in_process, nproc, "gpt", argv, timeout=600) == [None] * nproc
    return records(log)


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-5000:]
    return run


@pytest.fixture(scope="module")
def curves(checkout, workdir) -> dict:
    """Uninterrupted runs of both scripts (saving at 2) and each resuming the other's checkpoint."""
    save = ["--save-interval", "2"]
    out = {}
    out["megatron_lm"] = _ok(_megatron_lm(checkout, workdir, "megatron_lm", 2, ["--pipeline-model-parallel-size", "2", "--save", str(workdir / "M"), *save]))
    out["ours"] = _ours(workdir, "ours", 2, [*BITPIPE_PP2, "--save", str(workdir / "O"), *save])
    out["megatron_lm_from_ours"] = _ok(
        _megatron_lm(checkout, workdir, "megatron_lm_from_ours", 2, ["--pipeline-model-parallel-size", "2", "--load", str(workdir / "O"), "--ckpt-step", "2"])
    )
    out["ours_from_megatron_lm"] = _ours(workdir, "ours_from_megatron_lm", 2, [*BITPIPE_PP2, "--load", str(workdir / "M"), "--ckpt-step", "2"])
    return out


def _expected_megatron_lm_log(ours: Dict[int, dict], iterations) -> Dict[int, float]:
    """What Megatron-LM logs for a run with our losses: the second iteration after the start
    is the mean of the first two."""
    first, second = iterations[0], iterations[1]
    logged = {i: ours[i]["lm_loss"] for i in iterations}
    logged[second] = (ours[first]["lm_loss"] + ours[second]["lm_loss"]) / 2
    return logged


def test_both_routes_train_alike(curves):
    ours, megatron_lm = curves["ours"], curves["megatron_lm"]
    assert sorted(ours) == sorted(megatron_lm.losses) == [1, 2, 3, 4]
    for i, loss in _expected_megatron_lm_log(ours, [1, 2, 3, 4]).items():
        assert megatron_lm.losses[i] == pytest.approx(loss, rel=RTOL), f"iteration {i}"
        assert megatron_lm.grad_norms[i] == pytest.approx(ours[i]["grad_norm"], rel=1e-3), f"grad norm, iteration {i}"


def test_megatron_lm_resumes_our_bitpipe_checkpoint(curves):
    resumed = curves["megatron_lm_from_ours"]
    assert sorted(resumed.losses) == [3, 4]
    for i, loss in _expected_megatron_lm_log(curves["ours"], [3, 4]).items():
        assert resumed.losses[i] == pytest.approx(loss, rel=RTOL), f"iteration {i}"
        assert resumed.grad_norms[i] == pytest.approx(curves["ours"][i]["grad_norm"], rel=1e-3)


def test_our_script_resumes_megatron_lm_checkpoint(curves):
    resumed = curves["ours_from_megatron_lm"]
    assert sorted(resumed) == [3, 4]
    for i in (3, 4):
        assert resumed[i]["lm_loss"] == pytest.approx(curves["ours"][i]["lm_loss"], rel=RTOL), f"iteration {i}"
        assert resumed[i]["grad_norm"] == pytest.approx(curves["ours"][i]["grad_norm"], rel=RTOL)


# -- --no-load-optim, --no-load-rng, --finetune (runtime route, bitpipe) -------------------------------


@pytest.fixture(scope="module")
def load_options(curves, checkout, workdir) -> dict:
    load = [*BITPIPE_PP2, "--load", str(workdir / "O"), "--ckpt-step", "2"]
    finetune = ["--finetune", "--lr", "0", "--train-iters", "1"]
    return {
        "no_load_optim": _ok(_megatron_lm(checkout, workdir, "no_load_optim", 2, [*load, "--no-load-optim"])),
        "no_load_rng": _ok(_megatron_lm(checkout, workdir, "no_load_rng", 2, [*load, "--no-load-rng"])),
        "finetune": _ok(_megatron_lm(checkout, workdir, "finetune", 2, [*load, *finetune])),
        "ours_finetune": _ours(workdir, "ours_finetune", 1, ["--load", str(workdir / "O"), "--ckpt-step", "2", *finetune]),
    }


def test_no_load_optim_loads_the_weights(curves, load_options):
    run = load_options["no_load_optim"]
    assert sorted(run.losses) == [3, 4]
    assert run.losses[3] == pytest.approx(curves["ours"][3]["lm_loss"], rel=RTOL)


def test_no_load_rng_continues_the_curve(curves, load_options):
    run = load_options["no_load_rng"]
    for i, loss in _expected_megatron_lm_log(curves["ours"], [3, 4]).items():
        assert run.losses[i] == pytest.approx(loss, rel=RTOL), f"iteration {i}"


def test_finetune_loads_the_weights_at_iteration_zero(curves, load_options):
    megatron_lm, ours = load_options["finetune"], load_options["ours_finetune"]
    assert sorted(megatron_lm.losses) == [1] and sorted(ours) == [1]
    assert megatron_lm.losses[1] == pytest.approx(ours[1]["lm_loss"], rel=RTOL)
    assert ours[1]["lm_loss"] != pytest.approx(curves["ours"][1]["lm_loss"], rel=1e-3)  # not the initial weights


# -- a model extracted from a fused array (HFTA) ------------------------------------------------------


def test_megatron_lm_loads_a_model_extracted_from_a_fused_array(loading_checkout, workdir):
    import subprocess
    import sys

    from .megatron_lm_support import REPO

    array = _ours(workdir, "hfta", 1, ["--hfta-models", "2", "--hfta-lr", "1e-3,5e-4", "--save", str(workdir / "H"), "--save-interval", "2"])
    extract = [sys.executable, str(REPO / "scripts" / "hfta_extract.py"), "--load", str(workdir / "H"), "--model", "1", "--ckpt-step", "2"]
    done = subprocess.run([*extract, "--save", str(workdir / "H1")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = _ok(_megatron_lm(loading_checkout, workdir, "from_hfta", 2, ["--pipeline-model-parallel-size", "2", "--load", str(workdir / "H1"), "--no-load-optim", "--no-load-rng"]))
    assert sorted(run.losses) == [3, 4]
    assert run.losses[3] == pytest.approx(array[3]["lm_losses"][1], rel=RTOL)
    assert array[3]["lm_losses"][1] != pytest.approx(array[3]["lm_losses"][0], rel=1e-3)  # the two models differ


# -- checkpoints that cannot be loaded -----------------------------------------------------------------


def _broken(workdir: Path) -> Dict[str, Path]:
    iteration = "iter_0000002"
    missing_shard = workdir / "broken_missing_shard"
    shutil.copytree(workdir / "O" / iteration, missing_shard / iteration)
    (missing_shard / "latest_checkpointed_iteration.txt").write_text("2\n")
    next(iter(sorted((missing_shard / iteration).glob("*.distcp")))).unlink()
    unknown = workdir / "broken_unknown_format"
    (unknown / iteration).mkdir(parents=True)
    (unknown / iteration / "weights.bin").write_bytes(b"\0" * 64)
    (unknown / "latest_checkpointed_iteration.txt").write_text("2\n")
    return {"missing_shard": missing_shard, "unknown_format": unknown}


@pytest.fixture(scope="module")
def failures(curves, checkout, workdir) -> Dict[str, Run]:
    broken = _broken(workdir)
    pipeline = ["--pipeline-model-parallel-size", "2"]
    bert = (  # our BERT, with the GPT's sizes, on mock data
        "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 1 --lr 1e-3 --vocab-size 100 --eval-iters 0"
    ).split()
    assert launch(train_in_process, 1, "bert", [*bert, "--save", str(workdir / "bert")], timeout=600) == [None]
    legacy = ["--ckpt-format", "torch", "--load", str(workdir / "legacy")]
    _ok(_megatron_lm(checkout, workdir, "legacy_save", 2, [*pipeline, "--ckpt-format", "torch", "--save", str(workdir / "legacy"), "--save-interval", "2", "--train-iters", "2"]))
    cases = {
        "empty": (2, [*pipeline, "--load", str(workdir / "empty"), "--train-iters", "1"]),
        "exit_on_missing": (2, [*pipeline, "--load", str(workdir / "empty"), "--exit-on-missing-checkpoint"]),
        "wrong_model": (2, [*pipeline, "--hidden-size", "64", "--load", str(workdir / "O")]),
        "missing_shard": (2, [*pipeline, "--load", str(broken["missing_shard"])]),
        "unknown_format": (2, [*pipeline, "--load", str(broken["unknown_format"])]),
        "other_task": (2, [*pipeline, "--load", str(workdir / "bert")]),
        "legacy_other_layout": (1, legacy),
        "legacy_other_chunks": (2, [*pipeline, "--num-layers-per-virtual-pipeline-stage", "2", *legacy]),
        "legacy_bitpipe": (2, [*BITPIPE_PP2, "--ckpt-format", "torch_dist", "--load", str(workdir / "legacy")]),
    }
    return {name: _megatron_lm(checkout, workdir, name, nproc, flags) for name, (nproc, flags) in cases.items()}


@pytest.mark.parametrize(
    "case,directory,problem",
    [
        ("exit_on_missing", "empty", "--exit-on-missing-checkpoint is set"),
        ("wrong_model", "O/iter_0000004", "holds a different model: --hidden-size is 32 there, 64 here"),
        ("missing_shard", "broken_missing_shard/iter_0000002", "cannot be read: shard file __0_0.distcp is missing"),
        ("unknown_format", "broken_unknown_format/iter_0000002", "holds no checkpoint in a known format"),
        ("other_task", "bert/iter_0000001", "does not fit this model: decoder."),
        ("legacy_other_layout", "legacy/iter_0000002", "this rank's file mp_rank_00/model_optim_rng.pt is missing"),
        ("legacy_other_chunks", "legacy/iter_0000002", "it holds model per rank, this run has 2 model chunk(s) per rank"),
        ("legacy_bitpipe", "legacy/iter_0000002", "--pipeline-schedule bitpipe does not read"),
    ],
)
def test_unloadable_checkpoint_stops_every_rank_with_one_message(failures, case, directory, problem):
    run = failures[case]
    assert run.returncode == 1, run.output[-3000:]
    messages = [line for line in run.output.splitlines() if line.startswith("megatron_bitpipe: error: ")]
    assert len(messages) == 1, messages
    assert directory in messages[0] and problem in messages[0], messages[0]
    assert not run.losses  # stopped before training
    assert "successfully loaded checkpoint" not in run.output


def test_empty_load_directory_starts_from_scratch_with_one_warning(failures):
    run = failures["empty"]
    assert run.returncode == 0, run.output[-3000:]
    assert run.output.count("could not find the metadata file") == 1
    assert sorted(run.losses) == [1]
