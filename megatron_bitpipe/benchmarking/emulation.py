"""An emulated accelerator for pipeline benchmarks: transformer layers whose compute is time.

The emulated cluster (``scripts/bench_emulated.py``) runs real ranks, real gloo p2p and real
megatron-core model plumbing (GPTModel chunks, embedding, final norm, LM head, loss, DDP),
but every transformer layer is an :class:`EmulatedTransformerLayer`: one autograd Function
whose forward takes a configured time and whose backward another, with real tensors flowing
through it (``y = x + x * w``, ``w`` a per-channel weight so each chunk has gradients to
synchronise; it saves ``x``, one ``[s, b, h]`` tensor, for backward — a layer's emulated
activation memory). Waiting costs no CPU, so 8-16 ranks share two cores and still behave
like devices that compute for the configured time.

* :func:`emulated_layer_spec` — a megatron-core ``ModuleSpec`` for the layer: pass it as the
  GPT layer spec (``layer_spec=`` of the chunk builders), so the chunk building that trains
  real models builds the emulated one. With ``all_to_all_seconds`` every layer is an emulated
  mixture-of-experts layer: its forward, and its backward (a split backward's ``I``), also
  wait for two all-to-alls (dispatch and combine) of that time each on the emulated device, as
  the device would wait for them on its stream (a weight-gradient ``W`` exchanges nothing).
* :class:`EmulatedDevice` — where the layer time goes: a blocking sleep per layer, or a
  CUDA-stream-like timeline that the CPU runs ahead of (see the class).
* :class:`ReplicaSlowdown` — a data-parallel replica made a constant factor slower than the
  process it runs on (``--emulate-replica-slowdown``: heterogeneous clusters for tests and
  benchmarks).
* Activation memory is measured with
  :class:`megatron_bitpipe.benchmarking.meters.LiveActivationMeter`; the layers mark their saved
  input as a layer activation when one is active.

Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from ..execution.weight_grad import WeightGradQueue, accumulate_weight_grad
from .meters import LiveActivationMeter

__all__ = ["EmulatedDevice", "EmulatedTransformerLayer", "ReplicaSlowdown", "emulated_layer_spec", "sleep_until"]


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (seconds)."""
    remaining = deadline - time.perf_counter()
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.perf_counter()


_ORIGINAL_SEND = dist.ProcessGroup.send
_ACTIVE: List["EmulatedDevice"] = []
_SWITCH_INTERVAL = 1e-4  # seconds


class _DeferredSend:
    """Work handle of a send issued when the emulated device has produced its data.

    ``wait()`` does not block, like waiting on an NCCL work: it only orders later device
    work after the send, which the single emulated stream does anyway. The tensor is kept
    alive until the send has completed (:meth:`EmulatedDevice.synchronize`).
    """

    __slots__ = ("issued", "work", "error", "tensors")

    def __init__(self, tensors):
        self.issued = threading.Event()
        self.work = None
        self.error: Optional[BaseException] = None
        self.tensors = tensors

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.issued.is_set() and (self.work is None or self.work.is_completed())

    def is_success(self) -> bool:
        return self.error is None

    def finish(self) -> None:
        """Block until the send was issued and has completed; re-raise its error."""
        self.issued.wait()
        if self.error is not None:
            raise self.error
        if self.work is not None:
            self.work.wait()
        self.tensors = None


