"""Injected faults (``--inject-fault``) on 2 CPU ranks: how the job ends, what it leaves, what it reports.

* ``hang`` and ``crash`` of rank 1 at iteration 2, under torchrun as a user runs the script,
  with ``--distributed-timeout-minutes 0.15`` (9 s): the whole job ends non-zero within the
  timeout plus a small bound after the fault, and stderr holds one watchdog line naming the
  failed rank, the iteration and where rank 0 waited; no process of the job (the crashed
  rank's checkpoint-writer helper included) holds stderr open after torchrun's exit. The
  measured times are printed (``-s`` shows them).
* ``crash`` inside the checkpoint save of iteration 4 (every rank's shards written, the index
  not): the tracker stays on iteration 2, loading iteration 4 stops with the incomplete-save
  message, and the run resumed from the tracker logs the uninterrupted curve bit for bit.
* ``slow`` rank 1 (data-parallel ranks doing the same work): its forward time per iteration
  is in ``--log-json``, and rank 0 logs one straggler line naming it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Tuple

import pytest

from megatron_bitpipe.cpu.launcher import RankFailure, launch

from ..pretrain_support import REPO, assert_same_records, main_in_process, main_status, main_with_output, records

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

TIMEOUT_MIN = 0.15  # 9 s: a legitimate wait of a loaded machine stays below it
#: seconds a job may take to end beyond the timeout: two watchdog polls, its second, torchrun's teardown
BOUND_S = 8.0
MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
]  # fmt: skip
#: the watchdog's timeout of the runs that time how a job ends
TIMEOUT = ["--distributed-timeout-minutes", str(TIMEOUT_MIN)]
PIPELINE = ["--pipeline-model-parallel-size", "2"]
KEYS = ("lm_loss", "grad_norm", "lr", "validation_lm_loss", "consumed_samples")


#: seconds after torchrun's exit by which no process of the job may still hold its output open
OUTPUT_CLOSED_S = 5.0


def torchrun_timed(args: List[str]) -> Tuple[int, List[Tuple[float, str]], float]:
    """``scripts/pretrain_gpt.py args`` on 2 ranks under torchrun: (exit status, stderr lines
    with the time each arrived, the time the job ended). Every process of the job must have
    closed stderr within OUTPUT_CLOSED_S of torchrun's exit (one left running, e.g. a helper of
    a killed rank, would hold a SLURM job step open)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(REPO / "scripts" / "pretrain_gpt.py"), *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True
    )
    lines: List[Tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line.rstrip()) for line in proc.stderr), daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout=300)
        ended = time.monotonic()
        reader.join(timeout=OUTPUT_CLOSED_S)
        assert not reader.is_alive(), f"stderr still open {OUTPUT_CLOSED_S:g} s after torchrun's exit (a process of the job left running)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # any rank torchrun left behind (none should be)
        except ProcessLookupError:
            pass
    reader.join(timeout=30)
    return status, lines, ended


def fault_ended(args: List[str], fault: str) -> Tuple[int, str, float]:
    """Run with ``fault`` on rank 1 at iteration 2: (exit status, the watchdog's line, seconds from the fault to the end)."""
    status, lines, ended = torchrun_timed([*MODEL, *PIPELINE, *TIMEOUT, "--train-iters", "4", *args,
                                           "--inject-fault", fault, "--inject-fault-rank", "1", "--inject-fault-iteration", "2"])  # fmt: skip
    faulted = [t for t, line in lines if line.startswith(f"[rank 1] --inject-fault {fault}")]
    reports = [line for _, line in lines if line.startswith("watchdog:")]
    everything = "\n".join(line for _, line in lines)
    assert faulted and len(reports) == 1, everything[-4000:]
    seconds = ended - faulted[0]
    print(f"\n--inject-fault {fault}: the job ended {seconds:.1f} s after the fault (timeout {60 * TIMEOUT_MIN:g} s)\n{reports[0]}")
    return status, reports[0], seconds


def test_a_hung_rank_ends_the_job_after_the_timeout_with_one_line():
    status, line, seconds = fault_ended([], "hang")
    assert status != 0
    assert "rank 1 hung at iteration 2 (training step)" in line and "outside any communication" in line
    assert "rank 0 at iteration 2 (training step) waited in" in line
    assert 60 * TIMEOUT_MIN - 1.0 <= seconds <= 60 * TIMEOUT_MIN + BOUND_S  # rank 0 may start waiting just before


def test_a_crashed_rank_ends_the_job_at_once_with_one_line(tmp_path):
    # saves from iteration 1 on: no process a save starts may outlive its rank and hold the job's output open
    status, line, seconds = fault_ended(["--save", str(tmp_path / "ckpt"), "--save-interval", "1"], "crash")
    assert status != 0
    assert "rank 1 did not answer" in line and "rank 0 at iteration 2 (training step) waited in" in line
    assert seconds <= BOUND_S  # gloo reports the closed connection at once: no timeout to wait for


def test_a_crash_during_a_save_leaves_the_last_complete_checkpoint_which_resumes_on_the_curve(tmp_path):
    model = [*MODEL, *PIPELINE, "--train-iters", "6"]
    launch(main_status, 2, "gpt", [*model, "--log-json", str(tmp_path / "uninterrupted.jsonl")], timeout=300)
    ckpt, log = tmp_path / "ckpt", tmp_path / "interrupted.jsonl"
    command = [*model, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", "--log-json", str(log)]
    fault = ["--inject-fault", "crash", "--inject-fault-at", "save", "--inject-fault-rank", "1", "--inject-fault-iteration", "4"]
    with pytest.raises(RankFailure):
        launch(main_status, 2, "gpt", [*command, *fault], timeout=300)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    written = set(os.listdir(ckpt / "iter_0000004"))
    assert "metadata.json" not in written and any(name.endswith(".distcp") for name in written), written

    statuses = launch(main_in_process, 2, "gpt", [*command, "--ckpt-step", "4"], timeout=300)
    assert [status for status, _ in statuses] == [1, 1]
    assert "is an incomplete checkpoint: its save never finished" in statuses[0][1]
    assert "the complete ones here are iterations 2" in statuses[0][1]

    assert launch(main_status, 2, "gpt", command, timeout=300) == [0, 0]  # resumes from iteration 2
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert_same_records(records(log), records(tmp_path / "uninterrupted.jsonl"), range(1, 7), KEYS, exact=True)


def test_a_slow_rank_shows_in_the_per_rank_times_and_one_straggler_line(tmp_path):
    log = tmp_path / "slow.jsonl"
    command = [*MODEL, "--train-iters", "6", "--log-json", str(log),
               "--inject-fault", "slow", "--inject-fault-rank", "1", "--inject-fault-sleep", "0.3"]  # fmt: skip
    (status, stdout, _), _ = launch(main_with_output, 2, "gpt", command, timeout=300)
    assert status == 0
    times = [r["forward_ms_per_rank"] for r in records(log).values()]
    assert all(slow >= 300.0 > fast for fast, slow in times), times
    lines = [line for line in stdout.splitlines() if line.startswith(" straggler:")]
    assert len(lines) == 1 and "rank 1 (relative score" in lines[0] and "iterations 1-5" in lines[0], stdout[-3000:]
    assert "forward time per rank (ms, rank 0 first): " in stdout
    print("\n" + "\n".join(line for line in stdout.splitlines() if "iteration        5/" in line or "straggler" in line or "forward time" in line))
