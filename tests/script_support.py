"""Loading a file of ``scripts/`` as a module, for the tests of the scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def load_script(name: str, module_name: str = "") -> ModuleType:
    """``scripts/<name>.py`` as the module ``module_name`` (default ``name``), registered in
    ``sys.modules`` under that name (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(module_name or name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