class EmulatedDevice:
    """This process's emulated accelerator: one stream on which layer compute is queued.

    ``asynchronous=False``: a layer's compute is a blocking sleep of its duration on the
    calling thread (the CPU waits for every layer, and Python overhead between layers adds to
    the step time).

    ``asynchronous=True`` (CUDA-stream semantics): a layer *launches* its compute, which
    starts when the stream is free (or at launch) and ends ``seconds`` later, without
    blocking the CPU; a point-to-point send is issued by a helper thread when everything
    launched before it has finished (``free_at`` at the time of the call), and its ``wait()``
    returns at once; a receive is a real, blocking gloo receive, after which the next launch
    starts. So the CPU runs ahead of the device as it does on a GPU host, and Python
    overhead only costs time when the device would otherwise wait for it.
    :meth:`synchronize` waits for the stream and every deferred send.

    Use as a context manager around one step (``with EmulatedDevice(True) as device: ...``);
    while active (one per process), ``torch.distributed``'s point-to-point sends on every
    process group go through it. Exiting synchronizes. Times are ``time.perf_counter()``
    seconds.
    """

    def __init__(self, asynchronous: bool = True):
        self.asynchronous = asynchronous
        self.free_at = 0.0
        #: total compute seconds launched on this device (what the layers asked for, whatever
        #: the wall clock did)
        self.launched_seconds = 0.0
        self._pending: List[_DeferredSend] = []
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def current() -> Optional["EmulatedDevice"]:
        return _ACTIVE[-1] if _ACTIVE else None

    def launch(self, seconds: float, launched_at: float) -> None:
        """Queue ``seconds`` of compute launched at ``launched_at``; block if synchronous."""
        self.launched_seconds += seconds
        if not self.asynchronous:
            sleep_until(launched_at + seconds)
            return
        self.free_at = max(self.free_at, launched_at) + seconds

    def synchronize(self) -> None:
        """Wait until the stream is idle and every deferred send has completed."""
        sleep_until(self.free_at)
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.finish()

    def _send(self, group, tensors, *args, **kwargs):
        handle = _DeferredSend(tensors)
        self._pending.append(handle)
        self._queue.put((self.free_at, group, tensors, args, kwargs, handle))
        return handle

    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            deadline, group, tensors, args, kwargs, handle = item
            sleep_until(deadline)
            try:
                handle.work = _ORIGINAL_SEND(group, tensors, *args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - reported by synchronize()
                handle.error = error
            handle.issued.set()

    def __enter__(self) -> "EmulatedDevice":
        if _ACTIVE:
            raise RuntimeError("an EmulatedDevice is already active in this process")
        self.free_at = time.perf_counter()
        if self.asynchronous:
            # The helper thread must get the GIL soon after a send is due, not after the
            # interpreter's default 5 ms switch interval while the main thread runs Python.
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(_SWITCH_INTERVAL)
            self._thread = threading.Thread(target=self._sender, name="emulated-device-sends", daemon=True)
            self._thread.start()
            device = self

            def send(group, tensors, *args, **kwargs):
                return device._send(group, tensors, *args, **kwargs)

            dist.ProcessGroup.send = send
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.synchronize()
        finally:
            _ACTIVE.pop()
            if self._thread is not None:
                dist.ProcessGroup.send = _ORIGINAL_SEND
                sys.setswitchinterval(self._switch_interval)
                self._queue.put(None)
                self._thread.join()
                self._thread = None


def _compute(seconds: float, launched_at: float) -> None:
    device = EmulatedDevice.current()
    if device is None:
        sleep_until(launched_at + seconds)
    else:
        device.launch(seconds, launched_at)


def _exchange(seconds: float, after: float) -> None:
    """An MoE layer's all-to-alls: ``seconds`` on the device once its compute (ending at
    ``after``) is done; nothing for a dense layer."""
    if seconds > 0:
        _compute(seconds, after)


class ReplicaSlowdown:
    """A device ``factor`` times slower than this process: after each piece of work that
    began at ``started`` (``time.perf_counter()`` seconds), :meth:`after` adds ``(factor - 1)``
    times its duration as emulated compute — queued on the active :class:`EmulatedDevice`, a
    blocking sleep otherwise. So a replica whose every rank is slowed by ``factor`` takes
    ``factor`` times as long per step as an unslowed one, whatever its model (emulated layers
    or real ones). A testing and benchmarking aid (``--emulate-replica-slowdown``).
    """

    def __init__(self, factor: float):
        if not factor >= 1.0:
            raise ValueError(f"a slowdown factor must be >= 1, got {factor}")
        self.factor = factor
        #: total extra seconds added so far
        self.added_seconds = 0.0

    def after(self, started: float) -> None:
        now = time.perf_counter()
        extra = (self.factor - 1.0) * (now - started)
        self.added_seconds += extra
        if extra > 0:
            _compute(extra, now)


class _TimedLayer(torch.autograd.Function):
    """``y = x + x * w``, whose forward takes ``forward_s`` and backward ``backward_s`` of
    emulated device time (:class:`EmulatedDevice`; a blocking sleep when none is active).

    Split backward (``deferral`` = (the Parameter ``w``, the layer's
    :class:`~megatron_bitpipe.execution.weight_grad.WeightGradQueue`), ``weight`` then arrives
    detached, as for megatron's linears): the backward (``I``) takes ``input_s`` and
    queues a closure that takes ``weight_s`` and adds ``w``'s gradient; it holds ``x`` (and
    the layer activation the meter counts) until the layer's ``backward_dw`` runs it.

    Durations count from the entry of each pass, so the little real compute inside is part
    of the configured time instead of adding to it.
    """

    @staticmethod
    def forward(ctx, x, weight, forward_s: float, backward_s: float, weight_s: float, input_s: float, deferral, exchange_s: float):
        launched_at = time.perf_counter()
        ctx.save_for_backward(x, weight)
        ctx.backward_s, ctx.weight_s, ctx.input_s, ctx.deferral = backward_s, weight_s, input_s, deferral
        ctx.exchange_s = exchange_s
        y = x + x * weight
        _compute(forward_s, launched_at)
        _exchange(exchange_s, launched_at + forward_s)
        return y

    @staticmethod
    def backward(ctx, grad):
        launched_at = time.perf_counter()
        x, weight = ctx.saved_tensors
        grad_x = grad + grad * weight
        if ctx.deferral is None:
            _compute(ctx.backward_s, launched_at)
            _exchange(ctx.exchange_s, launched_at + ctx.backward_s)
            return grad_x, _weight_grad(grad, x), None, None, None, None, None, None
        param, queue = ctx.deferral
        weight_s = ctx.weight_s
        meter = LiveActivationMeter.current()
        held = meter.hold(x) if meter is not None else None  # x stays live for the meter until W

        def weight_grad() -> None:
            nonlocal held
            started = time.perf_counter()
            accumulate_weight_grad(param, _weight_grad(grad, x))
            _compute(weight_s, started)
            held = None

        queue.push(param, weight_grad)
        _compute(ctx.input_s, launched_at)
        _exchange(ctx.exchange_s, launched_at + ctx.input_s)
        return grad_x, None, None, None, None, None, None, None


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (grad * x).reshape(-1, x.shape[-1]).sum(dim=0)


class EmulatedTransformerLayer(MegatronModule, BaseTransformerLayer):
    """Drop-in for megatron-core's ``TransformerLayer`` in a ``TransformerBlock``.

    Takes the block's constructor and call arguments, ignores attention masks, rotary
    embeddings and the rest, and returns ``(hidden_states, context)`` like a real layer.
    ``layer_number`` becomes the global 1-based number (the chunk's layer offset added), as
    megatron-core's layer computes it. Being a ``BaseTransformerLayer``, a block spec of it is
    fanned out to the chunk's number of layers like megatron-core's own layer spec.
    """

    def __init__(
        self,
        config,
        layer_number: int = 1,
        pg_collection=None,
        vp_stage: Optional[int] = None,
        forward_seconds: float = 0.0,
        backward_seconds: float = 0.0,
        weight_seconds: float = 0.0,
        input_seconds: Optional[float] = None,
        all_to_all_seconds: float = 0.0,
        **unused,
    ):
        super().__init__(config)
        pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else 0
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage, pp_rank)
        self.forward_seconds = forward_seconds
        self.backward_seconds = backward_seconds
        self.weight_seconds = weight_seconds
        self.input_seconds = backward_seconds - weight_seconds if input_seconds is None else input_seconds
        #: one all-to-all (an MoE layer's dispatch or combine); each pass but W waits for two
        self.all_to_all_seconds = all_to_all_seconds
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.params_dtype, device=device))
        #: the split backward's FIFO (megatron-core's ``delay_wgrad_compute`` contract, as the
        #: local linears of :mod:`megatron_bitpipe.execution.weight_grad` follow it)
        self.wgrad_queue = WeightGradQueue(f"emulated layer {self.layer_number}")

    def backward_dw(self) -> None:
        """Run the oldest queued weight gradient (``delay_wgrad_compute`` set on the config)."""
        self.wgrad_queue.backward_dw()

    def forward(self, hidden_states, context=None, **unused) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        meter = LiveActivationMeter.current()
        if meter is not None:
            meter.mark_layer_activation(hidden_states)
        weight, deferral = self.weight, None
        if getattr(self.config, "delay_wgrad_compute", False) and torch.is_grad_enabled():
            weight, deferral = self.weight.detach(), (self.weight, self.wgrad_queue)
        times = (self.forward_seconds, self.backward_seconds, self.weight_seconds, self.input_seconds)
        return _TimedLayer.apply(hidden_states, weight, *times, deferral, 2 * self.all_to_all_seconds), context


