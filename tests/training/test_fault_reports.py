"""What the watchdog, the straggler report and the fault flags say, without processes: the
watchdog's line from ranks' states, where a blocked thread waits, the relative scores, the
fault flags' rules, the first-attempt rule of an injected fault and the message of a checkpoint
whose save never finished."""

from __future__ import annotations

import functools
import sys
import threading
import time
import types

import pytest

from megatron_bitpipe.checkpoint_checks import checkpoint_format, format_problem
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.faults import FaultInjection, job_restart
from megatron_bitpipe.training.straggler import StragglerDetector
from megatron_bitpipe.training.watchdog import RankState, describe_stack, fault_line, process_group_timeout
from megatron_bitpipe.megatron_args import BitPipeConfigError

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "127", "--lr", "1e-3", "--train-iters", "4"]  # fmt: skip


def test_the_line_names_the_hung_rank_the_iteration_and_where_the_others_waited():
    states = {
        0: RankState(0, 3, "training step", True, "`work.wait()` in _take_input (megatron_bitpipe/execution/executor.py:391)", 6.2),
        2: RankState(2, 3, "training step", False, "_fail (megatron_bitpipe/training/faults.py:150)", 6.9),
        3: RankState(3, 3, "training step", True, "torch.distributed all_reduce called from reduce_losses (megatron_bitpipe/training/mode.py:114)", 6.1),
    }
    line = fault_line(states, 4, 6.0)
    assert "\n" not in line
    assert line.startswith("watchdog: job ended at iteration 3: rank 1 did not answer")
    assert "rank 2 hung at iteration 3 (training step): 6.9 s outside any communication" in line
    assert "rank 0 at iteration 3 (training step) waited in `work.wait()` in _take_input" in line
    assert "rank 3 at iteration 3 (training step) waited in torch.distributed all_reduce" in line
    assert line.endswith("--distributed-timeout-minutes 0.1 (6 s)")


def test_every_rank_waiting_is_reported_as_a_deadlock():
    states = {r: RankState(r, 1, "evaluation", True, f"op{r}", 7.0) for r in range(2)}
    assert "every rank waits in a communication (a deadlock" in fault_line(states, 2, 6.0)


def test_a_thread_blocked_on_a_wait_or_the_device_is_waiting_and_a_sleeping_one_is_not():
    def blocked_in_wait():
        work = types.SimpleNamespace(wait=functools.partial(time.sleep, 0.6))  # a C wait, as a request's is
        work.wait()

    def blocked_on_the_device():
        loss = types.SimpleNamespace(item=functools.partial(time.sleep, 0.6))  # NCCL: the host waits for the GPU
        loss.item()

    def asleep():
        time.sleep(0.6)

    for body, waiting in ((blocked_in_wait, True), (blocked_on_the_device, True), (asleep, False)):
        thread = threading.Thread(target=body)
        thread.start()
        time.sleep(0.2)
        found, where = describe_stack(sys._current_frames()[thread.ident])
        thread.join()
        assert found is waiting, where
        assert body.__name__ in where


def test_the_process_group_times_out_after_the_watchdog_reported():
    assert process_group_timeout(6.0).total_seconds() > 6.0 + 2 * 0.6 + 1.0
    assert process_group_timeout(600.0).total_seconds() < 600.0 + 30.0


def test_a_consistently_slower_rank_is_one_straggler_line_and_its_recovery_another():
    detector = StragglerDetector(window=3, threshold=0.7)
    lines = [detector.add(i, [10.0, 10.0, 30.0, 10.0]) for i in range(1, 5)]
    assert lines[:2] == [None, None] and lines[3] is None
    assert "rank 2 (relative score 0.33: 3.0x the median rank's forward time) in each of iterations 1-3" in lines[2]
    assert "straggler: none after iteration 5" in detector.add(5, [10.0, 10.0, 10.0, 10.0])
    assert detector.add(6, [10.0, 10.0, 30.0, 10.0]) is None  # slower again: not yet in a whole window


def test_a_rank_slower_in_only_some_iterations_is_no_straggler():
    detector = StragglerDetector(window=3, threshold=0.7)
    assert [detector.add(i, t) for i, t in enumerate([[10, 30], [10, 30], [10, 10], [10, 30]], 1)] == [None] * 4


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--inject-fault", "hang", "--inject-fault-rank", "2"], "--inject-fault-rank 2 must be a rank of the job (0 to 1)"),
        (["--inject-fault", "crash", "--inject-fault-iteration", "5"], "--inject-fault-iteration 5 must be in 1..--train-iters 4"),
        (["--inject-fault", "crash", "--inject-fault-at", "save"], "--inject-fault-at save: iteration 1 saves no checkpoint"),
        (["--inject-fault", "slow", "--inject-fault-at", "save", "--save", "x", "--inject-fault-iteration", "4"], "takes hang or crash, not slow"),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be positive"),
    ],
)
def test_fault_flags_are_checked_before_any_communication(flags, problem):
    with pytest.raises(BitPipeConfigError, match=problem.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        parse_args(None, [*MODEL, *flags], world_size=2, cuda_available=False)


def test_a_save_point_at_a_save_iteration_is_accepted():
    args = parse_args(None, [*MODEL, "--save", "x", "--save-interval", "2", "--inject-fault", "crash", "--inject-fault-at", "save",
                             "--inject-fault-iteration", "2", "--distributed-timeout-minutes", "0.05"], world_size=2, cuda_available=False)  # fmt: skip
    assert args.inject_fault_at == "save" and args.distributed_timeout_minutes == 0.05


@pytest.mark.parametrize(
    "environ, restart",
    [
        ({}, None),
        ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, None),
        ({"SLURM_RESTART_COUNT": "2"}, "SLURM_RESTART_COUNT=2"),
        ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "1"}, "TORCHELASTIC_RESTART_COUNT=1"),
    ],
)
def test_a_restart_count_above_zero_names_the_restart(environ, restart):
    assert job_restart(environ) == restart


def test_a_fault_fires_on_the_first_attempt_only_and_its_rank_says_when_it_is_skipped(capsys):
    args = parse_args(None, [*MODEL, "--inject-fault", "crash", "--inject-fault-rank", "1", "--inject-fault-iteration", "3"],
                      world_size=2, cuda_available=False)  # fmt: skip
    assert FaultInjection.from_args(args, 1, None) == FaultInjection("crash", 3, "step", 1.0)
    assert FaultInjection.from_args(args, 0, "SLURM_RESTART_COUNT=1") == FaultInjection()  # not its rank: silent
    assert capsys.readouterr().err == ""
    assert FaultInjection.from_args(args, 1, "SLURM_RESTART_COUNT=1") == FaultInjection()
    assert capsys.readouterr().err == (
        "[rank 1] --inject-fault crash skipped: the job was restarted (SLURM_RESTART_COUNT=1); "
        "an injected fault fires on the job's first attempt only\n"
    )


def test_a_checkpoint_whose_save_never_finished_is_named_incomplete(tmp_path):
    for iteration, files in ((2, ["common.pt", "__0_0.distcp", "metadata.json", ".metadata"]), (4, ["common.pt", "__0_0.distcp"])):
        directory = tmp_path / f"iter_{iteration:07d}"
        directory.mkdir()
        for name in files:
            (directory / name).write_text("{}" if name == "metadata.json" else "")
    incomplete = str(tmp_path / "iter_0000004")
    problem = format_problem(incomplete, checkpoint_format(incomplete))
    assert "is an incomplete checkpoint: its save never finished" in problem
    assert "the complete ones here are iterations 2" in problem
