"""Run megatron-core on a CPU-only torch with the gloo backend.

A supported feature: the pretraining scripts fall back to it when no GPU is present, the
Megatron-LM CPU entry point (:mod:`.megatron_lm`) and the multi-rank tests and benchmarks use it.

megatron-core assumes a CUDA device in a few dozen places: it allocates buffers on
``torch.cuda.current_device()`` or ``device="cuda"``, moves tensors with ``.cuda()``, keeps
its model-parallel RNG streams in the CUDA generator, synchronises the device after p2p,
and asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` before clipping.
:func:`enable_cpu_megatron` makes all of that run on the CPU, unchanged:

* **Device mode** (:class:`CpuDeviceMode`, a ``TorchFunctionMode``). Every torch call passes
  through it; it rewrites a CUDA device argument (``"cuda"``, ``"cuda:N"``,
  ``torch.device("cuda", N)`` or a bare device index ``N``) to ``"cpu"``, makes
  ``Tensor.cuda()`` return the tensor itself, and makes ``Tensor.type()`` report a CPU tensor
  under its CUDA type name (``clip_grad_by_total_norm_fp32`` asserts
  ``'torch.cuda.FloatTensor'``). Nothing else is touched, so the math is the CPU math.
  Hit by: DDP grad buffers, schedules' token counters, optimizer and clip-grad scalars,
  p2p receive buffers, attention masks, the tied head's ``.cuda()``.
* **Function patches** (each with a one-line reason in :func:`_patches`):

  - ``torch.cuda.current_device`` -> ``0``: buffers, p2p receive tensors and shape tensors are
    allocated on it (the device mode turns index 0 into the CPU).
  - ``torch.cuda.synchronize`` -> no-op: called after every batched p2p exchange
    (``batch_p2p_comm`` with ``batch_p2p_sync``, megatron's defaults).
  - ``torch.cuda.Stream``, ``torch.cuda.current_stream`` and ``torch.cuda.stream`` -> a
    stand-in stream that orders nothing (:class:`CpuStream`; the CPU runs in program order):
    megatron DDP's gradient reduction waits on the current stream (0.19), Megatron-LM's
    ``get_model`` builds DDP on a side stream, and the MoE all-to-all dispatcher records an
    event on its device-to-host stream (:class:`CpuEvent`) and synchronises on it.
  - ``torch.cuda.get_rng_state`` / ``torch.cuda.random.get_rng_state`` ->
    ``torch.get_rng_state``, ``torch.cuda.manual_seed`` -> ``torch.manual_seed`` of the CPU
    default generator, and megatron's ``tensor_parallel.random._set_cuda_rng_state`` ->
    ``torch.set_rng_state``: the RNG tracker (``model_parallel_cuda_manual_seed``,
    ``get_cuda_rng_tracker().fork()``) keeps and swaps "CUDA" generator states; on the CPU the
    generator that dropout actually draws from is the CPU default generator, so that is the one
    the tracker must swap. (CPU-only torch would otherwise raise, or queue the seed forever.)
  - ``torch.autograd._engine_run_backward`` runs inside the device mode: the mode is popped
    while it handles ``Tensor.backward`` / ``torch.autograd.backward``, so backward functions
    that allocate on ``current_device()`` (sequence-parallel gathers) would otherwise fail.
  - megatron's unbatched p2p (``p2p_communication._p2p_ops``) sends a private copy of each
    tensor (:func:`_sending_private_copies`): gloo reads a send's bytes only when the receiver
    has posted its receive, after ``isend`` returned, and the interleaved schedule with
    ``overlap_p2p_comm`` (Megatron-LM's default) frees a sent output at once
    (``deallocate_output_tensor`` swaps its storage for one element), so the receiver got freed
    memory: NaN or wrong numbers, depending on timing. The copy lives as long as the send's
    handle, which megatron waits on before it sends again. The batched path waits before it
    returns and is left alone.
  - the MoE all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` -> the same that also
    converts a CPU tensor to numpy where asked (:func:`_host_copy`): megatron converts only
    CUDA tensors, keeping the all-to-all split sizes a CPU run computes as tensors, which
    ``all_to_all_single`` refuses (it takes lists of ints or arrays).
  - ``torch._dynamo.config.disable = True``: megatron's ``jit_fuser`` is ``torch.compile``
    (the native fused cross entropy, some activations); compiling them on the CPU costs
    about ten seconds per process, and eager execution gives the same values.
  - a logging filter drops the tracker's "CPU RNG state changed within GPU RNG context"
    warning, which is meaningless once the two generators are the same one.

* **Device audit** (opt-in): with ``MEGATRON_BITPIPE_DEVICE_AUDIT=1``,
  :func:`enable_cpu_megatron` pushes :class:`~.device_audit.DeviceAudit` and hands it to the
  device mode, so that a CPU run fails where a GPU run would mix host and device tensors
  (see :mod:`.device_audit`).
* **Strict p2p mode** (opt-in): with ``MEGATRON_BITPIPE_STRICT_P2P=1`` in the environment,
  :func:`enable_cpu_megatron` also installs :mod:`.strict_p2p`, which makes point-to-point
  communication on gloo groups follow NCCL's rules (a group runs a rank's operations in issue
  order, a send completes only when the peer's matching receive is active, an unbatched
  operation on a group of more than two ranks runs on the pair's communicator, whose creation
  on first use blocks until both ranks arrive, a wait longer than
  ``MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT`` seconds fails naming rank, group and operation), so
  that no CPU run passes with an order that would hang on GPUs. Process-wide and idempotent
  like the patches; one line on stderr says it is on.

Invariants:

* Idempotent: calling :func:`enable_cpu_megatron` again changes nothing.
* The function patches are process-wide. The device mode is a torch function mode, and those
  are thread-local: it is pushed on the calling thread, normally the main thread, which runs
  megatron's schedules and the forward and backward of CPU tensors. Call
  :func:`enable_cpu_megatron` again on any other thread that calls megatron-core.
* Only for CPU-only torch: with CUDA available this module refuses to run, so a GPU process can
  never silently train on the CPU. The library itself (schedules, model, execution, optimus, training)
  never imports it: entry points opt in.

Config choices that avoid further patches are documented in
:func:`megatron_bitpipe.benchmarking.megatron_baseline.tiny_gpt_config` (``use_cpu_initialization``, no
fused kernels, ``cross_entropy_fusion_impl='native'``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Tuple

import torch
import torch._dynamo
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from . import device_audit, strict_p2p

__all__ = ["CpuDeviceMode", "CpuEvent", "CpuStream", "enable_cpu_megatron", "is_cpu_megatron_enabled"]

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"

_lock = threading.Lock()
_patched = False


def _is_cuda_device(device: Any) -> bool:
    """True for every way torch accepts to name a CUDA device."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index means a CUDA device
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _to_cpu(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


class CpuDeviceMode(TorchFunctionMode):
    """Torch function mode that maps the CUDA device onto the CPU.

    Rewrites: a ``device=`` keyword naming a CUDA device (factory functions, ``Tensor.to``,
    ``Tensor.new_*``...), a CUDA device passed positionally to ``Tensor.to``, ``pin_memory=True``
    (to False: megatron's RoPE split of a context-parallel rank's positions asks for it),
    ``Tensor.cuda()`` (returns the tensor), ``Tensor.type()`` without arguments (CUDA type
    name for a CPU tensor). Every other call runs unchanged.

    With ``audit`` (a :class:`~.device_audit.DeviceAudit` on this thread) it also tells the audit
    what the device arguments named before they became the CPU: results made or moved on a CUDA
    device are marked on the device, ``.cpu()`` / ``device="cpu"`` results on the host, and
    ``x.device`` of a tensor on the device reads as CUDA device 0 outside torch.
    """

    def __init__(self, audit: "device_audit.DeviceAudit | None" = None):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func: Callable, types: Tuple, args: Tuple = (), kwargs: Dict | None = None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):  # page-locked host memory serves copies to a GPU; there is none
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            # megatron moves already-allocated tensors with .cuda(); they already are "there".
            if self.audit is not None:
                self.audit.set_marks(args[0], on_device=True)
            return args[0]
        if self.audit is not None:
            if type(func) is _METHOD_WRAPPER and func == _DEVICE_GET:
                # ``device=x.device`` of a tensor on the device names the device
                return self.audit.shadow_device(args[0], func(*args, **kwargs), sys._getframe(1))
            if type(func) is _METHOD_WRAPPER and func in (_DATA_GET, _DATA_SET):
                # ``x.data`` is a new alias of x's storage each time it is read, on x's device;
                # ``x.data = y`` puts x on y's device (megatron: ``w.data = w.data.cuda()``)
                result = func(*args, **kwargs)
                source, target = (args[0], result) if func == _DATA_GET else (args[1], args[0])
                self.audit.set_marks(target, self.audit.on_device(source))
                return result
            target = _target_device(func, args, kwargs)
            if target is not None:
                return _audited_move(self.audit, func, _on_cpu(func, args), _on_cpu_kwargs(kwargs), target)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1])) + tuple(args[2:])
        if type(func) is _METHOD_WRAPPER and func == _GRAD_GET and not args[0].is_leaf and _megatron_calls():
            # megatron's distributed optimizer reads .grad of its fp32 shards, views of the
            # parameters (megatron: "throws grad-access warning"); torch would blame this line
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD_WARNING, category=UserWarning)
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads asserts param.grad.type() == 'torch.cuda.FloatTensor'.
            return _CUDA_TYPE_NAMES.get(result, result)
        return result


