"""Rank-side code shared by the pretrain script tests (GPT and BERT).

Rank bodies for :func:`megatron_bitpipe.cpu.launcher.launch` run the scripts' entry point
(:func:`megatron_bitpipe.training.run_script`), or the loop behind it, on the
launcher's gloo group with the CPU compatibility layer; ``task`` names the script's task
(``"gpt"`` or ``"bert"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]


#: the ``--log-json`` fields in which a run of the scripts must equal its reference (losses,
#: gradient norm, learning rate, validation loss, samples consumed)
CURVE_KEYS = ("lm_loss", "grad_norm", "lr", "validation_lm_loss", "consumed_samples")


def tiny_gpt(iters: int, *, num_layers: int = 8, global_batch_size: int = 16) -> List[str]:
    """The tiny GPT the script tests train: seed-only initial weights, mock data, ``iters``
    iterations, evaluation every 2, every iteration logged."""
    return [
        "--num-layers", str(num_layers), "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", str(global_batch_size), "--vocab-size", "127", "--seed", "1234",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--train-iters", str(iters),
        "--adam-eps", "1e-4",  # bounds Adam's amplification of rounding noise in exactly-zero gradients (key biases)
        "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
    ]  # fmt: skip


class JsonLogs:
    """The ``--log-json`` files of a module's runs, one per run name, under ``out``."""

    def __init__(self, out: Path):
        self.out = out
        self.paths: Dict[str, Path] = {}

    def flags(self, name: str) -> List[str]:
        """``--log-json`` of run ``name``."""
        self.paths[name] = self.out / f"{name}.jsonl"
        return ["--log-json", str(self.paths[name])]

    def records(self) -> Dict[str, Dict[int, dict]]:
        """Every run's iteration records: name -> {iteration: record}."""
        return {name: records(path) for name, path in self.paths.items()}


def make_task(task: str):
    """The script's :class:`~megatron_bitpipe.training.task.PretrainTask`."""
    if task == "gpt":
        from megatron_bitpipe.training.gpt import GPTTask

        return GPTTask()
    from megatron_bitpipe.training.bert import BertTask

    return BertTask()


