"""Device audit: a CPU run fails where a GPU run would on mixing host and device tensors.

On CPU ranks every tensor lives on the CPU, so an operation that a GPU run refuses (a counter
made on the host added into a device tensor, a host tensor handed to an NCCL collective) passes
unnoticed. With ``MEGATRON_BITPIPE_DEVICE_AUDIT=1`` in the environment,
:func:`~.compat.enable_cpu_megatron` pushes :class:`DeviceAudit`, a ``TorchDispatchMode`` that
keeps a *shadow device* for every tensor — ``device`` (would be on the GPU) or ``host`` — and
applies CUDA's rules to every operation, in megatron-core, this package and the user's forward
step and loss alike. One line on stderr says it is on.

Shadow devices:

* made with a CUDA device (``device="cuda"``, ``torch.cuda.current_device()``, a bare index)
  or with the CPU run's own run device (:func:`run_device`, the pretraining scripts'
  ``Distributed.device``), moved with ``.cuda()`` / ``.to(cuda)`` / ``Module.cuda()``: ``device`` (marked by
  :class:`~.compat.CpuDeviceMode`, which sees the device argument before it becomes the CPU);
* made without a device (``torch.zeros(n)``, ``torch.tensor(3)``, ``torch.from_numpy``) or with
  ``device="cpu"``, moved with ``.cpu()`` / ``.to("cpu")``: ``host``;
* the result of any other operation: ``device`` when one of its tensor operands is, else
  ``host``; an in-place result keeps the mark of the tensor written into. Factories run by the
  autograd engine during backward (zero gradients it fills in) are ``device``.

Rules checked (CUDA's, from TensorIterator's device checks and the collectives'):

* every tensor operand of an operation that involves a device tensor must be on the device,
  except a 0-dim host tensor *read* by it (a CPU scalar: CUDA kernels take one as a value);
  a host tensor *written* by it (in place, ``out=``) fails even when 0-dim
  (``host_counter += device_tensor``);
* exempt: ``copy_`` / ``_to_copy`` (copies between devices), the indices of indexing
  (``device_tensor[host_index]``), ``set_``;
* a collective or point-to-point operation of a group that is NCCL on GPUs (every group not
  made with ``backend="gloo"``) takes device tensors only; ``Tensor.numpy()`` takes host
  tensors only.

A violation raises :class:`DeviceMixError` naming the operation, the first frame of the
calling code outside torch and this package's CPU layer (file:line and function), and which
operand is on the host.

Invariants: the audit never changes a value (it only reads marks and calls the operation); it
is thread-local like every dispatch mode (pushed on the thread that calls
:func:`~.compat.enable_cpu_megatron`; strict p2p's worker threads are checked at the calling
thread through :func:`check_communication`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["DeviceAudit", "DeviceMixError", "ENV", "active_audit", "check_communication", "install_from_env",
           "requested", "run_device"]

#: turns the audit on (``1``; ``0`` or empty: off)
ENV = "MEGATRON_BITPIPE_DEVICE_AUDIT"

_aten = torch.ops.aten
_CUDA0 = torch.device("cuda", 0)
#: operations that move data between devices
_COPIES = {_aten.copy_.default, _aten._to_copy.default, _aten.set_.source_Tensor, _aten.set_.source_Storage,
           _aten.set_.source_Storage_storage_offset, _aten.lift_fresh.default, _aten.lift_fresh_copy.default}
#: indexing operations and their index argument (may stay on the host)
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: the files whose frames are not "the calling code"
_SKIP_DIRS = (_TORCH_DIR, os.path.dirname(__file__) + os.sep)
#: torch's collectives of Python objects (their tensors are on the right device by construction)
_OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                       "send_object_list", "recv_object_list"}
#: modules whose ``torch.cuda.is_available()`` picks the process set-up: answered truly
_HOST_DECISIONS = ("megatron_bitpipe.cpu", "megatron_bitpipe.training.distributed", "megatron_bitpipe.training.arguments",
                   "megatron_bitpipe.training.checkpoint", "megatron_bitpipe.training.config")
#: c10d operations whose tensors torch makes itself on the backend's device
_C10D_OWN_TENSORS = {"barrier", "monitored_barrier"}

_install_lock = threading.Lock()
_announced = False
#: names of the process groups made with ``backend="gloo"``: gloo on GPUs too, host tensors right
_gloo_groups: set = set()


class DeviceMixError(RuntimeError):
    """An operation a GPU run would refuse: host and device tensors mixed."""


def requested() -> bool:
    """Whether the environment asks for the audit."""
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def active_audit() -> Optional["DeviceAudit"]:
    """The audit pushed on this thread, or None."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, DeviceAudit):
            return mode
    return None


