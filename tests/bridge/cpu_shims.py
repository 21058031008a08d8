"""What Megatron-Bridge 0.6 needs to import and start on a CPU-only torch with Python 3.11.

Test-only (the package never imports this): :func:`enable_bridge_on_cpu` before Bridge is
imported, then :func:`start_bridge_on_cpu` on each rank before ``pretrain``.

Import time:

* ``typing.override`` (Python 3.12, which Bridge declares) is ``typing_extensions.override``
  (both only mark a method at definition time).
* ``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` at module level
  (its LoRA adapters for TE linears), and ``import megatron.bridge`` imports it: while that one
  module executes, a stand-in ``transformer_engine.pytorch`` is in ``sys.modules``, and removed
  after; the other modules it imports are imported before, so every other ``import
  transformer_engine`` still fails as without TE. Every name the
  module reads from it (``te.ops.Sequential`` in annotations, ``te.Linear`` in ``isinstance``)
  is a class of its own that nothing is an instance of.
* nvidia-resiliency-ext: ``megatron.bridge.training.pretrain`` imports
  ``nvidia_resiliency_ext.inprocess.CallWrapper`` (an annotation; in-process restart is off)
  at module level. The registry's newest release (0.4.1 here) is older than Bridge's and lacks
  the ``__version__`` megatron-core 0.19.2 reads once its checkpointing modules import, so
  neither is installed: a stand-in package holds ``inprocess.CallWrapper`` and
  ``__version__ = "0.0.0"``, and no ``checkpointing`` module, so megatron-core and Bridge find
  no asynchronous checkpointing through it (their checks import it and fall back).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import typing

import typing_extensions

_LORA_LAYERS = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


class _Absent(type):
    """Classes standing in for Transformer Engine's names; their attributes are more of them."""

    def __getattr__(cls, name: str) -> "_Absent":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{cls.__name__}.{name}", (), {})


class _WithTransformerEngineStandIn(importlib.abc.Loader):
    """Runs one module's code with a stand-in ``transformer_engine.pytorch`` importable."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        for name in _imported_modules(module.__spec__.origin):  # first, so none of them sees the stand-in
            if not name.startswith(_TE_NAMES[0]):
                importlib.import_module(name)
        package = types.ModuleType("transformer_engine")
        package.pytorch = types.ModuleType("transformer_engine.pytorch")
        package.pytorch.__getattr__ = lambda name: getattr(_Absent("transformer_engine.pytorch", (), {}), name)
        sys.modules.update({"transformer_engine": package, "transformer_engine.pytorch": package.pytorch})
        try:
            self.loader.exec_module(module)
        finally:
            for name in _TE_NAMES:
                sys.modules.pop(name, None)


def _imported_modules(path: str):
    """The absolute module names a source file imports at its top level."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _WithTransformerEngineStandIn(spec.loader)
        return spec


def start_bridge_on_cpu() -> None:
    """megatron-core's CPU layer (:func:`megatron_bitpipe.cpu.compat.enable_cpu_megatron`) and
    Bridge's start-up on a CPU-only torch. Idempotent; after :func:`enable_bridge_on_cpu`.

    * ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: passed as true;
    * it seeds megatron's model-parallel RNG tracker only if ``torch.cuda.device_count() > 0``
      and then calls ``torch.cuda.set_device``: the count is 1 and ``set_device`` does nothing
      (the device mode maps "cuda" to the CPU);
    * it runs ``make`` in megatron-core's ``datasets`` folder (``compile_helpers``), which the
      wheel ships built and without a Makefile: skipped where the built helpers import;
    * ``set_jit_fusion_options`` warms fused kernels up on the GPU: skipped.
    """
    import torch
    import megatron.bridge.training.initialize as initialize
    import megatron.bridge.training.setup as setup

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    if getattr(setup.initialize_megatron, "allows_no_cuda", False):
        return
    initialize_megatron = setup.initialize_megatron

    def initialize_megatron_on_cpu(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize_megatron_on_cpu.allows_no_cuda = True
    setup.initialize_megatron = initialize_megatron_on_cpu
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    importlib.import_module("megatron.core.datasets.helpers_cpp")
    initialize.compile_helpers = lambda: None
    setup.set_jit_fusion_options = lambda *args, **kwargs: None


def _resiliency_stand_in() -> None:
    package = types.ModuleType("nvidia_resiliency_ext")
    package.__path__ = []
    package.__version__ = "0.0.0"
    package.inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
    package.inprocess.CallWrapper = type("CallWrapper", (), {"__doc__": "stand-in: in-process restart is off"})
    sys.modules.update({"nvidia_resiliency_ext": package, "nvidia_resiliency_ext.inprocess": package.inprocess})


def enable_bridge_on_cpu() -> None:
    """Install the import-time shims (module docstring). Idempotent."""
    if "nvidia_resiliency_ext" not in sys.modules and importlib.util.find_spec("nvidia_resiliency_ext") is None:
        _resiliency_stand_in()
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    if not any(isinstance(finder, _LoraLayersFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())
