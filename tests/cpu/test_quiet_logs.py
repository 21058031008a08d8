"""A CPU run logs only what concerns the user: no warning of megatron-core's or torch's about
their own code (megatron's read of ``.grad`` of its distributed optimizer's shards, torch's
deprecation of the collectives megatron calls, megatron's CUDA_DEVICE_MAX_CONNECTIONS advice),
each dropped by message and category where it arises; everything else still shows."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from megatron_bitpipe.cpu.compat import CpuDeviceMode

from ..pretrain_support import run_script

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "256", "--train-iters", "1",
        "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]  # fmt: skip


def test_megatron_reading_grad_of_a_view_is_not_reported_but_ours_is():
    from megatron.core.optimizer.optimizer import _zero_grad_group_helper

    view = torch.ones(4, requires_grad=True).view(2, 2)  # what the distributed optimizer zeroes
    with warnings.catch_warnings(record=True) as caught, CpuDeviceMode():
        warnings.simplefilter("always")
        _zero_grad_group_helper([view], set_to_none=True)
        assert caught == []
        view.grad  # noqa: B018 -- the user's own mistake still warns
    assert [str(w.message)[:40] for w in caught] == ["The .grad attribute of a Tensor that is "]


def test_optimus_uses_the_collectives_torch_does_not_deprecate():
    import torch.distributed as dist

    from megatron_bitpipe.optimus import collectives

    if hasattr(dist, "all_gather_single"):
        assert (collectives._ALL_GATHER, collectives._REDUCE_SCATTER) == ("all_gather_single", "reduce_scatter_single")


@pytest.mark.multirank
def test_a_cpu_run_with_tp_and_the_distributed_optimizer_writes_nothing_on_stderr(monkeypatch):
    """2 ranks, TP 2 (megatron's async all-reduce advice) with the distributed optimizer (its
    .grad reads and deprecated collectives): stderr stays empty."""
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # else torchrun notes it
    result = run_script("pretrain_gpt.py", 2, [*TINY, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]
    assert " iteration        1/       1 |" in result.stdout


@pytest.mark.multirank
def test_extracting_a_model_of_a_fused_array_writes_nothing_on_stderr(tmp_path):
    """``scripts/hfta_extract.py`` drops megatron-core's notes as the pretrain scripts do (its
    missing kernels, torch's deprecated checkpoint API): one line on stdout, nothing on stderr."""
    import subprocess
    import sys

    from ..pretrain_support import REPO

    array = run_script("pretrain_gpt.py", 1, [*TINY, "--hfta-models", "2", "--hfta-lr", "1e-3,5e-4", "--save", str(tmp_path / "array")])
    assert array.returncode == 0, array.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "hfta_extract.py"), "--load", str(tmp_path / "array"),
                           "--model", "1", "--save", str(tmp_path / "model1")],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"model 1 of {tmp_path / 'array'} written to {tmp_path / 'model1' / 'iter_0000001'}\n"
