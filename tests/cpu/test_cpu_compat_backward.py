"""The CPU compatibility layer also covers code that runs inside backward."""

from __future__ import annotations

import pytest

import torch

from megatron_bitpipe.cpu.launcher import launch


class _AllocatesOnCurrentDevice(torch.autograd.Function):
    """Like megatron's sequence-parallel gathers: allocates on current_device() in backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        buffer = torch.empty(grad.shape, device=torch.cuda.current_device())
        return buffer.copy_(grad) * 2


def _backward_through_current_device_allocation():
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    x = torch.ones(3, requires_grad=True)
    _AllocatesOnCurrentDevice.apply(x).sum().backward()
    (grad,) = torch.autograd.grad(_AllocatesOnCurrentDevice.apply(x).sum(), x)
    return x.grad.tolist(), grad.tolist()


@pytest.mark.multirank
def test_backward_functions_run_in_device_mode():
    assert launch(_backward_through_current_device_allocation, 1, timeout=60)[0] == (
        [2.0] * 3,
        [2.0] * 3,
    )
