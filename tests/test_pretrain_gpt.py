"""scripts/pretrain_gpt.py end to end on CPU ranks (gloo).

* The same tiny GPT (seed-only initial weights, mock data) trained with BitPipe on 4 ranks,
  megatron-core's interleaved schedule on 2, Optimus 2D (TP 4) and a single process logs the
  same per-iteration losses, grad norms, learning rates and validation losses (rtol 1e-5,
  from ``--log-json``), and saves the same logical checkpoint. The BitPipe, interleaved and
  single-process runs are the script run through torchrun / python.
* A checkpoint saved by the BitPipe run at iteration 2 (both replicas written once, as one
  logical model) continues under megatron-core's 1F1B with TP 2 (sequence parallel) x PP 2
  and in a single process exactly like the uninterrupted run (and the TP 2 run saves BitPipe's iteration-4
  checkpoint again); a single process resumed from its own checkpoint repeats its run bit for
  bit; a checkpoint of another model shape is refused naming the flag.
* Bad flags fail on every rank before any communication, naming the flag; a failure on one
  rank ends the whole job; a Megatron indexed dataset built here trains.

One torchrun per layout serves all checks; resumed runs and the bad-flag check use the
in-process launcher (same code, no interpreter start-up per rank).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from . import pretrain_support
from .pretrain_support import assert_same_records, checked, main_in_process, records, train_in_process

ITERS, SAVE_AT = 4, 2
MODEL = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--train-iters", str(ITERS),
    "--adam-eps", "1e-4",  # bounds Adam's amplification of rounding noise in exactly-zero gradients (key biases)
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
]  # fmt: skip

pytestmark = pytest.mark.timeout(900)


def run_script(nproc: int, args: List[str], timeout: float = 300):
    return pretrain_support.run_script("pretrain_gpt.py", nproc, args, timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every training run, once: name -> {iteration: JSON record} (and the stdout of one)."""
    out = tmp_path_factory.mktemp("pretrain")
    ckpt_bitpipe, ckpt_single = out / "ckpt_bitpipe", out / "ckpt_single"  # (other layouts: out / f"ckpt_{name}")
    logs = {}

    def log(name: str) -> List[str]:
        logs[name] = out / f"{name}.jsonl"
        return ["--log-json", str(logs[name])]

    save = ["--save-interval", str(SAVE_AT)]
    stdout = {}
    stdout["bitpipe"] = checked(
        run_script(4, [*MODEL, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--save", str(ckpt_bitpipe), *save, *log("bitpipe")])
    ).stdout
    checked(run_script(2, [*MODEL, "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", *log("interleaved")]))
    split = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--split-backward"]
    launch(train_in_process, 2, "gpt", [*MODEL, *split, *log("bitpipe_split")], timeout=300)
    stdout["single"] = checked(
        run_script(1, [*MODEL, "--save", str(ckpt_single), *save, "--tensorboard-dir", str(out / "tb"), *log("single")])
    ).stdout
    optimus = ["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "optimus2d", "--save", str(out / "ckpt_optimus"), *save]
    launch(train_in_process, 4, "gpt", [*MODEL, *optimus, *log("optimus")], timeout=300)
    resume = ["--ckpt-step", str(SAVE_AT)]
    tp2_1f1b = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2", "--save", str(out / "ckpt_tp2_1f1b")]
    launch(train_in_process, 4, "gpt", [*MODEL, *tp2_1f1b, "--load", str(ckpt_bitpipe), *resume, *log("resume_tp2_1f1b")], timeout=300)
    launch(train_in_process, 1, "gpt", [*MODEL, "--load", str(ckpt_bitpipe), *resume, *log("resume_single")], timeout=300)
    launch(train_in_process, 1, "gpt", [*MODEL, "--load", str(ckpt_single), *resume, *log("resume_single_exact")], timeout=300)
    refused = launch(train_in_process, 1, "gpt", [*MODEL, "--hidden-size", "64", "--load", str(ckpt_bitpipe)], timeout=300)[0]
    records_by_run = {name: records(path) for name, path in logs.items()}
    return dict(records=records_by_run, stdout=stdout, out=out, ckpt=ckpt_bitpipe, ckpt_single=ckpt_single, refused=refused)


def _full_model(root: Path, iteration: int) -> dict:
    """{global name: entry} of a checkpoint, read back from its shards."""
    import torch

    directory = root / f"iter_{iteration:07d}"
    model = {}
    for shard in {p["file"] for p in _metadata(root, iteration)["parameters"].values()}:
        model.update(torch.load(directory / shard, weights_only=True))
    return model


def _assert_same(actual: Dict[int, dict], expected: Dict[int, dict], iterations, exact: bool = False):
    assert_same_records(actual, expected, iterations, ("lm_loss", "grad_norm", "lr", "validation_lm_loss", "consumed_samples"), exact)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["bitpipe", "bitpipe_split", "interleaved", "optimus"])
def test_every_layout_trains_like_a_single_process(runs, layout):
    single = runs["records"]["single"]
    assert sorted(single) == list(range(1, ITERS + 1))
    _assert_same(runs["records"][layout], single, range(1, ITERS + 1))
    assert single[ITERS]["lm_loss"] < single[1]["lm_loss"], "the loss should fall"


@pytest.mark.multirank
def test_log_json_fields(runs):
    for it, record in runs["records"]["bitpipe"].items():
        for key in ("iteration", "consumed_samples", "lm_loss", "grad_norm", "lr", "tokens_per_second", "elapsed_ms"):
            assert key in record and record[key] is not None, key
        assert record["consumed_samples"] == 16 * it
        assert math.isfinite(record["lm_loss"]) and record["tokens_per_second"] > 0
        assert ("validation_lm_loss" in record) == (it % 2 == 0)


@pytest.mark.multirank
def test_megatron_style_progress_lines(runs):
    stdout = runs["stdout"]["bitpipe"]
    assert stdout.count("no CUDA GPU: training on the CPU with gloo") == 1
    lines = [line for line in stdout.splitlines() if line.startswith(" iteration")]
    assert len(lines) == ITERS
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "tokens per second:", "lm loss:", "grad norm:", "learning rate:"):
        assert field in lines[-1]
    assert "validation loss at iteration 2" in stdout


@pytest.mark.multirank
def test_bitpipe_checkpoint_resumes_in_other_layouts(runs):
    uninterrupted = runs["records"]["bitpipe"]
    for name in ("resume_tp2_1f1b", "resume_single"):
        resumed = runs["records"][name]
        assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1)), name
        _assert_same(resumed, uninterrupted, range(SAVE_AT + 1, ITERS + 1))


