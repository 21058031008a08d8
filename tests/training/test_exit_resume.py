"""Megatron-LM's early exits in our training loop, and resuming from the checkpoint they save.

* ``--exit-signal-handler --exit-signal SIGUSR1``, BitPipe on 2 ranks: only rank 1 receives the
  signal, in the middle of an iteration; every rank finishes that iteration, the job saves a
  checkpoint and exits 0. The same command run again (what a requeued SLURM job does) resumes
  from it and logs the rest of the uninterrupted run's curve bit for bit: losses, grad norms,
  learning rates, validation losses, consumed samples (same samples, same RNG states).
* ``--exit-duration-in-mins`` (stops after the first iteration that ends past the budget) and
  ``--exit-interval`` (after each multiple), in one process: both save and exit 0, and three
  runs pieced together log the uninterrupted curve bit for bit.

The SLURM side (the warning signal reaching the training processes, the requeue) is
``tests/training/test_slurm.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from ..pretrain_support import assert_same_records, main_signalled, main_status, records

ITERS = 6
MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
]  # fmt: skip
BITPIPE = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
KEYS = ("lm_loss", "grad_norm", "lr", "validation_lm_loss", "consumed_samples", "loss_scale", "skipped")

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]


def tracker(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


def logged_iterations(path: Path) -> List[int]:
    return [r["iteration"] for r in records(path).values()] if path.exists() else []


def test_signal_on_one_rank_saves_exits_0_and_the_resumed_run_continues_the_curve(tmp_path):
    launch(main_status, 2, "gpt", [*MODEL, *BITPIPE, "--log-json", str(tmp_path / "uninterrupted.jsonl")], timeout=300)
    ckpt, log = tmp_path / "ckpt", tmp_path / "interrupted.jsonl"
    command = [*MODEL, *BITPIPE, "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log),
               "--exit-signal-handler", "--exit-signal", "SIGUSR1"]  # fmt: skip
    # rank 1 runs 4 chunks x 4 micro-batches = 16 forward steps per iteration: call 20 is in iteration 2
    statuses = launch(main_signalled, 2, "gpt", command, 1, 20, timeout=300)
    assert statuses == [0, 0]
    assert logged_iterations(log) == [1, 2] and tracker(ckpt) == 2

    assert launch(main_status, 2, "gpt", command, timeout=300) == [0, 0]  # the requeued job
    assert logged_iterations(log) == list(range(1, ITERS + 1)) and tracker(ckpt) == ITERS
    assert_same_records(records(log), records(tmp_path / "uninterrupted.jsonl"), range(1, ITERS + 1), KEYS, exact=True)


def test_exit_duration_and_exit_interval_save_exit_0_and_resume_on_the_curve(tmp_path):
    launch(main_status, 1, "gpt", [*MODEL, "--log-json", str(tmp_path / "uninterrupted.jsonl")], timeout=300)
    ckpt, log = tmp_path / "ckpt", tmp_path / "pieces.jsonl"
    command = [*MODEL, "--save", str(ckpt), "--load", str(ckpt), "--log-json", str(log)]
    assert launch(main_status, 1, "gpt", [*command, "--exit-duration-in-mins", "1e-9"], timeout=300) == [0]
    assert logged_iterations(log) == [1] and tracker(ckpt) == 1
    assert launch(main_status, 1, "gpt", [*command, "--exit-interval", "4"], timeout=300) == [0]
    assert logged_iterations(log) == [1, 2, 3, 4] and tracker(ckpt) == 4
    assert launch(main_status, 1, "gpt", command, timeout=300) == [0]
    assert logged_iterations(log) == list(range(1, ITERS + 1)) and tracker(ckpt) == ITERS
    assert_same_records(records(log), records(tmp_path / "uninterrupted.jsonl"), range(1, ITERS + 1), KEYS, exact=True)
