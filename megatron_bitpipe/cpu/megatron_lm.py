"""Run Megatron-LM's own training scripts on CPU ranks with gloo.

    torchrun --nproc-per-node 4 -m megatron_bitpipe.cpu.megatron_lm \\
        <Megatron-LM>/pretrain_gpt.py [Megatron-LM flags] $CPU_FLAGS --pipeline-schedule bitpipe

is ``python -m megatron_bitpipe.run`` (same arguments, same checks, same hooks) with, once the
checkout is importable, megatron-core's CPU layer
(:func:`~megatron_bitpipe.cpu.compat.enable_cpu_megatron`) and these patches of
Megatron-LM's start-up (tags core_v0.16.1 and core_v0.19.0), each needed on a CPU-only torch:

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: passed as true;
* ``validate_args`` asks the GPU's architecture with tensor parallelism (for
  ``CUDA_DEVICE_MAX_CONNECTIONS`` advice): answered 10, a generation without that requirement;
* ``_initialize_distributed`` builds the model-parallel groups only if
  ``torch.cuda.device_count() > 0`` and then calls ``torch.cuda.set_device``: the count is 1
  and ``set_device`` does nothing (the device mode maps "cuda" to the CPU);
* ``_compile_dependencies`` builds the dataset index helpers (kept: ``make`` in the checkout's
  ``megatron/core/datasets``, needs pybind11 and a C++ compiler) and the fused CUDA kernels
  (skipped: there is no nvcc);
* ``set_jit_fusion_options`` warms up fused kernels on the GPU: skipped;
* megatron-core's torch norm (``WrappedTorchNorm``: the local layer spec's LayerNorm / RMSNorm
  without apex, which a CPU machine never has) refuses ``--sequence-parallel``; with it, the
  norm is :class:`~megatron_bitpipe.model.norms.SequenceParallelTorchNorm`, the same torch
  norm with its weights marked ``sequence_parallel`` (a norm acts on each token alone, so it
  runs on a sequence shard unchanged; megatron's ``finalize_model_grads`` sums the marked
  weights' gradients over the tensor-parallel group), as in megatron-bitpipe's own scripts; so
  is it with ``--apply-layernorm-1p`` (zero-centered gamma, which megatron's torch norm also
  refuses without apex or Transformer Engine);
* ``typing.override`` (Python 3.12), which tag core_v0.19.0's model builders import, is
  ``typing_extensions.override`` on Python 3.11 (both only mark a method at definition time):
  this machine and CI run Python 3.11, where Megatron-LM core_v0.19.0 does not import otherwise.

:data:`CPU_FLAGS` are the Megatron-LM flags that keep a run off CUDA-only code paths (no fused
kernels, no Transformer Engine, weights created on the CPU, gloo); pass them too. The library
never imports this module: it is an entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import typing
from typing import List, Optional

import torch
import typing_extensions

__all__ = ["CPU_FLAGS", "enable_cpu_megatron_lm", "main"]

CPU_FLAGS = (
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --distributed-backend gloo"
).split()


def _compile_dataset_helpers() -> None:
    """Megatron-LM's ``_compile_dependencies`` without the fused CUDA kernels.

    The dataset helpers are built by the checkout's Makefile, for the running interpreter
    (its extension suffix and pybind11 headers: a ``python3-config`` on ``PATH`` may belong to
    another Python).
    """
    import torch.distributed as dist
    import megatron.core.datasets

    if dist.get_rank() == 0:
        includes = subprocess.run(
            [sys.executable, "-m", "pybind11", "--includes"], check=True, capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(
            [
                "make",
                "-C",
                os.path.dirname(megatron.core.datasets.__file__),
                f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}",
                f"CPPFLAGS={includes}",
            ],
            check=True,
        )
    dist.barrier()


def _norm_with_sequence_parallel(torch_norm_new):
    """``WrappedTorchNorm.__new__`` that builds a ``SequenceParallelTorchNorm`` under
    ``config.sequence_parallel`` or ``config.layernorm_zero_centered_gamma`` (megatron's own
    norm otherwise: it refuses both)."""
    from ..model.norms import SequenceParallelTorchNorm

    def new(cls, config, *args, **kwargs):
        if config.sequence_parallel or config.layernorm_zero_centered_gamma:
            return SequenceParallelTorchNorm(config, *args, **kwargs)
        return torch_norm_new(cls, config, *args, **kwargs)

    return new


def enable_cpu_megatron_lm() -> None:
    """Apply the CPU layer and the Megatron-LM patches (module docstring). Idempotent.

    Call with the checkout on ``sys.path`` and before the training script starts.
    """
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .compat import enable_cpu_megatron

    enable_cpu_megatron()
    if getattr(training.initialize_megatron, "allows_no_cuda", False):
        return
    initialize_megatron = training.initialize_megatron

    def initialize_megatron_on_cpu(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize_megatron_on_cpu.allows_no_cuda = True
    training.initialize_megatron = initialize_megatron_on_cpu
    arguments.get_device_arch_version = lambda: 10
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    initialize._compile_dependencies = _compile_dataset_helpers
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    WrappedTorchNorm.__new__ = staticmethod(_norm_with_sequence_parallel(WrappedTorchNorm.__new__))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_bitpipe.run`` on CPU ranks; same arguments and exit status."""
    from ..run import main as run_main

    return run_main(argv, prepare=enable_cpu_megatron_lm)


if __name__ == "__main__":
    sys.exit(main())