def _target_device(func: Callable, args: Tuple, kwargs: Dict) -> Any:
    """The device a call names for its result (``device=``, ``Tensor.to``'s positional device or
    tensor, ``Tensor.cpu``), before the device mode rewrites it; None when it names none."""
    if func is torch.Tensor.cpu or func is torch.Tensor.numpy:
        return _CPU
    if "device" in kwargs and kwargs["device"] is not None:
        return kwargs["device"]
    if func is torch.Tensor.to and len(args) > 1:
        if isinstance(args[1], torch.Tensor):
            return args[1]
        if isinstance(args[1], (str, int, torch.device)) and not isinstance(args[1], bool):
            return args[1]
    return None


def _on_cpu(func: Callable, args: Tuple) -> Tuple:
    """``args`` with ``Tensor.to``'s positional CUDA device made the CPU."""
    if func is torch.Tensor.to and len(args) > 1:
        return (args[0], _to_cpu(args[1])) + tuple(args[2:])
    return args


def _on_cpu_kwargs(kwargs: Dict) -> Dict:
    if "device" in kwargs:
        kwargs["device"] = _to_cpu(kwargs["device"])
    return kwargs


def _audited_move(audit: "device_audit.DeviceAudit", func: Callable, args: Tuple, kwargs: Dict, target: Any):
    """Run a call that names the device ``target`` under the device audit: mark its result there
    (a host result of a tensor on the device is a fresh view, so the source keeps its mark;
    ``Tensor.numpy`` of a device tensor fails)."""
    if isinstance(target, torch.Tensor):
        on_device = audit.on_device(target)
    else:
        on_device = _is_cuda_device(target) or target is audit.run_device
    if func is torch.Tensor.numpy:
        audit.check_host(args[0], "Tensor.numpy")
        return func(*args, **kwargs)
    result = func(*args, **kwargs)
    if isinstance(result, torch.Tensor):
        if args and result is args[0] and not on_device and audit.on_device(result):
            result = result.view_as(result)  # .cpu() of a device tensor: a new tensor, the source stays
        audit.set_marks(result, on_device)
    return result