@pytest.mark.multirank
def test_resume_in_the_same_layout_is_exact(runs):
    _assert_same(runs["records"]["resume_single_exact"], runs["records"]["single"], range(SAVE_AT + 1, ITERS + 1), exact=True)


def _metadata(root: Path, iteration: int) -> dict:
    return json.loads((root / f"iter_{iteration:07d}" / "metadata.json").read_text())


@pytest.mark.multirank
def test_checkpoint_holds_one_logical_model(runs):
    import torch

    bitpipe, single = _metadata(runs["ckpt"], SAVE_AT), _metadata(runs["ckpt_single"], SAVE_AT)
    assert (runs["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert bitpipe["parameters"].keys() == single["parameters"].keys()  # each logical parameter once
    assert "output_layer.weight" not in bitpipe["parameters"]  # tied to the embedding
    assert {p["shape"] == single["parameters"][n]["shape"] for n, p in bitpipe["parameters"].items()} == {True}
    assert bitpipe["iteration"] == SAVE_AT and bitpipe["consumed_train_samples"] == 16 * SAVE_AT
    shards = {p["file"] for p in bitpipe["parameters"].values()}
    assert len(shards) == 4  # pipeline A's chunks, one file per pipeline rank
    entry = torch.load(runs["ckpt"] / f"iter_{SAVE_AT:07d}" / sorted(shards)[0], weights_only=True)
    some = next(iter(entry.values()))
    assert {"param", "exp_avg", "exp_avg_sq", "step"} <= some.keys() and some["step"] == SAVE_AT


@pytest.mark.multirank
@pytest.mark.parametrize("layout,iteration", [("optimus", SAVE_AT), ("single", SAVE_AT), ("tp2_1f1b", ITERS)])
def test_every_layout_saves_the_same_logical_model(runs, layout, iteration):
    """Gathering Optimus 2D blocks, 1-D TP blocks (and the tied copy on the last stage, after a
    resume) and BitPipe's replicas gives the same full weights and Adam moments."""
    import torch

    reference = _full_model(runs["ckpt"], iteration)
    other = _full_model(runs["out"] / f"ckpt_{layout}", iteration)
    assert other.keys() == reference.keys()
    for name, entry in reference.items():
        assert other[name]["step"] == entry["step"] == iteration
        for key, atol in (("param", 1e-7), ("exp_avg", 1e-9), ("exp_avg_sq", 1e-12)):
            torch.testing.assert_close(other[name][key], entry[key], rtol=1e-4, atol=atol, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.multirank
def test_checkpoint_of_another_model_is_refused(runs):
    assert runs["refused"] is not None and "--hidden-size is 32 there, 64 here" in runs["refused"]


@pytest.mark.multirank
def test_tensorboard_when_installed(runs):
    tb = runs["out"] / "tb"
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "TensorBoard is not installed" in runs["stdout"]["single"]
        pytest.skip("tensorboard is not installed (pip install tensorboard)")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))


def _write_indexed_dataset(prefix: Path) -> None:
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(60):
        length = int(rng.integers(5, 60))
        builder.add_document(torch.from_numpy(rng.integers(0, 100, size=length).astype(np.int32)), [length])
    builder.finalize(get_idx_path(str(prefix)))


@pytest.mark.multirank
def test_megatron_indexed_dataset(tmp_path):
    prefix = tmp_path / "tiny_text_document"
    _write_indexed_dataset(prefix)
    log = tmp_path / "log.jsonl"
    data = ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--split", "80,20,0", "--data-cache-path", str(tmp_path / "cache")]
    args = [*MODEL, "--vocab-size", "100", "--train-iters", "2", *data, "--log-json", str(log)]
    assert launch(train_in_process, 1, "gpt", args, timeout=300) == [None]
    logged = records(log)
    assert sorted(logged) == [1, 2] and all(math.isfinite(r["lm_loss"]) for r in logged.values())
    assert "validation_lm_loss" in logged[2]
    assert any(name.endswith("GPTDataset-train-sample_index.npy") for name in os.listdir(tmp_path / "cache"))


@pytest.mark.multirank
def test_bad_flags_fail_on_every_rank_naming_the_flag():
    results = launch(main_in_process, 2, "gpt", [*MODEL, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--bf16"], timeout=120)
    for rank, (status, stderr) in enumerate(results):
        assert status == 2
        assert f"[rank {rank}] error: invalid arguments" in stderr and "--bf16 needs a CUDA GPU" in stderr


@pytest.mark.multirank
def test_a_failing_rank_ends_the_job(tmp_path):
    """Only rank 0 writes --log-json; a path it cannot create kills it after the model was
    built, while rank 1 goes on into the pipeline: the job must still end, with rank 0's error."""
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    result = run_script(2, [*MODEL, "--pipeline-model-parallel-size", "2", "--log-json", str(blocker / "log.jsonl")], timeout=240)
    assert result.returncode != 0
    assert "NotADirectoryError" in result.stderr or "FileExistsError" in result.stderr