def install_from_env() -> Optional["DeviceAudit"]:
    """Push a :class:`DeviceAudit` on this thread (once) if the environment asks; returns the
    audit on this thread (None: off). The first install in the process writes one line on stderr."""
    global _announced
    if not requested():
        return None
    _record_gloo_groups()
    _answer_gpu_run()
    audit = active_audit()
    if audit is None:
        audit = DeviceAudit()
        audit.__enter__()  # for the life of the thread, like the CPU device mode
        with _install_lock:
            announce, _announced = not _announced, True
        if announce:
            sys.stderr.write(
                f"megatron_bitpipe: device audit on ({ENV}=1): an operation mixing host and device tensors, "
                "or a host tensor in an NCCL collective, fails as on a GPU\n"
            )
            sys.stderr.flush()
    return audit


def run_device(host: torch.device) -> torch.device:
    """The device a CPU run places its model and batches on: ``host`` without an audit on this
    thread, else the audit's :attr:`DeviceAudit.run_device` (the CPU too, which the audit takes
    for the GPU a GPU run would use there)."""
    audit = active_audit()
    return host if audit is None else audit.run_device


def check_communication(kind: str, tensors: Iterable[torch.Tensor], group: Any) -> None:
    """Fail as NCCL would when a host tensor goes to a collective or p2p operation of ``group``
    (None: the default group); no-op when no audit is on this thread."""
    audit = active_audit()
    if audit is not None:
        audit.check_communication(kind, list(tensors), group)


