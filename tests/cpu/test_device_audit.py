"""The device audit fails a CPU run where a GPU run refuses to mix host and device tensors.

In-process tests of CUDA's rules (the audit as a context, no process-wide patches) and
gloo-rank tests that put back the two bugs the first GPU run found — BitPipe's token counter
made on the host and added into by the device's count, Optimus 2D gathering CPU-initialised
weights over NCCL — and show that the fixed code passes.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_bitpipe.cpu.compat import CpuDeviceMode
from megatron_bitpipe.cpu.device_audit import ENV, DeviceAudit, DeviceMixError
from megatron_bitpipe.cpu.launcher import RankFailure, launch

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def audit():
    with DeviceAudit() as mode, CpuDeviceMode(mode):
        yield mode


def test_mixing_a_host_tensor_into_a_device_operation_fails(audit):
    x = torch.ones(2, 3, device="cuda")
    with pytest.raises(DeviceMixError, match=r"aten\.add\.Tensor at .*test_device_audit\.py:\d+ .*reads `other` \(\[3\] float32\) on the host"):
        x + torch.ones(3)
    with pytest.raises(DeviceMixError, match=r"aten\.mm\.default"):
        torch.ones(4, 2) @ x


def test_cpu_scalars_copies_and_host_indices_are_allowed(audit):
    x = torch.ones(2, 3, device="cuda")
    y = x * torch.tensor(2.0)  # a 0-dim host tensor read by a device kernel
    assert audit.on_device(y)
    x.copy_(torch.zeros(2, 3))  # copies cross devices
    assert audit.on_device(x[torch.tensor([1])])  # host indices
    host = x.cpu()
    assert not audit.on_device(host) and audit.on_device(x)  # .cpu() leaves its source on the device
    host + torch.ones(3)
    assert audit.on_device(torch.ones(3).cuda() + 1)


def test_writing_into_a_host_tensor_fails_even_when_0_dim(audit):
    counter = torch.zeros((), dtype=torch.int)
    with pytest.raises(DeviceMixError, match=r"aten\.add_\.Tensor .*writes into `self` \(\[\] int32\) on the host while `other` is on the device"):
        counter += torch.ones((), dtype=torch.int, device="cuda")


def test_device_tensors_do_not_convert_to_numpy(audit):
    with pytest.raises(DeviceMixError, match="Tensor.numpy"):
        torch.ones(2, device="cuda").numpy()
    torch.ones(2).numpy()


def test_dispatcher_split_sizes_reach_numpy_through_a_host_copy(audit):
    """The all-to-all dispatcher's split sizes, on the device, become numpy through the CPU
    layer's ``maybe_move_tensor_to_cpu`` as on a GPU (a host copy first); the device tensor
    itself still refuses to convert."""
    import numpy as np

    from megatron_bitpipe.cpu.compat import _host_copy

    def megatron_move(*args, **kwargs):  # megatron's own moves CUDA tensors only: never reached on CPU
        raise AssertionError("a CPU tensor went to megatron's maybe_move_tensor_to_cpu")

    splits = torch.tensor([3, 1], device="cuda")
    assert audit.on_device(splits)
    host = _host_copy(megatron_move)(splits, as_numpy=True)
    assert isinstance(host, np.ndarray) and host.tolist() == [3, 1]
    assert audit.on_device(splits)
    with pytest.raises(DeviceMixError, match="Tensor.numpy"):
        splits.numpy()


def test_device_of_a_device_tensor_names_the_device(audit):
    x = torch.ones(2).cuda()
    assert x.device.type == "cuda"  # so device=x.device and .to(x.device) follow it
    assert audit.on_device(torch.arange(2, device=x.device))
    assert torch.ones(2).device.type == "cpu"


def test_data_aliases_follow_their_tensor(audit):
    """``.data`` reads a fresh alias of the storage (on its tensor's device) and ``w.data = y``
    moves ``w`` to ``y``'s device, as megatron's tied-embedding set-up does
    (``weight.data = weight.data.cuda()`` before an all-reduce)."""
    weight = torch.nn.Parameter(torch.zeros(3))
    assert not audit.on_device(weight.data)
    weight.data = weight.data.cuda()
    assert audit.on_device(weight) and audit.on_device(weight.data)
    weight.data + torch.ones(3, device="cuda")
    with pytest.raises(DeviceMixError, match="on the host"):
        weight.data + torch.ones(3)


# -- the two bugs of the first GPU run, put back on gloo ranks ------------------------------------


def _token_counter(put_back: bool) -> str:
    from megatron_bitpipe.cpu import enable_cpu_megatron
    from megatron_bitpipe.execution.executor import StepResult
    from megatron_bitpipe.training.gpt import gpt_loss

    enable_cpu_megatron()
    # the loss function counts the tokens where the loss is: on the device
    loss_mask = torch.ones(2, 4).cuda()
    output = torch.randn(2, 4).cuda()
    _, num_tokens, _ = gpt_loss(loss_mask, output)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    # PlanExecutor.run's step result: the counter made without a device, or on the executor's
    result = StepResult() if put_back else StepResult(num_tokens=torch.zeros((), dtype=torch.int, device=device))
    result.num_tokens += num_tokens  # PlanExecutor._forward adds each loss chunk's count
    return str(int(result.num_tokens))


def _optimus_start_up_gather(put_back: bool) -> list:
    from megatron_bitpipe.cpu import enable_cpu_megatron
    from megatron_bitpipe.optimus.collectives import all_gather_along
    from megatron_bitpipe.optimus.gpt_model import vocab_block_from_1d_partition
    from megatron_bitpipe.optimus.mesh import build_optimus_mesh

    enable_cpu_megatron()
    mesh = build_optimus_mesh(torch.distributed.group.WORLD)
    # megatron's 1-D vocabulary partition, built on the host (use_cpu_initialization)
    partition = torch.full((2, 4), float(torch.distributed.get_rank()))
    if put_back:  # vocab_block_from_1d_partition gathered the partition where it was
        block = all_gather_along(partition.detach(), 0, mesh.row_group).chunk(mesh.side, dim=1)[mesh.column]
    else:
        block = vocab_block_from_1d_partition(partition, mesh)
    return block.tolist()


@pytest.mark.multirank
def test_token_counter_made_on_the_host_is_caught(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert launch(_token_counter, 1, False) == ["8"]
    with pytest.raises(RankFailure) as failure:
        launch(_token_counter, 1, True)
    message = str(failure.value)
    assert "DeviceMixError: device audit: aten.add_.Tensor at " in message
    assert f"{os.path.basename(__file__)}:" in message and "(in _token_counter)" in message
    assert "writes into `self` ([] int32) on the host while `other` is on the device" in message


@pytest.mark.multirank
def test_optimus_gather_of_host_weights_is_caught(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    blocks = launch(_optimus_start_up_gather, 4, False)
    assert blocks[0] == [[0.0, 0.0]] * 2 + [[1.0, 1.0]] * 2
    with pytest.raises(RankFailure) as failure:
        launch(_optimus_start_up_gather, 4, True)
    message = str(failure.value)
    assert "DeviceMixError: device audit: c10d." in message
    assert "collectives.py:" in message and "on the host to a group that is NCCL on GPUs" in message


# -- the pretraining scripts' loop under the audit --------------------------------------------------

_LOOP_ARGS = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2",
    "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2",
]  # fmt: skip


def _pretraining_loop(put_back: bool) -> None:
    from megatron_bitpipe.cpu import enable_cpu_megatron
    from megatron_bitpipe.training import loop
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.gpt import GPTTask

    if put_back:  # the start-up report gathered on the host, not on the run's device
        gather = loop.gather_rank_reports
        loop.gather_rank_reports = lambda model, device: gather(model, torch.device("cpu"))
    task = GPTTask()
    loop.run_training(task, parse_args(task, list(_LOOP_ARGS)), cpu_fallback=enable_cpu_megatron)


@pytest.mark.multirank
def test_pretraining_loop_runs_under_the_audit_on_its_run_device(monkeypatch):
    """The pretraining scripts' run device is the GPU's stand-in under the audit: their loop
    (start-up report, training, evaluation, logs) passes, and a gather of host tensors fails."""
    monkeypatch.setenv(ENV, "1")
    launch(_pretraining_loop, 2, False, timeout=300)
    with pytest.raises(RankFailure) as failure:
        launch(_pretraining_loop, 2, True, timeout=300)
    message = str(failure.value)
    assert "DeviceMixError: device audit: c10d.allgather_" in message and "report.py:" in message
