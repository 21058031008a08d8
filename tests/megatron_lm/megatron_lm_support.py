"""Running Megatron-LM's own scripts on CPU ranks for the tests (needs ``MEGATRON_LM_PATH``).

:func:`fake_checkout` makes a directory that only looks like a checkout (for error tests).
:func:`checkout_or_skip` gives the checkout or skips with the reason (no ``MEGATRON_LM_PATH``,
or a module Megatron-LM's training code imports is missing). :func:`torchrun` runs
``torchrun --standalone --nproc-per-node N -m megatron_bitpipe.cpu.megatron_lm SCRIPT
FLAGS`` and parses what Megatron-LM's last rank prints: the training loss and grad norm of
every iteration and every validation / test loss.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
# Imported unconditionally by Megatron-LM's megatron/training (core_v0.16.1, core_v0.19.0);
# pybind11 builds its dataset helpers.
MEGATRON_LM_DEPENDENCIES = ("six", "regex", "yaml", "pydantic", "einops", "triton", "pybind11")

# A tiny GPT on mock data: 8 layers (2 x 4 BitPipe stages), global batch of 8 micro-batches,
# 4 iterations with evaluation after iterations 2 and 4; no dropout, so every layout and
# schedule computes the same numbers. The vocabulary pads to 256 entries at tensor-parallel
# sizes 1 and 2 at both tags (NullTokenizer has --vocab-size + 1 entries at core_v0.16.1 and
# --vocab-size at core_v0.19.0; megatron pads to a multiple of 128 x tensor-parallel size).
TINY_GPT = (
    "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 200 --hidden-dropout 0 --attention-dropout 0 "
    "--log-interval 1 --eval-interval 2 --eval-iters 1"
).split()

_TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|.*?\| grad norm: ([0-9.]+) \|")
_AUX = re.compile(r"\| (load_balancing_loss|seq_load_balancing_loss|z_loss): ([0-9.E+-]+) ")
_STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.E+-]+) \|.*?number of skipped iterations: +(\d+) \|")
_EVAL = re.compile(r"validation loss at iteration (\d+)( on validation set| on test set)? \| lm loss value: ([0-9.E+-]+) \|")


def fake_checkout(root: Path, version=(0, 16, 1)) -> Path:
    """A directory that looks like a Megatron-LM checkout of megatron-core ``version``
    (``megatron.training`` is a regular package, as in a checkout: it shadows the one the
    megatron-core 0.19 wheel installs)."""
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "training" / "__init__.py").write_text("")
    major, minor, patch = version
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    (root / "pretrain_gpt.py").write_text("raise SystemExit('not run in these tests')\n")
    return root


def checkout_or_skip() -> Path:
    """The Megatron-LM checkout named by ``MEGATRON_LM_PATH``; skip the test without one."""
    root = os.environ.get("MEGATRON_LM_PATH")
    if not root:
        pytest.skip("MEGATRON_LM_PATH is not set: point it at a Megatron-LM checkout (tag core_v0.16.1 or core_v0.19.0) to run these tests")
    missing = [name for name in MEGATRON_LM_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"Megatron-LM's training code needs {', '.join(missing)}: pip install {' '.join(missing).replace('yaml', 'pyyaml')}")
    return Path(root)


@dataclass
class Run:
    """What one torchrun printed: ``losses[i]`` and ``grad_norms[i]`` of iteration ``i``,
    ``aux_losses[i]`` its mixture-of-experts auxiliary losses by Megatron-LM's log name (none for
    a dense model), ``loss_scales[i]`` its (loss scale, skipped iterations) as logged (every
    iteration, skipped ones too), and ``evals[(i, split)]`` the loss evaluated after iteration ``i`` (split ``""``
    during training, ``"validation"`` / ``"test"`` at the end)."""

    returncode: int
    output: str
    losses: Dict[int, float] = field(default_factory=dict)
    grad_norms: Dict[int, float] = field(default_factory=dict)
    aux_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    loss_scales: Dict[int, Tuple[float, int]] = field(default_factory=dict)
    evals: Dict[Tuple[int, str], float] = field(default_factory=dict)


def checkpoint_writer_problem(root: Path):
    """Why Megatron-LM's checkpoint saving cannot run from the checkout ``root`` here (None:
    it can). megatron-core's distributed-checkpoint writer starts its helper processes with
    ``spawn``, which re-imports the script in them without the CPU entry point's stand-ins;
    at core_v0.19.0 the script's imports need ``typing.override`` of Python 3.12."""
    from megatron_bitpipe.megatron_lm.checkout import find_checkout

    if find_checkout(root).tag == "core_v0.19.0" and sys.version_info < (3, 12):
        return "core_v0.19.0 saves checkpoints only on Python >= 3.12 (its checkpoint writer re-imports pretrain_gpt.py)"
    return None


def torchrun(script: Path, nproc: int, flags: List[str], cwd: Path, timeout: int = 600) -> Run:
    """Run ``script`` through the CPU entry point on ``nproc`` gloo ranks."""
    from megatron_bitpipe.cpu.megatron_lm import CPU_FLAGS

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "megatron_bitpipe.cpu.megatron_lm", str(script), *CPU_FLAGS, *flags,
    ]
    # its own session: on a timeout the ranks go with torchrun (killed alone, it leaves them running)
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # any rank torchrun left behind (none should be)
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    run = Run(result.returncode, result.stdout + result.stderr)
    for match in _TRAIN.finditer(result.stdout):
        run.losses[int(match.group(1))] = float(match.group(2))
        run.grad_norms[int(match.group(1))] = float(match.group(3))
        line = result.stdout[match.start() : result.stdout.find("\n", match.start())]
        run.aux_losses[int(match.group(1))] = {name: float(value) for name, value in _AUX.findall(line)}
    for i, scale, skipped in _STEP.findall(result.stdout):
        run.loss_scales[int(i)] = (float(scale), int(skipped))
    for match in _EVAL.finditer(result.stdout):
        split = (match.group(2) or "").replace(" on ", "").replace(" set", "")
        run.evals[(int(match.group(1)), split)] = float(match.group(3))
    return run


def write_indexed_dataset(prefix: Path, documents: int = 200, vocab: int = 100) -> None:
    """A Megatron indexed dataset (``prefix.bin``/``.idx``) of ``documents`` documents of 5-59
    tokens below ``vocab``, each an arithmetic progression (learnable), fixed by the seed 0."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        length, start, step = int(rng.integers(5, 60)), int(rng.integers(0, vocab)), int(rng.integers(1, 4))
        tokens = (start + step * np.arange(length)) % vocab
        builder.add_document(torch.from_numpy(tokens.astype(np.int32)), [length])
    builder.finalize(get_idx_path(str(prefix)))
