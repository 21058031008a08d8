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

from .pretrain_support import run_script

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
