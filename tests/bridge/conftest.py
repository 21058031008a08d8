"""The Megatron-Bridge tests run only where Bridge is installed (its own environment:
``docs/bridge.md#tests``); elsewhere every test here is skipped, saying so.

Where it is, Bridge is imported here, at collection, with the CPU shims (:mod:`.cpu_shims`):
megatron-core 0.19's import runs ``git`` in a subprocess, which the suite's process guard
refuses inside a test that is not marked ``multirank``.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

BRIDGE_MISSING = importlib.util.find_spec("megatron.bridge") is None

if not BRIDGE_MISSING:
    from .cpu_shims import enable_bridge_on_cpu

    enable_bridge_on_cpu()
    importlib.import_module("megatron.bridge.training.pretrain")


def pytest_collection_modifyitems(config, items):
    if not BRIDGE_MISSING:
        return
    skip = pytest.mark.skip(reason="Megatron-Bridge is not installed (its test environment: docs/bridge.md#tests)")
    for item in items:
        if "tests/bridge/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)