_GRAD_GET = torch.Tensor.grad.__get__
_DEVICE_GET = torch.Tensor.device.__get__
_DATA_GET, _DATA_SET = torch.Tensor.data.__get__, torch.Tensor.data.__set__
_METHOD_WRAPPER = type(_GRAD_GET)
#: torch's warning on reading ``.grad`` of a tensor that is not a leaf
_NON_LEAF_GRAD_WARNING = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"
#: megatron-core's advice for CUDA streams (async TP all-reduce, sequence parallelism):
#: meaningless on the CPU
_CUDA_CONNECTIONS_WARNING = r"When using .* it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS"


def _megatron_calls() -> bool:
    """True when the code reading the attribute (two frames up) is megatron-core's."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron.core.")


class CpuEvent:
    """Stand-in for a CUDA event recorded on a :class:`CpuStream`: already complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuStream:
    """Stand-in for a CUDA stream: the CPU executes everything in program order, so every
    wait and synchronisation is already satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        pass


class _DropRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Replacement for megatron's ``_set_cuda_rng_state``: set the CPU default generator."""
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on the CPU")
    torch.set_rng_state(new_state)


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _in_device_mode(run_backward: Callable) -> Callable:
    """``run_backward`` with the device mode pushed while it runs.

    ``Tensor.backward`` and ``torch.autograd.backward/grad`` are torch functions: the mode
    handles them, and a mode is popped while it handles a call, so every backward function
    (megatron's sequence-parallel gathers, for one, allocate on ``current_device()``) would
    run without it. The autograd engine entry point is below that dispatch.
    """

    def run_in_device_mode(*args, **kwargs):
        with CpuDeviceMode(device_audit.active_audit()):
            return run_backward(*args, **kwargs)

    return run_in_device_mode