def emulated_layer_spec(
    forward_seconds: float,
    backward_seconds: float,
    weight_seconds: Optional[float] = None,
    input_seconds: Optional[float] = None,
    all_to_all_seconds: float = 0.0,
) -> ModuleSpec:
    """GPT layer spec whose every layer sleeps ``forward_seconds`` / ``backward_seconds``.

    ``all_to_all_seconds > 0`` makes every layer an MoE layer whose forward and backward (or
    ``I``) each also wait for two all-to-alls of that time (module docstring).

    With a split backward ``I`` takes ``input_seconds`` and ``W`` ``weight_seconds``; a whole
    backward takes ``backward_seconds``. Defaults as :class:`~megatron_bitpipe.schedules.CostModel`'s
    ``t_input`` / ``t_weight``: either one left out is the rest of ``backward_seconds`` after the
    other, both left out half of it each.
    """
    if weight_seconds is None:
        weight_seconds = backward_seconds / 2 if input_seconds is None else backward_seconds - input_seconds
    if input_seconds is None:
        input_seconds = backward_seconds - weight_seconds
    if min(forward_seconds, backward_seconds, input_seconds, all_to_all_seconds) < 0 or not 0 <= weight_seconds <= backward_seconds:
        raise ValueError(
            f"sleep times must be >= 0 with weight_seconds <= backward_seconds, got "
            f"{forward_seconds}, {backward_seconds}, {weight_seconds}, {input_seconds}"
        )
    return ModuleSpec(
        module=EmulatedTransformerLayer,
        params={
            "forward_seconds": forward_seconds,
            "backward_seconds": backward_seconds,
            "weight_seconds": weight_seconds,
            "input_seconds": input_seconds,
            "all_to_all_seconds": all_to_all_seconds,
        },
    )
