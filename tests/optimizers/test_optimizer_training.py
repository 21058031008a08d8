"""scripts/pretrain_gpt.py with --optimizer lamb, schedulefree_adamw and onebit_lamb, and
--lr-decay-style rex, on CPU ranks (gloo): equivalence and exact resumption.

* LAMB (with REX decay): TP 2 and Optimus 2D (TP 4) log the losses, grad norms, learning
  rates and validation losses of the single process and save the same weights and
  moments (distributed checkpoints) — the trust ratios are computed over whole logical parameters; the logged learning
  rates follow REX.
* Schedule-Free AdamW: BitPipe over 4 pipeline ranks and data parallelism 2 train like a
  single process (losses; validation losses and saved weights are the averaged iterate x);
  a single process resumed from its iteration-2 checkpoint repeats its run bit for bit.
* 1-bit LAMB: BitPipe over 2 pipeline ranks x data parallelism 2 keeps both weight replicas
  and all data-parallel copies bitwise identical through the compression stage, and resumed in
  the same layout from its iteration-3 checkpoint (compression stage; coefficients and error
  feedback restored from each rank's entry) repeats its run bit for bit.

One launch per run (the in-process launcher), shared by all checks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.optimizers import rex_coefficient

from ..pretrain_support import CURVE_KEYS, assert_same_records, checkpoint_objects, checkpoint_tensors, make_task, records, train_in_process

ITERS = 5
MODEL = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "127", "--seed", "1234",
    "--lr", "2e-3", "--min-lr", "1e-4", "--clip-grad", "1.0", "--train-iters", str(ITERS), "--adam-eps", "1e-4",
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
]  # fmt: skip
LAMB = ["--optimizer", "lamb", "--lr-decay-style", "rex", "--lr-warmup-iters", "1", "--weight-decay", "0.1"]
SF = ["--optimizer", "schedulefree_adamw", "--lr-decay-style", "constant", "--lr-warmup-iters", "2", "--weight-decay", "0.1"]
ONEBIT = ["--optimizer", "onebit_lamb", "--onebit-freeze-iters", "2", "--lr-decay-style", "constant", "--weight-decay", "0.1"]

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1800)]


def _train_and_compare_replicas(argv: List[str]) -> float:
    """Rank body: train as the script does, then the largest difference between any weight
    and its copies on the other ranks of its gradient-sync group (replicas x data parallel)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution.replicas import max_replica_difference
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.exit_conditions import ExitConditions
    from megatron_bitpipe.training.loop import Trainer
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings

    task = make_task("gpt")
    args = parse_args(task, argv)
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    trainer = Trainer(task, args, run, tokenizer, distributed.initialize(run, enable_cpu_megatron))
    with ExitConditions(run.exits, time.time()) as exits:
        trainer.train(exits)
    return max_replica_difference(trainer.model.chunks, trainer.groups)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("optimizers")
    logs: Dict[str, Path] = {}

    def run(name: str, nproc: int, flags: List[str], body=train_in_process):
        logs[name] = out / f"{name}.jsonl"
        argv = [*MODEL, *flags, "--save", str(out / f"ckpt_{name}"), "--save-interval", "3", "--log-json", str(logs[name])]
        return launch(body, nproc, *(("gpt",) if body is train_in_process else ()), argv, timeout=600)

    run("lamb_single", 1, LAMB)
    run("lamb_tp2", 2, [*LAMB, "--tensor-model-parallel-size", "2"])
    run("lamb_optimus", 4, [*LAMB, "--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "optimus2d"])
    run("sf_single", 1, SF)
    run("sf_bitpipe", 4, [*SF, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4"])
    run("sf_dp2", 2, SF)
    run("sf_resumed", 1, [*SF, "--load", str(out / "ckpt_sf_single"), "--ckpt-step", "3"])
    onebit = [*ONEBIT, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
    replicas = run("onebit", 4, onebit, body=_train_and_compare_replicas)
    run("onebit_resumed", 4, [*onebit, "--load", str(out / "ckpt_onebit"), "--ckpt-step", "3"])
    return dict(records={name: records(path) for name, path in logs.items()}, out=out, replicas=replicas)


def _weights(root: Path, iteration: int) -> dict:
    """{global name: {"param": weight, state key: tensor}} of a distributed checkpoint."""
    tensors = checkpoint_tensors(root, iteration)
    prefix = "optimizer.state."
    model = {name: {"param": tensor} for name, tensor in tensors.items() if not name.startswith("optimizer.")}
    for key, tensor in tensors.items():
        if key.startswith(prefix):
            state, name = key[len(prefix):].split(".", 1)
            model[name][state] = tensor
    return model


@pytest.mark.parametrize("layout", ["lamb_tp2", "lamb_optimus"])
def test_lamb_tensor_parallel_equals_single_process(runs, layout):
    single = runs["records"]["lamb_single"]
    assert_same_records(runs["records"][layout], single, range(1, ITERS + 1), CURVE_KEYS)
    assert single[ITERS]["lm_loss"] != single[1]["lm_loss"]  # the weights move (5 steps need not lower the loss)
    reference, other = _weights(runs["out"] / "ckpt_lamb_single", ITERS), _weights(runs["out"] / f"ckpt_{layout}", ITERS)
    for name, entry in reference.items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(other[name][key], entry[key], rtol=1e-4, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")


def test_lamb_run_follows_rex(runs):
    single = runs["records"]["lamb_single"]
    for it in range(2, ITERS + 1):  # warm-up: iteration 1; decay over iterations 2..5 (lr of the step taken)
        z = (it - 2) / (ITERS - 1)
        assert single[it]["lr"] == pytest.approx(1e-4 + (2e-3 - 1e-4) * rex_coefficient(z, 0.5), rel=1e-9)


@pytest.mark.parametrize("layout", ["sf_bitpipe", "sf_dp2"])
def test_schedule_free_layouts_equal_single_process(runs, layout):
    single = runs["records"]["sf_single"]
    assert_same_records(runs["records"][layout], single, range(1, ITERS + 1), CURVE_KEYS)
    assert [single[it]["lr"] for it in (1, 2, 3)] == pytest.approx([1e-3, 2e-3, 2e-3])  # its own warm-up
    reference, other = _weights(runs["out"] / "ckpt_sf_single", ITERS), _weights(runs["out"] / f"ckpt_{layout}", ITERS)
    for name, entry in reference.items():
        for key in ("param", "z", "y", "exp_avg_sq"):
            torch.testing.assert_close(other[name][key], entry[key], rtol=1e-4, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")


def test_schedule_free_checkpoint_holds_averaged_weights_and_resumes_exactly(runs):
    entry = next(iter(_weights(runs["out"] / "ckpt_sf_single", 3).values()))
    assert {"param", "z", "y", "exp_avg_sq"} <= entry.keys() and not torch.equal(entry["param"], entry["y"])
    assert_same_records(runs["records"]["sf_resumed"], runs["records"]["sf_single"], range(4, ITERS + 1), CURVE_KEYS, exact=True)


def test_onebit_lamb_keeps_replicas_identical(runs):
    assert runs["replicas"] == [0.0] * 4
    onebit = runs["records"]["onebit"]
    assert onebit[ITERS]["lm_loss"] != onebit[1]["lm_loss"]  # the weights move (5 steps need not lower the loss)


def test_onebit_lamb_resumes_exactly_in_the_same_layout(runs):
    entry = next(iter(_weights(runs["out"] / "ckpt_onebit", 3).values()))
    assert {"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"} <= entry.keys()
    per_rank = checkpoint_objects(runs["out"] / "ckpt_onebit", 3)  # coefficients and error feedback of each rank
    for key in ("optimizer.onebit_lamb.coefficients", "optimizer.onebit_lamb.error_feedback"):
        assert sorted(k for k in per_rank if k.startswith(f"{key}/")) == [f"{key}/shard_{r}_4" for r in range(4)]
    assert_same_records(runs["records"]["onebit_resumed"], runs["records"]["onebit"], range(4, ITERS + 1), CURVE_KEYS, exact=True)