def _record_gloo_groups() -> None:
    """Wrap ``torch.distributed.new_group`` (once) to note the groups asked for as gloo."""
    with _install_lock:
        new_group = dist.new_group
        if getattr(new_group, "_device_audit", False):
            return

        def new_group_noting_gloo(*args, **kwargs):
            group = new_group(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and str(backend) == "gloo":
                _gloo_groups.add(group.group_name)
            return group

        new_group_noting_gloo._device_audit = True
        dist.new_group = new_group_noting_gloo


def _in_object_collective() -> bool:
    """Whether torch's object collectives (``all_gather_object`` ...) are running: they put
    their byte tensors on the group's device themselves (the GPU for NCCL)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _OBJECT_COLLECTIVES and frame.f_code.co_filename.startswith(_TORCH_DIR):
            return True
        frame = frame.f_back
    return False


def _answer_gpu_run() -> None:
    """Make ``torch.cuda.is_available()`` answer True to the code that asks "is this a GPU run?"
    to place tensors (once, process-wide).

    This package, scripts and users move batches, models and counters to the GPU behind that
    question; answered False, the CPU run takes the host path and the audit has nothing to see.
    It stays False for torch, megatron-core (which asks it to pick kernels and stream tricks), the
    CPU layer, and :data:`_HOST_DECISIONS`, the start-up modules whose answer picks the
    process set-up the CPU run must keep (backend and device index, RNG state kinds, kernels).
    """
    with _install_lock:
        is_available = torch.cuda.is_available
        if getattr(is_available, "_device_audit", False):
            return

        def is_available_to_placement() -> bool:
            module = sys._getframe(1).f_globals.get("__name__", "")
            if module.split(".")[0] in ("torch", "megatron") or module.startswith(_HOST_DECISIONS):
                return is_available()
            return True

        is_available_to_placement._device_audit = True
        torch.cuda.is_available = is_available_to_placement


def _caller() -> str:
    """``file:line (function)`` of the innermost frame outside torch and this CPU layer."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP_DIRS) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno} (in {frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown location>"


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"


class DeviceAudit(TorchDispatchMode):
    """Dispatch mode keeping a shadow device per tensor and failing where CUDA would; see the
    module docstring for the marks and the rules."""

    def __init__(self):
        super().__init__()
        self._on_device = WeakTensorKeyDictionary()  # tensor -> True (device) / False (host)
        #: the CPU device object a CPU run uses as its run device (:func:`run_device`): tensors made
        #: or moved with this very object are on the device, with any other ``cpu`` on the host
        self.run_device = torch.device("cpu")

    # -- marks ------------------------------------------------------------------------------

    def on_device(self, tensor: torch.Tensor) -> bool:
        return self._on_device.get(tensor, False)

    def set_marks(self, value: Any, on_device: bool) -> None:
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor):
                self._on_device[tensor] = on_device

    def shadow_device(self, tensor: torch.Tensor, device: torch.device, frame) -> torch.device:
        """``tensor.device`` as code outside torch sees it: CUDA device 0 for a tensor on the
        device (so ``device=x.device`` and ``.to(x.device)`` follow it), else ``device``;
        ``frame`` is the reading frame."""
        if not self.on_device(tensor) or frame.f_globals.get("__name__", "").startswith("torch"):
            return device
        return _CUDA0

    def check_host(self, tensor: torch.Tensor, kind: str) -> None:
        """Fail when ``tensor``, which ``kind`` needs on the host, is on the device."""
        if self.on_device(tensor):
            raise DeviceMixError(
                f"device audit: {kind} at {_caller()} takes a tensor ({_describe(tensor)}) on the device: a GPU run "
                f"fails here (only host tensors convert)"
            )

    # -- the operations ---------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._check_c10d(func, args, kwargs)
            return func(*args, **kwargs)
        any_device = self._check(func, args, kwargs)
        result = func(*args, **kwargs)
        if any_device is None:  # a factory: host, unless the autograd engine fills in a gradient
            any_device = torch._C._current_graph_task_id() != -1
        written = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor) and id(tensor) not in written:
                self._on_device[tensor] = any_device
        return result

    def _check(self, func, args, kwargs) -> Optional[bool]:
        """Check one operation; return whether a tensor operand is on the device (None: no
        tensor operand)."""
        operands = []  # (name, tensor, written)
        indexing = func._schema.name.split("::")[-1] in _INDEXING
        for position, argument in enumerate(func._schema.arguments):
            if position < len(args):
                value = args[position]
            elif argument.name in kwargs:
                value = kwargs[argument.name]
            else:
                continue
            if indexing and argument.name == "indices":
                continue
            written = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in tree_flatten(value)[0]:
                if isinstance(tensor, torch.Tensor):
                    operands.append((argument.name, tensor, written))
        if not operands:
            return None
        marks = [self.on_device(tensor) for _, tensor, _ in operands]
        any_device = any(marks)
        if any_device and func not in _COPIES:
            for (name, tensor, written), on_device in zip(operands, marks):
                if on_device or (tensor.dim() == 0 and not written):
                    continue
                role = "writes into" if written else "reads"
                device_operand = next(n for (n, _, _), d in zip(operands, marks) if d)
                raise DeviceMixError(
                    f"device audit: {func} at {_caller()} {role} `{name}` ({_describe(tensor)}) on the host "
                    f"while `{device_operand}` is on the device: a GPU run fails here (Expected all tensors to be "
                    f"on the same device)"
                )
        return any_device

    def _check_c10d(self, func, args, kwargs) -> None:
        if func.__name__.split(".")[0] in _C10D_OWN_TENSORS or _in_object_collective():
            return
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        groups = [g for g in flat if isinstance(g, torch.ScriptObject)]
        self.check_communication(str(func), tensors, groups[0] if groups else None)

    def check_communication(self, kind: str, tensors, group: Any) -> None:
        if _group_name(group) in _gloo_groups:
            return
        for position, tensor in enumerate(tensors):
            if not self.on_device(tensor):
                raise DeviceMixError(
                    f"device audit: {kind} at {_caller()} passes tensor {position} ({_describe(tensor)}) on the host "
                    f"to a group that is NCCL on GPUs: a GPU run fails here (NCCL moves device tensors only)"
                )


def _group_name(group: Any) -> str:
    """A process group's name, for a ``dist.ProcessGroup``, its script object or None (default)."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return group.group_name