def _sending_private_copies(p2p_ops: Callable) -> Callable:
    """megatron's ``_p2p_ops`` (keyword-only tensors, groups and ranks) sending a copy of each
    tensor it sends; receives and the returned handles are unchanged.

    The copy is referenced by gloo's send work alone, so it lives exactly until the handle is
    released: nothing the schedule does to the original afterwards (freeing an output's storage,
    writing a buffer) reaches the wire.
    """

    def p2p_ops_sending_copies(*, tensor_send_prev, tensor_send_next, **kwargs):
        return p2p_ops(
            tensor_send_prev=None if tensor_send_prev is None else tensor_send_prev.detach().clone(),
            tensor_send_next=None if tensor_send_next is None else tensor_send_next.detach().clone(),
            **kwargs,
        )

    return p2p_ops_sending_copies


def _host_copy(move_to_cpu: Callable) -> Callable:
    """megatron's ``maybe_move_tensor_to_cpu(tensor, as_numpy, record_stream)`` that also gives
    a CPU tensor as numpy when ``as_numpy`` asks: through ``.cpu()``, the host copy a GPU run
    makes first (under the device audit the tensor may be on the device)."""

    def host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.cpu().numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return host_copy


def _patches() -> list:
    """(owner, attribute, replacement) triples; the comment says why each is needed."""
    import megatron.core.pipeline_parallel.p2p_communication as mcore_p2p
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.token_dispatcher as mcore_dispatcher

    moe = []
    if hasattr(mcore_dispatcher, "maybe_move_tensor_to_cpu"):
        # The all-to-all dispatcher's split sizes must reach all_to_all_single as host arrays.
        moe.append((mcore_dispatcher, "maybe_move_tensor_to_cpu", _host_copy(mcore_dispatcher.maybe_move_tensor_to_cpu)))
    return moe + [
        # Buffers, p2p receive and shape tensors are allocated on current_device().
        (torch.cuda, "current_device", lambda: 0),
        # Called after batched p2p (batch_p2p_sync) and when freeing / allocating buffers.
        (torch.cuda, "synchronize", lambda device=None: None),
        # DDP's gradient reduction waits on the current stream; Megatron-LM's get_model builds
        # DDP inside a side stream.
        (torch.cuda, "Stream", CpuStream),
        (torch.cuda, "current_stream", lambda device=None: CpuStream()),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        # RNG tracker and model_parallel_cuda_manual_seed read the "CUDA" generator state.
        (torch.cuda, "get_rng_state", _get_rng_state),
        (torch.cuda.random, "get_rng_state", _get_rng_state),
        # model_parallel_cuda_manual_seed seeds the data-parallel stream with it.
        (torch.cuda, "manual_seed", _manual_seed),
        # RNG tracker fork() swaps generator states through this helper.
        (mcore_random, "_set_cuda_rng_state", _set_rng_state),
        # Backward functions allocate on the "CUDA" device too; see _in_device_mode.
        (torch.autograd, "_engine_run_backward", _in_device_mode(torch.autograd._engine_run_backward)),
        # gloo reads a send's bytes after isend returned; overlapped p2p frees sent outputs.
        (mcore_p2p, "_p2p_ops", _sending_private_copies(mcore_p2p._p2p_ops)),
    ]


def _apply_process_patches() -> None:
    global _patched
    with _lock:
        if _patched:
            return
        if torch.cuda.is_available():
            raise RuntimeError("enable_cpu_megatron() is for CPU-only torch; CUDA is available here")
        for owner, name, replacement in _patches():
            setattr(owner, name, replacement)
        torch._dynamo.config.disable = True  # jit_fuser == torch.compile: slow on CPU, same math
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropRngWarning())
        warnings.filterwarnings("ignore", message=_CUDA_CONNECTIONS_WARNING, category=UserWarning,
                                module=r"megatron\.core\.tensor_parallel\.layers")
        _patched = True


def _mode_active() -> bool:
    return any(isinstance(mode, CpuDeviceMode) for mode in _get_current_function_mode_stack())


def enable_cpu_megatron() -> torch.device:
    """Make megatron-core run on the CPU in this process (and the device mode on this thread);
    returns the device a run places its model and batches on: the CPU, or under the device
    audit its stand-in for the GPU (:func:`~.device_audit.run_device`).

    Safe to call any number of times; see the module docstring for what is patched.
    """
    _apply_process_patches()
    strict_p2p.install_from_env()
    audit = device_audit.install_from_env()
    if not _mode_active():
        # Entered for the life of the thread: megatron's allocations happen everywhere.
        CpuDeviceMode(audit).__enter__()
    return device_audit.run_device(_CPU)


def is_cpu_megatron_enabled() -> bool:
    """Whether the patches are applied and the device mode is active on this thread."""
    return _patched and _mode_active()
