"""Starting ``torch.distributed`` for the pretrain scripts, under torchrun or alone.

Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` in the environment,
also set by the SLURM templates) the default process group is initialised from the
environment; a plain ``python scripts/pretrain_gpt.py`` is a job of one rank on an
in-memory store; a default group that already exists (a test launcher's) is used as it is.
With CUDA, each rank takes GPU ``LOCAL_RANK`` (modulo the GPUs it sees: several ranks share a
GPU when there are more ranks than GPUs, as ``scripts/gpu_check.py`` does on one GPU), and
NCCL is initialised eagerly on it (``device_id``). The group's timeout is a few seconds longer
than ``--distributed-timeout-minutes``, which :mod:`.watchdog` applies itself. Without CUDA the job runs
on the CPU with gloo, after the caller's ``cpu_fallback`` (the scripts pass megatron-bitpipe's
test/demo CPU compatibility layer) has been applied, with one torch thread per rank unless
``OMP_NUM_THREADS`` is set (torchrun's default); rank 0 says so in one log line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..megatron_args import BitPipeConfigError
from ..run_config import RunConfig
from .watchdog import process_group_timeout

__all__ = ["Distributed", "initialize", "log"]


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def log(message: str, rank0_only: bool = True) -> None:
    """Print ``message`` (flushed) on rank 0, or on every rank with a rank prefix."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if not rank0_only:
        message = f"[rank {rank}] {message}"
    elif rank != 0:
        return
    print(message, flush=True)


def initialize(run: RunConfig, cpu_fallback: Optional[Callable[[], Optional[torch.device]]] = None) -> Distributed:
    """Initialise the default process group (``run``'s backend) for ``run``'s ranks
    (:attr:`~megatron_bitpipe.run_config.ParallelLayout.world`); return this rank's place.

    Without CUDA, ``cpu_fallback()`` prepares the CPU run and returns its run device (None: the CPU).

    Raises BitPipeConfigError (before any communication) when the job's size disagrees with
    the environment, or when there is no GPU and no ``cpu_fallback``.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size != run.layout.world:
        raise BitPipeConfigError(f"the arguments were checked for {run.layout.world} ranks, the job has {world_size}")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        if cpu_fallback is None:
            raise BitPipeConfigError("no CUDA GPU is available and no CPU fallback was given")
        device = cpu_fallback()  # the CPU (under the device audit: its stand-in for the GPU), or None
        if device is None:
            device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # torchrun's default; more threads only contend on busy cores
    # the watchdog (.watchdog) ends a job stalled for --distributed-timeout-minutes; the group's own timeout is its backstop
    timeout = process_group_timeout(60.0 * run.distributed_timeout_minutes)
    if dist.is_initialized():  # a caller (e.g. the test launcher) started it: use it
        if dist.get_world_size() != world_size:
            raise BitPipeConfigError(f"torch.distributed has {dist.get_world_size()} ranks, the job {world_size}")
    else:
        # NCCL: bind the device, so every communicator is created eagerly, when its group is
        # (megatron_bitpipe.execution.groups also warms up the pipeline's groups at set-up).
        eager = {"device_id": device} if run.distributed_backend == "nccl" else {}
        if "MASTER_ADDR" in os.environ or world_size > 1:
            init = {"init_method": "env://"}
        else:
            init = {"store": dist.HashStore()}
        dist.init_process_group(run.distributed_backend, rank=rank, world_size=world_size, timeout=timeout, **init, **eager)
    if device.type == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        log(f"{os.environ['LOCAL_WORLD_SIZE']} ranks share {torch.cuda.device_count()} GPU(s) on this node")
    if device.type == "cpu":
        log(
            f"no CUDA GPU: training on the CPU with {run.distributed_backend} and megatron-bitpipe's CPU "
            f"compatibility layer (for tests and demos), {world_size} rank(s)"
        )
    return Distributed(rank, world_size, local_rank, device, run.distributed_backend)

