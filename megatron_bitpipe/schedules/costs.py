"""The simulator's cost model, and cost models from model sizes and hardware figures.

:class:`CostModel` holds what one action costs (per device share of the layers) and what
messages and gradient all-reduces take; :func:`read_cost_file` reads the JSON cost file
``scripts/calibrate_gpu.py`` writes. A :class:`CostModel` wants per-device-share times (``L / D`` layers, one
micro-batch) in milliseconds. :func:`analytic_costs` derives them from a
:class:`~.model_shape.ModelShape` and a :class:`Hardware` description:

* compute — the matrix-multiply FLOPs of a GPT/BERT transformer layer
  (:meth:`~.model_shape.ModelShape.layer_forward_flops`; a plain layer's forward is
  ``2bsh(3h) + 4bs²h + 2bsh² + 4bshf``: QKV, scores and context, output projection, MLP; with
  ``f = 4h`` that is ``24bsh² + 4bs²h``), backward twice the forward, at an *achieved*
  throughput (not the datasheet peak). Embedding, LM head, norms and softmax are left out;
* point-to-point — latency plus ``[s, b, h]`` activation bytes over a link bandwidth;
* context parallelism — the shape is one context-parallel rank's
  (:class:`~.model_shape.ModelShape` ``context_parallel_size``): its tokens' FLOPs and messages;
  each layer's key/value all-gather (``F``) and reduce-scatter (``B``, ``I``) take ``t_cp`` plus
  the bytes one rank receives or sends (:meth:`~.model_shape.ModelShape.context_exchange_bytes`)
  over the collective's *bus* bandwidth (as nccl-tests reports it: a ring all-gather or
  reduce-scatter of ``g`` ranks moves ``(g - 1) / g`` of the whole tensor through each rank,
  which is what the bytes count), :meth:`CostModel.context_exchange_time`;
* gradient sync — the bytes of one device share's gradients and the all-reduce bus
  bandwidth; the simulator times each stage's ring all-reduce over its group (replicas x
  data-parallel ranks, :meth:`CostModel.sync_time`): ``2 (g-1) / g x bytes /
  bus bandwidth``, nothing for a group of one.

``scripts/predict_throughput.py`` uses these when no calibration file exists and
``scripts/calibrate_gpu.py`` for the communication terms it cannot measure on one GPU.
Units: milliseconds, bytes, GB/s = 1e9 bytes/s = 1e6 bytes/ms, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, Optional

from .actions import Action, ActionType
from .model_shape import ModelShape

__all__ = ["CostModel", "Hardware", "analytic_costs", "read_cost_file"]


@dataclass(frozen=True)
class CostModel:
    """Costs in one time unit of the caller's choice (``t_forward = 1`` or milliseconds).

    Attributes:
        t_forward: forward of one micro-batch through ``L / D`` layers (one device's
            share of one replica). A stage's cost is this times its ``stage_weight``.
        t_backward: full backward (input + weight gradients) of the same layers.
        t_weight: the weight-gradient part of ``t_backward`` — the cost of ``W`` in a split
            backward, whose ``I`` costs ``t_backward - t_weight``; ``None`` means the rest of
            ``t_backward`` after ``t_input`` (half of ``t_backward`` without either). Plans
            without a split backward do not use it.
        t_input: the cost of ``I`` (input gradient, weight gradients deferred) in a split
            backward, when measured on its own (``scripts/calibrate_gpu.py`` writes it);
            ``None`` means ``t_backward`` minus the ``W`` cost. With both ``t_input`` and
            ``t_weight`` given, ``I + W`` may differ from ``t_backward`` (a split backward
            does its own work: on one H100, I + W = 1.03 B), and ``t_input`` is not bounded
            by ``t_backward``. Plans without a split backward do not use it.
        t_forward_deferring: the cost of ``F`` on a chunk whose linears defer their weight
            gradients — every forward of a split-backward plan (``scripts/calibrate_gpu.py``
            measures it as ``F_d``); ``None`` means ``t_forward``. Plans without a split
            backward do not use it; :meth:`as_split` gives a split plan's costs.
        t_p2p: latency of one point-to-point message.
        p2p_bytes: bytes of one message (activation or gradient of one micro-batch at a
            stage boundary); with ``p2p_bandwidth`` gives the bandwidth term.
        p2p_bandwidth: bytes per time unit; 0 means the bandwidth term is ignored.
        t_sync: a fixed all-reduce time of the gradients of ``L / D`` layers (whatever the
            group), added to the bandwidth term below; e.g. a time measured for one group.
        grad_bytes: bytes of the gradients of ``L / D`` layers that an all-reduce moves
            (parameters x gradient element size).
        sync_bandwidth: all-reduce *bus* bandwidth (bytes per time unit, as nccl-tests
            reports it); with ``grad_bytes`` gives the bandwidth term of a ring
            all-reduce, ``2 (g-1)/g x bytes / bandwidth`` for a group of ``g`` ranks. 0:
            no bandwidth term.
        data_parallel_size: data-parallel ranks each stage's gradients are averaged over
            besides its replicas: the group of a stage held by ``R`` replicas is
            ``R x data_parallel_size`` ranks.
        t_a2a: latency of one all-to-all of a mixture-of-experts layer (its dispatch or its
            combine) among expert-parallel ranks; none at expert parallelism 1.
        a2a_bandwidth: bytes per time unit that one rank's all-to-all sends off the rank (its
            share of the group's all-to-all bandwidth); with the bytes of a model's MoE layer
            (:meth:`~.model_shape.ModelShape.all_to_all_bytes`) gives the bandwidth term. 0:
            no bandwidth term.
        t_cp: latency of one context-parallel collective (a layer's key/value all-gather in
            ``F`` or its gradients' reduce-scatter in ``B`` / ``I``); none at context parallelism 1.
        cp_bandwidth: all-gather / reduce-scatter *bus* bandwidth of the context-parallel group
            (bytes per time unit, as nccl-tests reports it); with a model's
            :meth:`~.model_shape.ModelShape.context_exchange_bytes` gives the bandwidth term. 0: no
            bandwidth term.
    """

    t_forward: float = 1.0
    t_backward: float = 2.0
    t_weight: Optional[float] = None
    t_input: Optional[float] = None
    t_forward_deferring: Optional[float] = None
    t_p2p: float = 0.0
    p2p_bytes: float = 0.0
    p2p_bandwidth: float = 0.0
    t_sync: float = 0.0
    grad_bytes: float = 0.0
    sync_bandwidth: float = 0.0
    data_parallel_size: int = 1
    t_a2a: float = 0.0
    a2a_bandwidth: float = 0.0
    t_cp: float = 0.0
    cp_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and value < 0:
                raise ValueError(f"cost {name} must be >= 0, got {value}")
        if self.data_parallel_size < 1 or self.data_parallel_size != int(self.data_parallel_size):
            raise ValueError(f"data_parallel_size must be a positive integer, got {self.data_parallel_size}")
        if self.t_forward + self.t_backward <= 0:
            raise ValueError("t_forward + t_backward must be > 0")
        if self.t_weight is not None and self.t_weight > self.t_backward:
            raise ValueError(f"t_weight ({self.t_weight}) is part of t_backward ({self.t_backward}) and cannot exceed it")
        if self.t_input is not None and self.t_weight is None and self.t_input > self.t_backward:
            raise ValueError(
                f"t_input ({self.t_input}) without t_weight leaves W = t_backward - t_input: it cannot exceed "
                f"t_backward ({self.t_backward})"
            )

    @property
    def weight_time(self) -> float:
        """Cost of the weight-gradient part (``W``) of a backward of ``L / D`` layers."""
        if self.t_weight is not None:
            return self.t_weight
        return self.t_backward / 2 if self.t_input is None else self.t_backward - self.t_input

    @property
    def input_time(self) -> float:
        """Cost of the input-gradient part (``I``) of a split backward of ``L / D`` layers."""
        return self.t_backward - self.weight_time if self.t_input is None else self.t_input

    @property
    def forward_deferring_time(self) -> float:
        """Cost of ``F`` in a split-backward plan (its linears defer their weight gradients)."""
        return self.t_forward if self.t_forward_deferring is None else self.t_forward_deferring

    def as_split(self) -> "CostModel":
        """These costs as the actions of a split-backward plan run: ``F`` the forward while
        deferring (:attr:`forward_deferring_time`), ``I`` and ``W`` theirs, and a whole ``B``
        (DualPipe's and DualPipeV's, on chunks whose linears defer) ``I`` then ``W`` at once,
        as the executor runs it. The same costs where F_d = F and I + W = B (the defaults)."""
        return replace(self, t_forward=self.forward_deferring_time, t_backward=self.input_time + self.weight_time,
                       t_weight=self.weight_time, t_input=self.input_time, t_forward_deferring=None)  # fmt: skip

    @property
    def message_time(self) -> float:
        """Time from a ``SEND`` (issued when its producer ends) to the arrival of its message."""
        bandwidth_term = self.p2p_bytes / self.p2p_bandwidth if self.p2p_bandwidth > 0 else 0.0
        return self.t_p2p + bandwidth_term

    def all_to_all_time(self, bytes_sent: float) -> float:
        """Time of one all-to-all that sends ``bytes_sent`` bytes off each rank: ``t_a2a``
        plus ``bytes_sent / a2a_bandwidth``; 0 when nothing leaves the rank (expert
        parallelism 1)."""
        return _collective_time(self.t_a2a, self.a2a_bandwidth, bytes_sent)

    def context_exchange_time(self, bytes_moved: float) -> float:
        """Time of one layer's context-parallel key/value all-gather (or its gradients'
        reduce-scatter) that brings ``bytes_moved`` bytes onto each rank (or sends them off it):
        ``t_cp`` plus ``bytes_moved / cp_bandwidth``; 0 when nothing moves (context parallelism 1)."""
        return _collective_time(self.t_cp, self.cp_bandwidth, bytes_moved)

    def with_all_to_alls(self, moe_layers: float, bytes_sent: float) -> "CostModel":
        """These costs with a device share's mixture-of-experts exchange folded in: each of its
        ``moe_layers`` MoE layers adds two all-to-alls of ``bytes_sent`` (dispatch and combine,
        :meth:`all_to_all_time`) to ``F`` (and ``F_d``), ``B`` and ``I``, none to ``W``. Unchanged without
        all-to-all time."""
        exchange = 2 * moe_layers * self.all_to_all_time(bytes_sent)
        if exchange == 0:
            return self
        forward_deferring = None if self.t_forward_deferring is None else self.t_forward_deferring + exchange
        return replace(self, t_forward=self.t_forward + exchange, t_backward=self.t_backward + exchange,
                       t_weight=self.weight_time, t_input=self.input_time + exchange,
                       t_forward_deferring=forward_deferring)  # fmt: skip

    def sync_time(self, stage_weight: float, replicas: int) -> float:
        """All-reduce time of the gradients of a stage of ``stage_weight`` device shares held
        by ``replicas`` ranks of one data-parallel replica (its slots times the context-parallel
        ranks), among those and the data-parallel ranks."""
        group = replicas * int(self.data_parallel_size)
        ring = 0.0
        if self.sync_bandwidth > 0 and group > 1:
            ring = 2 * (group - 1) / group * self.grad_bytes * stage_weight / self.sync_bandwidth
        return self.t_sync * stage_weight + ring

    def compute_time(self, action: Action, stage_weight: float) -> float:
        """Time of ``action`` on a stage holding ``stage_weight`` device shares (0 for SYNC)."""
        per_share = {
            ActionType.FORWARD: self.t_forward,
            ActionType.BACKWARD: self.t_backward,
            ActionType.BACKWARD_INPUT: self.input_time,
            ActionType.BACKWARD_WEIGHT: self.weight_time,
        }
        return per_share.get(action.type, 0.0) * stage_weight


def _collective_time(latency: float, bandwidth: float, bytes_moved: float) -> float:
    """``latency + bytes_moved / bandwidth`` (no bandwidth term at bandwidth 0); 0 when nothing moves."""
    if bytes_moved <= 0:
        return 0.0
    return latency + (bytes_moved / bandwidth if bandwidth > 0 else 0.0)


def read_cost_file(path: str) -> Dict[str, float]:
    """The :class:`CostModel` fields found in JSON cost file ``path`` (other keys,
    e.g. a calibration's sizes, are ignored). Raises OSError / JSONDecodeError."""
    with open(path, encoding="utf-8") as handle:
        loaded = json.load(handle)
    known = {f.name for f in fields(CostModel)}
    return {
        k: (int(v) if k == "data_parallel_size" else float(v)) for k, v in loaded.items() if k in known and v is not None
    }


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
        cp_latency_ms: latency of one context-parallel all-gather or reduce-scatter.
        cp_bandwidth_gbs: their bus bandwidth in the context-parallel group (GB/s, as
            nccl-tests reports it).
    """

    achieved_tflops: float
    p2p_latency_ms: float = 0.02
    p2p_bandwidth_gbs: float = 100.0
    allreduce_bandwidth_gbs: float = 100.0
    bytes_per_element: int = 2
    grad_bytes_per_element: int = 2
    cp_latency_ms: float = 0.02
    cp_bandwidth_gbs: float = 100.0

    def __post_init__(self) -> None:
        bandwidths = (self.p2p_bandwidth_gbs, self.allreduce_bandwidth_gbs, self.cp_bandwidth_gbs)
        if self.achieved_tflops <= 0 or min(bandwidths) <= 0:
            raise ValueError("throughput and bandwidths must be > 0")
        if self.p2p_latency_ms < 0 or self.cp_latency_ms < 0:
            raise ValueError("latency must be >= 0")


def analytic_costs(
    shape: ModelShape, pipeline_size: int, hardware: Hardware, data_parallel_size: int = 1
) -> CostModel:
    """CostModel (ms) for ``shape`` cut into ``pipeline_size`` device shares, on one
    context-parallel rank of ``shape``'s (the context-parallel collectives' figures included).

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
        t_cp=hardware.cp_latency_ms,
        cp_bandwidth=hardware.cp_bandwidth_gbs * 1e6,
    )
