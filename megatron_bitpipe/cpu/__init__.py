"""Training on CPU ranks with the gloo backend: a supported way to run without a GPU.

* :mod:`.compat` — :func:`enable_cpu_megatron`: megatron-core on a CPU-only torch, unchanged
  math (the pretraining scripts fall back to it when no GPU is present);
* :mod:`.launcher` — :func:`~.launcher.launch`: a function on N gloo ranks (CPU processes),
  the first failing rank ending the job (multi-rank tests and benchmarks);
* :mod:`.megatron_lm` — ``python -m megatron_bitpipe.cpu.megatron_lm``: Megatron-LM's own
  training scripts through :mod:`megatron_bitpipe.run` on CPU ranks;
* :mod:`.strict_p2p` — ``MEGATRON_BITPIPE_STRICT_P2P=1``: gloo point-to-point communication
  under NCCL's rules (per-group issue order, unbuffered sends, bounded waits), installed by
  :func:`enable_cpu_megatron`;
* :mod:`.device_audit` — ``MEGATRON_BITPIPE_DEVICE_AUDIT=1``: a CPU run fails where a GPU run
  would mix host and device tensors, installed by :func:`enable_cpu_megatron`.

The library (schedules, model, execution, optimus, training) never imports this package: entry points
opt in.
"""

from .compat import enable_cpu_megatron, is_cpu_megatron_enabled

__all__ = ["enable_cpu_megatron", "is_cpu_megatron_enabled"]
