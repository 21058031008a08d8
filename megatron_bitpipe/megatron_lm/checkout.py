"""Finding a Megatron-LM checkout and checking that it is the version the plugin supports.

A checkout is a directory holding ``megatron/training/`` (Megatron-LM's training loop, not part
of the megatron-core wheel) and ``megatron/core/package_info.py``. The supported checkout is
tag :data:`SUPPORTED_TAG`, whose megatron-core version is :data:`SUPPORTED_CORE_VERSION`.

:func:`resolve_script` turns the script argument of ``python -m megatron_bitpipe.run`` into
an absolute path and its checkout: an existing path is used as given, otherwise it is looked
up under ``$MEGATRON_LM_PATH``. Every failure raises :class:`MegatronLMCheckoutError` with a
message that names the path, ``MEGATRON_LM_PATH`` and the expected tag. Pure Python: nothing
is imported from the checkout.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

__all__ = [
    "SUPPORTED_TAG",
    "SUPPORTED_CORE_VERSION",
    "ENV_VAR",
    "MegatronLMCheckoutError",
    "Checkout",
    "checkout_version",
    "find_checkout",
    "resolve_script",
]

SUPPORTED_TAG = "core_v0.16.1"
SUPPORTED_CORE_VERSION = "0.16.1"
ENV_VAR = "MEGATRON_LM_PATH"
_PACKAGE_INFO = Path("megatron", "core", "package_info.py")
_TRAINING = Path("megatron", "training")


class MegatronLMCheckoutError(RuntimeError):
    """No usable Megatron-LM checkout: missing, not a checkout, or the wrong version."""


@dataclass(frozen=True)
class Checkout:
    """A Megatron-LM checkout of the supported version (``root`` is absolute)."""

    root: Path
    version: str


def checkout_version(root: Path) -> str:
    """megatron-core version recorded in ``root/megatron/core/package_info.py`` (``"0.16.1"``).

    Read without importing the checkout. Raises :class:`MegatronLMCheckoutError` if the file is
    missing or does not define ``MAJOR``, ``MINOR`` and ``PATCH``.
    """
    path = root / _PACKAGE_INFO
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError) as error:
        raise MegatronLMCheckoutError(f"cannot read the megatron-core version of {root}: {error}") from None
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    try:
        version = f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}"
    except KeyError:
        raise MegatronLMCheckoutError(f"{path} does not define MAJOR, MINOR and PATCH") from None
    return version + str(values.get("PRE_RELEASE", ""))


def find_checkout(start: Path) -> Checkout:
    """The supported checkout containing ``start`` (a file or directory inside it, or its root).

    Walks up from ``start`` to the first directory holding ``megatron/training``; raises
    :class:`MegatronLMCheckoutError` if there is none or its version is not
    :data:`SUPPORTED_CORE_VERSION`.
    """
    start = start.resolve()
    for directory in [start, *start.parents] if start.is_dir() else list(start.parents):
        if (directory / _TRAINING).is_dir():
            break
    else:
        raise MegatronLMCheckoutError(
            f"{start} is not inside a Megatron-LM checkout (no megatron/training/ in it or above it); "
            f"clone https://github.com/NVIDIA/Megatron-LM at tag {SUPPORTED_TAG} and set {ENV_VAR} to it"
        )
    version = checkout_version(directory)
    if version != SUPPORTED_CORE_VERSION:
        raise MegatronLMCheckoutError(
            f"the Megatron-LM checkout {directory} is megatron-core {version} "
            f"(megatron/core/package_info.py); megatron-bitpipe supports tag {SUPPORTED_TAG} "
            f"(megatron-core {SUPPORTED_CORE_VERSION}): run git -C {directory} checkout {SUPPORTED_TAG}"
        )
    return Checkout(directory, version)


def resolve_script(script: str, environ: Optional[Mapping[str, str]] = None) -> tuple[Path, Checkout]:
    """The absolute path of ``script`` and the checkout it belongs to.

    ``script`` is used as given if it exists; otherwise it is taken relative to
    ``$MEGATRON_LM_PATH`` (``environ`` defaults to ``os.environ``), e.g. ``pretrain_gpt.py``.
    """
    environ = os.environ if environ is None else environ
    given = Path(script)
    if given.is_file():
        return given.resolve(), find_checkout(given)
    root = environ.get(ENV_VAR)
    if not root:
        raise MegatronLMCheckoutError(
            f"{script}: no such file, and {ENV_VAR} is not set; give the path of a script in a "
            f"Megatron-LM checkout (tag {SUPPORTED_TAG}), e.g. /path/to/Megatron-LM/pretrain_gpt.py, "
            f"or set {ENV_VAR}=/path/to/Megatron-LM"
        )
    if not Path(root, _TRAINING).is_dir():
        raise MegatronLMCheckoutError(
            f"{ENV_VAR}={root} is not a Megatron-LM checkout (no megatron/training/ in it); "
            f"point it at a clone of https://github.com/NVIDIA/Megatron-LM at tag {SUPPORTED_TAG}"
        )
    candidate = Path(root, script)
    if not candidate.is_file():
        raise MegatronLMCheckoutError(f"{script}: no such file, neither as given nor in {ENV_VAR}={root}")
    return candidate.resolve(), find_checkout(Path(root))
