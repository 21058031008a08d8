"""Cost models from model sizes and hardware figures, for when nothing was measured.

A :class:`~.simulate.CostModel` wants per-device-share times (``L / D`` layers, one
micro-batch) in milliseconds. :func:`analytic_costs` derives them from a
:class:`TransformerShape` and a :class:`Hardware` description:

* compute — the matrix-multiply FLOPs of a GPT/BERT transformer layer (forward
  ``2bsh(3h) + 4bs²h + 2bsh² + 4bshf``: QKV, scores and context, output projection, MLP; with
  ``f = 4h`` that is ``24bsh² + 4bs²h``), backward twice the forward, at an *achieved*
  throughput (not the datasheet peak). Embedding, LM head, norms and softmax are left out;
* point-to-point — latency plus ``[s, b, h]`` activation bytes over a link bandwidth;
* gradient sync — the bytes of one device share's gradients and the all-reduce bus
  bandwidth; the simulator times each stage's ring all-reduce over its group (replicas x
  data-parallel ranks, :meth:`~.simulate.CostModel.sync_time`): ``2 (g-1) / g x bytes /
  bus bandwidth``, nothing for a group of one.

``scripts/predict_throughput.py`` uses these when no calibration file exists and
``scripts/calibrate_gpu.py`` for the communication terms it cannot measure on one GPU.
Units: milliseconds, bytes, GB/s = 1e9 bytes/s = 1e6 bytes/ms, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .simulate import CostModel

__all__ = ["TransformerShape", "Hardware", "analytic_costs"]


@dataclass(frozen=True)
class TransformerShape:
    """Sizes of a GPT/BERT-style transformer (Megatron flag names).

    ``num_layers`` counts the whole model; ``ffn_hidden_size`` defaults to ``4 h``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    ffn_hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("--num-attention-heads: must divide --hidden-size")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def layer_forward_flops(self) -> float:
        """Matrix-multiply FLOPs of one layer's forward for one micro-batch."""
        b, s, h, f = self.micro_batch_size, self.seq_length, self.hidden_size, self.ffn
        return 2 * b * s * h * 3 * h + 4 * b * s * s * h + 2 * b * s * h * h + 4 * b * s * h * f

    def layer_parameters(self) -> int:
        """Weights and biases of one layer: QKV, projection, two MLP linears, two norms."""
        h, f = self.hidden_size, self.ffn
        return (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h

    def message_bytes(self, bytes_per_element: int) -> int:
        """One activation (or its gradient) between pipeline stages: ``[s, b, h]``."""
        return self.seq_length * self.micro_batch_size * self.hidden_size * bytes_per_element


@dataclass(frozen=True)
class Hardware:
    """Assumed device and network figures.

    Attributes:
        achieved_tflops: sustained matrix-multiply throughput of one device (TFLOP/s).
        p2p_latency_ms: per-message latency of a pipeline send.
        p2p_bandwidth_gbs: point-to-point bandwidth between neighbouring stages (GB/s).
        allreduce_bandwidth_gbs: all-reduce *bus* bandwidth (GB/s, as nccl-tests reports it).
        bytes_per_element: activation element size (2 for fp16/bf16).
        grad_bytes_per_element: gradient element size in the all-reduce (2, or 4 with
            fp32 gradient reduction).
    """

    achieved_tflops: float
    p2p_latency_ms: float = 0.02
    p2p_bandwidth_gbs: float = 100.0
    allreduce_bandwidth_gbs: float = 100.0
    bytes_per_element: int = 2
    grad_bytes_per_element: int = 2

    def __post_init__(self) -> None:
        if self.achieved_tflops <= 0 or self.p2p_bandwidth_gbs <= 0 or self.allreduce_bandwidth_gbs <= 0:
            raise ValueError("throughput and bandwidths must be > 0")
        if self.p2p_latency_ms < 0:
            raise ValueError("latency must be >= 0")


def analytic_costs(
    shape: TransformerShape, pipeline_size: int, hardware: Hardware, data_parallel_size: int = 1
) -> CostModel:
    """CostModel (ms) for ``shape`` cut into ``pipeline_size`` device shares.

    Raises ValueError unless ``pipeline_size`` divides the layers.
    """
    if pipeline_size < 1 or shape.num_layers % pipeline_size:
        raise ValueError(f"--pipeline-model-parallel-size {pipeline_size} must divide --num-layers {shape.num_layers}")
    layers = shape.num_layers // pipeline_size
    t_forward = layers * shape.layer_forward_flops() / (hardware.achieved_tflops * 1e9)
    return CostModel(
        t_forward=t_forward,
        t_backward=2 * t_forward,
        t_p2p=hardware.p2p_latency_ms,
        p2p_bytes=shape.message_bytes(hardware.bytes_per_element),
        p2p_bandwidth=hardware.p2p_bandwidth_gbs * 1e6,
        grad_bytes=layers * shape.layer_parameters() * hardware.grad_bytes_per_element,
        sync_bandwidth=hardware.allreduce_bandwidth_gbs * 1e6,
        data_parallel_size=data_parallel_size,
    )
