"""Measure what one rank saves for backward and what it sends through collectives.

Benchmark helpers (the library never imports them):

* :class:`SavedActivationMeter` — a ``saved_tensors_hooks`` context: bytes of distinct
  tensor storages autograd saves for backward while it is active, parameters excluded.
  Used around a forward pass it measures the activation memory that pass keeps alive.
* :class:`LiveActivationMeter` — the same storages tracked over their lifetime (saved
  until autograd releases them): live and peak bytes over a whole pipeline step, with the
  activations of marked layers (the emulated layers of
  :mod:`megatron_bitpipe.benchmarking.emulation`) counted separately.
* :class:`CollectiveMeter` — wraps ``torch.distributed``'s collectives (and the aliases
  megatron-core binds at import time) while active and records every call: operation,
  group size and payload bytes. :meth:`CollectiveMeter.wire_bytes` turns the log into the
  bytes one rank receives with bandwidth-optimal algorithms (ring all-reduce
  ``2(p−1)/p·n``; all-gather, reduce-scatter, broadcast and reduce ``(p−1)/p·n`` with ``n``
  the full tensor; all-to-all ``(p−1)/p·n`` with ``n`` the rank's input), the usual
  "bandwidth term" of communication cost.
* :class:`OperatorMeter` — a ``TorchDispatchMode``: the operators dispatched while active
  (what a GPU launches as kernels), the views among them apart, the matrix-multiply FLOPs
  (torch's ``flop_counter`` formulas) and the bytes the operators write.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


def _storage_key(tensor: torch.Tensor) -> Tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedActivationMeter:
    """Sum of bytes of distinct storages saved for backward (parameters excluded).

    Usage::

        with SavedActivationMeter(model.parameters()) as meter:
            loss = model(x)
        meter.bytes  # what the graph keeps for backward
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded = {_storage_key(p) for p in parameters}
        self._seen: set = set()
        self.bytes = 0
        #: (storage bytes, dtype) of each distinct storage, in the order first saved
        self.storages: List[Tuple[int, torch.dtype]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.bytes += key[1]
            self.storages.append((key[1], tensor.dtype))
        return tensor

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """What the pack hook returns: the saved tensor, released (and uncounted) with it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: Tuple[int, int], meter: "LiveActivationMeter"):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class LiveActivationMeter:
    """Live and peak bytes of the tensors autograd keeps for backward, on this thread.

    While active (``with meter:``), every tensor saved for backward is counted from the
    moment it is saved until autograd releases it (after the backward of the node that saved
    it, or when the graph is dropped). Distinct storages are counted once; parameters (the
    storages of ``parameters``) are not counted. A storage declared with
    :meth:`mark_layer_activation` just before it is saved (the emulated transformer layers
    declare their input) is a *layer activation*; ``peak_layer_bytes`` is the peak of those
    alone, the quantity the schedule simulator counts as in-flight activations. Peaks are kept across
    activations of the meter until :meth:`reset_peaks`.

    Invariant: ``live_bytes`` and ``live_layer_bytes`` return to 0 once every graph built
    while the meter was active has run its backward or been freed.
    """

    _current = threading.local()

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded = {_storage_key(p) for p in parameters}
        self._live: Dict[Tuple[int, int], List] = {}  # storage -> [saves alive, is layer activation]
        self._pending_layer: set = set()
        self.live_bytes = self.live_layer_bytes = 0
        self.peak_bytes = self.peak_layer_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    @classmethod
    def current(cls) -> Optional["LiveActivationMeter"]:
        """The meter active on this thread, if any."""
        return getattr(cls._current, "meter", None)

    def reset_peaks(self) -> None:
        self.peak_bytes, self.peak_layer_bytes = self.live_bytes, self.live_layer_bytes

    def mark_layer_activation(self, tensor: torch.Tensor) -> None:
        """Declare that ``tensor``, about to be saved for backward, is a layer's activation."""
        if torch.is_grad_enabled():
            self._pending_layer.add(_storage_key(tensor))

    def hold(self, tensor: torch.Tensor) -> _Held:
        """Count ``tensor`` as saved (live) again until the returned handle is dropped — for
        work that keeps a saved tensor past the backward that released it (a deferred
        weight gradient); a marked layer activation stays one."""
        return self._pack(tensor)

    def _pack(self, tensor: torch.Tensor) -> _Held:
        key = _storage_key(tensor)
        if key in self._excluded:
            return _Held(tensor, None, self)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, False]
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        if key in self._pending_layer:
            self._pending_layer.discard(key)
            if not entry[1]:
                entry[1] = True
                self.live_layer_bytes += key[1]
                self.peak_layer_bytes = max(self.peak_layer_bytes, self.live_layer_bytes)
        return _Held(tensor, key, self)

    def _release(self, key) -> None:
        if key is None:
            return
        entry = self._live[key]
        entry[0] -= 1
        if entry[0]:
            return
        del self._live[key]
        self.live_bytes -= key[1]
        if entry[1]:
            self.live_layer_bytes -= key[1]

    def __enter__(self) -> "LiveActivationMeter":
        self._hooks.__enter__()
        self._current.meter = self
        return self

    def __exit__(self, *exc) -> None:
        self._current.meter = None
        self._hooks.__exit__(*exc)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank issued it: ``payload`` bytes of the full tensor."""

    op: str
    group_size: int
    payload: int

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank receives under a bandwidth-optimal algorithm."""
        share = (self.group_size - 1) / self.group_size
        return (2 if self.op == "all_reduce" else 1) * share * self.payload


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# op name -> (payload bytes from (args, kwargs)) for each wrapped function
_PAYLOAD: Dict[str, Callable] = {
    "all_reduce": lambda a, k: _nbytes(a[0]),
    "broadcast": lambda a, k: _nbytes(a[0]),
    "reduce": lambda a, k: _nbytes(a[0]),
    "all_gather_into_tensor": lambda a, k: _nbytes(a[0]),
    "all_gather_single": lambda a, k: _nbytes(a[0]),
    "_all_gather_base": lambda a, k: _nbytes(a[0]),
    "all_gather": lambda a, k: sum(_nbytes(t) for t in a[0]),
    "reduce_scatter_tensor": lambda a, k: _nbytes(a[1]),
    "reduce_scatter_single": lambda a, k: _nbytes(a[1]),
    "_reduce_scatter_base": lambda a, k: _nbytes(a[1]),
    "reduce_scatter": lambda a, k: sum(_nbytes(t) for t in a[1]),
    "all_to_all_single": lambda a, k: _nbytes(a[1]),
}
_CANONICAL = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
}
# megatron-core modules that bind all-gather / reduce-scatter functions at import time
_MEGATRON_ALIASES = (
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.layers", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func"),
    ("megatron.core.utils", "dist_all_gather_func"),
)


