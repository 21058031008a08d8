"""scripts/pretrain_gpt.py end to end on CPU ranks (gloo).

* The same tiny GPT (seed-only initial weights, mock data) trained with BitPipe on 4 ranks,
  megatron-core's interleaved schedule on 2, Optimus 2D (TP 4) and a single process logs the
  same per-iteration losses, grad norms, learning rates and validation losses (rtol 1e-5,
  from ``--log-json``), and saves the same distributed checkpoint (every tensor once, under
  the single-process model's names: weights and Adam moments). The BitPipe, interleaved and
  single-process runs are the script run through torchrun / python.
* A checkpoint saved by the BitPipe run at iteration 2 (both replicas written once)
  continues under megatron-core's 1F1B with TP 2 (sequence parallel) x PP 2
  and in a single process exactly like the uninterrupted run (and the TP 2 run saves BitPipe's iteration-4
  checkpoint again); a single process resumed from its own checkpoint repeats its run bit for
  bit; a checkpoint of another model shape is refused naming the flag.
* Bad flags fail on every rank before any communication, naming the flag; a failure on one
  rank ends the whole job; a Megatron indexed dataset built here trains.

One torchrun per layout serves all checks; resumed runs and the bad-flag check use the
in-process launcher (same code, no interpreter start-up per rank).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from .. import pretrain_support
from ..pretrain_support import (
    CURVE_KEYS,
    JsonLogs,
    assert_same_records,
    checked,
    checkpoint_common,
    checkpoint_tensors,
    events,
    main_in_process,
    records,
    tiny_gpt,
    train_in_process,
)

ITERS, SAVE_AT = 4, 2
MODEL = tiny_gpt(ITERS)

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]


def run_script(nproc: int, args: List[str], timeout: float = 300):
    return pretrain_support.run_script("pretrain_gpt.py", nproc, args, timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every training run, once: name -> {iteration: JSON record} (and the stdout of one)."""
    out = tmp_path_factory.mktemp("pretrain")
    ckpt_bitpipe, ckpt_single = out / "ckpt_bitpipe", out / "ckpt_single"  # (other layouts: out / f"ckpt_{name}")
    logs = JsonLogs(out)
    log = logs.flags

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
    records_by_run = logs.records()
    return dict(records=records_by_run, stdout=stdout, out=out, ckpt=ckpt_bitpipe, ckpt_single=ckpt_single, refused=refused)


def _assert_same(actual: Dict[int, dict], expected: Dict[int, dict], iterations, exact: bool = False):
    assert_same_records(actual, expected, iterations, CURVE_KEYS, exact)


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
        for key in ("iteration", "consumed_samples", "lm_loss", "grad_norm", "lr", "tokens_per_second", "elapsed_ms", "timestamp", "max_memory_mib"):
            assert key in record and record[key] is not None, key
        assert record["consumed_samples"] == 16 * it
        assert math.isfinite(record["lm_loss"]) and record["tokens_per_second"] > 0
        assert record["nan"] is False and record["tflops_per_device"] is None  # no GPU here
        assert ("validation_lm_loss" in record) == (it % 2 == 0)
    (startup,) = events(runs["out"] / "bitpipe.jsonl", "startup")
    assert startup["schedule"] == "bitpipe" and startup["pipeline_model_parallel_size"] == 4
    assert [r["pp_rank"] for r in startup["ranks"]] == [0, 1, 2, 3] and all(r["parameters"] > 0 for r in startup["ranks"])
    (summary,) = events(runs["out"] / "bitpipe.jsonl", "summary")
    assert summary["iterations"] == summary["iterations_this_run"] == ITERS
    assert summary["validation_lm_loss"] == runs["records"]["bitpipe"][ITERS]["validation_lm_loss"]  # evaluated at the last iteration
    (split_startup,) = events(runs["out"] / "bitpipe_split.jsonl", "startup")
    assert split_startup["schedule"] == "bitpipe+split-backward"


