"""scripts/import_layers.py: the package's rooms import each other without a circle, and at
most one arrow points up a level.

* the package itself: no circle of modules (TYPE_CHECKING and function-level imports count),
  and no upward import but the one known arrow :data:`KNOWN_UPWARD`;
* a small package written here proves the reading: a circle through a TYPE_CHECKING import, a
  function-level import, a lazily loaded name and an upward arrow are each found.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..script_support import load_script

import_layers = load_script("import_layers")


def test_package_has_no_circle_and_no_upward_import():
    layers = import_layers.analyse()
    assert not layers.circles, layers.report()
    assert not layers.upward, layers.report()
    assert {"model", "execution", "schedules", "training"} <= set(layers.rooms)


def _write(root: Path, files: dict) -> Path:
    package = root / "megatron_bitpipe"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_reading_finds_type_checking_circle_function_import_and_upward_arrow(tmp_path):
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from ..high.b import B
                def f():
                    from ..mid import helper
            """,
            "high/__init__.py": "",
            "high/b.py": "from ..low.a import f\nimport megatron_bitpipe.mid\n",
            "mid.py": """
                from .lazy import thing
                def helper():
                    pass
            """,
            "lazy/__init__.py": """
                import importlib
                _SUBMODULE = {"thing": "inner"}
                def __getattr__(name):
                    return getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
            """,
            "lazy/inner.py": "thing = 1\n",
        },
    )
    layers = import_layers.analyse(package)
    assert layers.rooms == ["__init__", "high", "lazy", "low", "mid"]
    (loop,) = layers.circles
    assert {imp.source for imp in loop} == {"megatron_bitpipe.low.a", "megatron_bitpipe.high.b"}
    assert {imp.kind for imp in loop} == {"type-checking", "module"}
    kinds = {(imp.source, imp.target): imp.kind for imp in layers.imports}
    assert kinds[("megatron_bitpipe.low.a", "megatron_bitpipe.mid")] == "function"
    assert kinds[("megatron_bitpipe.mid", "megatron_bitpipe.lazy.inner")] == "module"
    # low <-> high: one of the two arrows points up; the one with fewer imports behind it
    assert list(layers.upward) in ([("low", "high")], [("high", "low")])
    low, high = next(iter(layers.upward))
    assert layers.levels[low] < layers.levels[high]
    assert layers.levels["lazy"] == 0 and layers.levels["mid"] == 1