class CollectiveMeter(contextlib.ContextDecorator):
    """Records the collectives this rank issues while active (see module docstring)."""

    def __init__(self):
        self.calls: List[CollectiveCall] = []
        self._restore: List[Tuple[object, str, Callable]] = []
        self._depth = 0  # a wrapped collective calling another one is counted once

    def _wrap(self, name: str, function: Callable) -> Callable:
        op = _CANONICAL.get(name, name)
        signature = inspect.signature(function)

        def recorded(*args, **kwargs):
            if self._depth == 0:
                group = signature.bind(*args, **kwargs).arguments.get("group")
                size = dist.get_world_size(group)
                self.calls.append(CollectiveCall(op, size, _PAYLOAD[name](args, kwargs)))
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1

        return recorded

    def _patch(self, owner, attribute: str) -> None:
        original = getattr(owner, attribute)
        name = getattr(original, "__name__", attribute)
        if name not in _PAYLOAD:
            return
        self._restore.append((owner, attribute, original))
        setattr(owner, attribute, self._wrap(name, original))

    def __enter__(self) -> "CollectiveMeter":
        for name in _PAYLOAD:
            if hasattr(dist, name):
                self._patch(dist, name)
        for module_name, attribute in _MEGATRON_ALIASES:
            module = importlib.import_module(module_name)
            if hasattr(module, attribute):
                self._patch(module, attribute)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attribute, original in reversed(self._restore):
            setattr(owner, attribute, original)
        self._restore.clear()

    def wire_bytes(self) -> float:
        """Total bytes this rank receives (bandwidth-optimal algorithms)."""
        return sum(call.wire_bytes for call in self.calls)

    def payload_bytes(self) -> int:
        """Total payload bytes of the recorded calls (full tensors)."""
        return sum(call.payload for call in self.calls)


#: operators that only allocate (they write no bytes)
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


class OperatorMeter(TorchDispatchMode):
    """What runs below autograd while active, by operator (``aten::mm``, ``c10d::allgather_``, ...).

    * ``operators``: calls of operators that are not views, counted by name; on a GPU each is
      a kernel launch (a collective, a launch on the communication stream);
    * ``views``: calls of view and alias operators (``t``, ``view``, ``detach``, ...): no
      kernel and no bytes, only dispatcher work on the host;
    * ``flops``: matrix-multiply FLOPs by torch's ``flop_counter`` formulas (``mm``, ``bmm``,
      ``addmm``, attention kernels, ...), 2 per multiply-add;
    * ``bytes_written``: bytes of every tensor an operator that is not a view returns (an
      in-place or ``out=`` operator's output is the tensor it wrote); allocations
      (``empty``, ``new_empty_strided``, ...) write none.

    Invariant: every call is counted once, by the innermost operator dispatched (a composite
    operator such as ``matmul`` is counted as the operators it decomposes into).
    """

    def __init__(self) -> None:
        super().__init__()
        self.operators: Counter = Counter()
        self.views: Counter = Counter()
        self.flops = 0
        self.bytes_written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if func.is_view:
            self.views[name] += 1
            return out
        self.operators[name] += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        if name.split("::")[-1] not in _ALLOCATIONS:
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            self.bytes_written += sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
        return out

    @property
    def operator_count(self) -> int:
        return sum(self.operators.values())

    @property
    def view_count(self) -> int:
        return sum(self.views.values())