@pytest.mark.multirank
def test_megatron_style_progress_lines(runs):
    stdout = runs["stdout"]["bitpipe"]
    assert stdout.count("no CUDA GPU: training on the CPU with gloo") == 1
    assert "gpt: bitpipe schedule, TP 1 (1d) x PP 4 x DP 1" in stdout
    assert stdout.count(" > number of parameters on (tensor, pipeline) model parallel rank (0, ") == 4
    assert " > memory after setup (MiB, peak resident set size of the process): max " in stdout
    lines = [line for line in stdout.splitlines() if re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration ", line)]
    assert len(lines) == ITERS
    for field in (
        "consumed samples:", "elapsed time per iteration (ms):", "tokens per second:", "lm loss:", "grad norm:", "learning rate:",
        "number of skipped iterations:   0", "number of nan iterations:   0", "max memory (MiB):",
    ):  # fmt: skip
        assert field in lines[-1]
    assert "loss scale" not in lines[-1] and "TFLOP/s" not in lines[-1]  # fp32; no GPU
    assert "validation loss at iteration 2" in stdout
    assert f" training summary | iterations: {ITERS} ({ITERS} in this run) | total time (s): " in stdout


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


def test_checkpoint_holds_each_tensor_once(runs):
    bitpipe, single = checkpoint_tensors(runs["ckpt"], SAVE_AT), checkpoint_tensors(runs["ckpt_single"], SAVE_AT)
    assert (runs["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert bitpipe.keys() == single.keys()  # both replicas written as one model
    assert not any(key.endswith("output_layer.weight") for key in bitpipe)  # tied to the embedding
    assert {key: tuple(t.shape) for key, t in bitpipe.items()} == {key: tuple(t.shape) for key, t in single.items()}
    assert {"optimizer.state.exp_avg.embedding.word_embeddings.weight", "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"} <= bitpipe.keys()
    common = checkpoint_common(runs["ckpt"], SAVE_AT)
    assert common["iteration"] == SAVE_AT and common["args"].consumed_train_samples == 16 * SAVE_AT
    assert int(common["optimizer"]["state"]["common_step"]) == SAVE_AT


@pytest.mark.multirank
@pytest.mark.parametrize("layout,iteration", [("optimus", SAVE_AT), ("single", SAVE_AT), ("tp2_1f1b", ITERS)])
def test_every_layout_saves_the_same_model(runs, layout, iteration):
    """Optimus 2D blocks, 1-D TP blocks (and the tied copy on the last stage, after a resume)
    and BitPipe's replicas are saved as the same full weights and Adam moments.

    The moments are sums of fp32 gradients added up in a different order by each layout: their
    rounding error scales with the tensor's magnitude (measured: up to 8e-7 of its largest
    element), so an element that cancels to near zero is compared against 1e-5 of that."""
    import torch

    reference = checkpoint_tensors(runs["ckpt"], iteration)
    other = checkpoint_tensors(runs["out"] / f"ckpt_{layout}", iteration)
    assert other.keys() == reference.keys()
    for name, tensor in reference.items():
        atol = 1e-5 * tensor.abs().max().item() if "exp_avg" in name else 1e-7
        torch.testing.assert_close(other[name], tensor, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.multirank
def test_checkpoint_of_another_model_is_refused(runs):
    assert runs["refused"] is not None and "--hidden-size is 32 there, 64 here" in runs["refused"]
    assert f"{runs['ckpt']}/iter_{ITERS:07d} holds a different model" in runs["refused"]


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
def test_bad_flags_fail_on_every_rank_reported_once_naming_the_flag():
    results = launch(main_in_process, 2, "gpt", [*MODEL, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--bf16"], timeout=120)
    assert [status for status, _ in results] == [2, 2]
    (_, rank0), (_, rank1) = results
    assert "error: invalid arguments" in rank0 and "--bf16 needs a CUDA GPU" in rank0
    assert rank1 == ""


@pytest.mark.multirank
def test_a_failing_rank_ends_the_job(tmp_path):
    """Only rank 0 writes --log-json; a path it cannot create kills it after the model was
    built, while rank 1 goes on into the pipeline: the job must still end, with rank 0's error."""
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    result = run_script(2, [*MODEL, "--pipeline-model-parallel-size", "2", "--log-json", str(blocker / "log.jsonl")], timeout=240)
    assert result.returncode != 0
    assert "NotADirectoryError" in result.stderr or "FileExistsError" in result.stderr