def run_script(script: str, nproc: int, args: List[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``scripts/<script>`` as a user runs it: ``python`` for one rank, torchrun (free port)
    for more; this checkout first on PYTHONPATH."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [*launcher, str(REPO / "scripts" / script), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def checked(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``result``, asserting it exited 0 (else its output's tails)."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def events(path: Path, event: str) -> List[dict]:
    """The ``--log-json`` objects of one ``event`` (``startup``, ``iteration``, ``summary``), in order."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


def records(path: Path) -> Dict[int, dict]:
    """``--log-json`` iteration objects by iteration."""
    return {r["iteration"]: r for r in events(path, "iteration")}


def assert_same_records(
    actual: Dict[int, dict], expected: Dict[int, dict], iterations: Iterable[int], keys: Sequence[str], exact: bool = False
) -> None:
    """Each ``keys`` value of each iteration logged alike by both runs (present in both or in
    neither), within rtol 1e-5 or, with ``exact``, bit for bit."""
    for it in iterations:
        for key in keys:
            got, want = actual[it].get(key), expected[it].get(key)
            assert (got is None) == (want is None), f"iteration {it} {key}: {got} vs {want}"
            if want is None:
                continue
            if exact:
                assert got == want, f"iteration {it} {key}: {got!r} != {want!r}"
            else:
                assert got == pytest.approx(want, rel=1e-5), f"iteration {it} {key}"


def train_in_process(task: str, argv: List[str]):
    """Rank body: train as the script would (its loop, errors raised rather than reported); the
    CheckpointError message if the checkpoint is refused, else None."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.checkpoint_rules import CheckpointError
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.loop import run_training

    the_task = make_task(task)
    try:
        run_training(the_task, parse_args(the_task, argv), cpu_fallback=enable_cpu_megatron)
    except CheckpointError as error:
        return str(error)
    return None


def main_with_output(task: str, argv: List[str]) -> Tuple[int, str, str]:
    """Rank body: the scripts' entry point; (exit status, stdout, stderr), torch.distributed left alone."""
    import contextlib
    import io

    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import run_script
    from megatron_bitpipe.training.script import ignore_dependency_warnings

    ignore_dependency_warnings()  # as the scripts do
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        the_task = make_task(task)
        status = run_script(the_task, lambda: the_task, argv, cpu_fallback=enable_cpu_megatron)
    if dist.is_initialized():
        dist.barrier()
    return status, stdout.getvalue(), stderr.getvalue()


def main_in_process(task: str, argv: List[str]):
    """Rank body: the scripts' entry point (exit status, stderr), torch.distributed left alone."""
    import contextlib
    import io

    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import run_script
    from megatron_bitpipe.training.script import ignore_dependency_warnings

    ignore_dependency_warnings()  # as the scripts do
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        the_task = make_task(task)
        status = run_script(the_task, lambda: the_task, argv, cpu_fallback=enable_cpu_megatron)
    dist.barrier()  # every rank got here: nobody waits in a collective of the failed run
    return status, stderr.getvalue()


def _plain_tensors(directory: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    stored = dist_checkpointing.load_plain_tensors(directory)  # with the non-tensor entries (objects)
    return {key: value.clone() for key, value in stored.items() if torch.is_tensor(value)}


def checkpoint_tensors(root: Path, iteration: int) -> dict:
    """Every tensor of a distributed checkpoint, whole, by its global key (read by one launched rank)."""
    from megatron_bitpipe.cpu.launcher import launch

    return launch(_plain_tensors, 1, str(root / f"iter_{iteration:07d}"), timeout=300)[0]


def checkpoint_common(root: Path, iteration: int) -> dict:
    """The plain (non-tensor) values of a distributed checkpoint: arguments, iteration, schedule..."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(root / f"iter_{iteration:07d}"))


def main_signalled(task: str, argv: List[str], signal_rank: int, signal_call: int) -> int:
    """Rank body: the scripts' entry point (its exit status); rank ``signal_rank`` sends itself
    SIGUSR1 in its ``signal_call``-th call of the model's forward step, as SLURM's warning
    signal would arrive in the middle of an iteration, on some ranks first. The task's plain
    model kind is replaced, in this process and for this call, by one whose forward step signals."""
    import dataclasses
    import signal

    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import run_script
    from megatron_bitpipe.training.model_registry import REGISTRY, task_kinds

    the_task = make_task(task)
    plain = next(kind for kind in task_kinds(the_task.name) if kind.chosen_when is None)
    calls = [0]

    def signalling(forward_step):
        def signalling_forward_step(*args, **kwargs):
            calls[0] += 1
            if dist.get_rank() == signal_rank and calls[0] == signal_call:
                signal.raise_signal(signal.SIGUSR1)
            return forward_step(*args, **kwargs)

        return signalling_forward_step

    REGISTRY[plain.name] = dataclasses.replace(plain, forward_step=lambda r: signalling(plain.forward_step(r)))
    try:
        return run_script(the_task, lambda: the_task, argv, cpu_fallback=enable_cpu_megatron)
    finally:
        REGISTRY[plain.name] = plain


def main_status(task: str, argv: List[str]) -> int:
    """Rank body: the scripts' entry point, its exit status."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import run_script

    the_task = make_task(task)
    return run_script(the_task, lambda: the_task, argv, cpu_fallback=enable_cpu_megatron)


def checkpoint_objects(root: Path, iteration: int) -> List[str]:
    """The stored keys of a distributed checkpoint's non-tensor entries (e.g. ``rng_state/shard_0.0_2.1``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = load_sharded_metadata(str(root / f"iter_{iteration:07d}"))
    return [key for key, entry in saved.items() if isinstance(entry, ShardedObject)]
