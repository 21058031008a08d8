"""Finding a Megatron-LM checkout and telling whether it is a tested release.

A checkout is a directory holding ``megatron/training/`` (Megatron-LM's training loop) and
``megatron/core/package_info.py``. The plugin is tested with the release tags in
:data:`TESTED_TAGS`; a checkout is recognised by the megatron-core version its
``package_info.py`` records (tag core_v0.19.0 records 0.19.1: the release bumped the version
file before tagging). A checkout of another version still runs, after one warning line
(:func:`untested_warning`).

:func:`resolve_script` turns the script argument of ``python -m megatron_bitpipe.run`` into
an absolute path and its checkout: an existing path is used as given, otherwise it is looked
up under ``$MEGATRON_LM_PATH``. Every failure raises :class:`MegatronLMCheckoutError` with a
message that names the path, ``MEGATRON_LM_PATH`` and the tested tags.
:func:`bitpipe_refusal` says why a script of a tested tag cannot run with ``--pipeline-schedule
bitpipe``, for the few that cannot (BERT at core_v0.16.1, the hybrid models' scripts), before
the script is loaded. Pure Python: nothing is
imported from the checkout.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Tuple

__all__ = [
    "TESTED_TAGS",
    "ENV_VAR",
    "MegatronLMCheckoutError",
    "Checkout",
    "tested_tags_text",
    "version_tuple",
    "checkout_version",
    "find_checkout",
    "resolve_script",
    "untested_warning",
    "bitpipe_refusal",
    "running_script_refusal",
]

TESTED_TAGS = {"core_v0.16.1": "0.16.1", "core_v0.19.0": "0.19.1"}
"""Megatron-LM release tag -> the megatron-core version its ``package_info.py`` records."""
ENV_VAR = "MEGATRON_LM_PATH"
_HYBRID_SCRIPT = (
    "the script builds a hybrid (Mamba) model, {model}, whose layer pattern picks each pipeline stage's layers in "
    "megatron's looped order, so {schedule}'s chunks (explicit layer ranges on its own stages) cannot be built from "
    "it; {schedule} runs GPT models (pretrain_gpt.py)"
)
_BITPIPE_UNSUPPORTED = {
    ("core_v0.16.1", "pretrain_bert.py"): (
        "the script imports Transformer Engine's BERT layer spec when it loads (whatever --spec says, so it does not "
        "load without transformer-engine), and its model_provider builds BertModel without the pg_collection it is "
        "given, so {schedule} cannot build its chunks on their own process groups; BERT with {schedule} runs in "
        "megatron-bitpipe's scripts/pretrain_bert.py"
    ),
    ("core_v0.16.1", "pretrain_mamba.py"): _HYBRID_SCRIPT.replace("{model}", "MambaModel"),
    ("core_v0.19.0", "pretrain_mamba.py"): _HYBRID_SCRIPT.replace("{model}", "HybridModel (through pretrain_hybrid.py)"),
    ("core_v0.19.0", "pretrain_hybrid.py"): _HYBRID_SCRIPT.replace("{model}", "HybridModel"),
}
"""(tag, script at the checkout root) -> why a plan schedule (``{schedule}`` in the text) cannot run it
and what runs instead."""
_PACKAGE_INFO = Path("megatron", "core", "package_info.py")
_TRAINING = Path("megatron", "training")


class MegatronLMCheckoutError(RuntimeError):
    """No usable Megatron-LM checkout: missing, or not a checkout."""


def tested_tags_text() -> str:
    """The tested tags for messages: ``core_v0.16.1 or core_v0.19.0``."""
    return " or ".join(TESTED_TAGS)


def version_tuple(version: str) -> Tuple[int, ...]:
    """``"0.19.1rc0"`` -> ``(0, 19, 1)``: the numeric release, for ordering."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split("."))


@dataclass(frozen=True)
class Checkout:
    """A Megatron-LM checkout (``root`` is absolute) and its megatron-core version."""

    root: Path
    version: str

    @property
    def tag(self) -> Optional[str]:
        """The tested release tag this checkout is, None for any other version."""
        return next((tag for tag, version in TESTED_TAGS.items() if version == self.version), None)


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


def untested_warning(checkout: Checkout) -> Optional[str]:
    """The warning for a checkout that is not a tested tag (None for a tested one)."""
    if checkout.tag is not None:
        return None
    tested = ", ".join(f"{tag} (megatron-core {version})" for tag, version in TESTED_TAGS.items())
    return (
        f"the Megatron-LM checkout {checkout.root} is megatron-core {checkout.version} "
        f"(megatron/core/package_info.py); megatron-bitpipe is tested with tags {tested}; continuing"
    )


def bitpipe_refusal(script: Path, checkout: Checkout, *, schedule: str) -> Optional[str]:
    """Why ``--pipeline-schedule schedule`` (one this package's plan executor runs) cannot run
    ``script`` (absolute) of ``checkout``, or None: Megatron-LM core_v0.16.1's
    ``pretrain_bert.py`` (BERT with a plan schedule: megatron-bitpipe's ``scripts/pretrain_bert.py``)
    and the hybrid (Mamba) models' scripts, ``pretrain_mamba.py`` at both tested tags and
    ``pretrain_hybrid.py`` at core_v0.19.0. One line, naming the script."""
    reason = _BITPIPE_UNSUPPORTED.get((checkout.tag, script.name)) if script.parent == checkout.root else None
    if reason is None:
        return None
    return f"--pipeline-schedule {schedule} cannot run Megatron-LM {checkout.tag}'s {script.name}: {reason.format(schedule=schedule)}"


def running_script_refusal(script: str, *, schedule: str) -> Optional[str]:
    """:func:`bitpipe_refusal` for ``script`` (the path Python runs, ``sys.argv[0]``) when it is a
    file inside a Megatron-LM checkout, else None: the patch route's check (a patched script runs
    without ``python -m megatron_bitpipe.run``, which refuses before the script loads)."""
    path = Path(script)
    if not path.is_file():
        return None
    try:
        checkout = find_checkout(path)
    except MegatronLMCheckoutError:
        return None
    return bitpipe_refusal(path.resolve(), checkout, schedule=schedule)


def find_checkout(start: Path) -> Checkout:
    """The checkout containing ``start`` (a file or directory inside it, or its root).

    Walks up from ``start`` to the first directory holding ``megatron/training``; raises
    :class:`MegatronLMCheckoutError` if there is none or its version cannot be read.
    """
    start = start.resolve()
    for directory in [start, *start.parents] if start.is_dir() else list(start.parents):
        if (directory / _TRAINING).is_dir():
            break
    else:
        raise MegatronLMCheckoutError(
            f"{start} is not inside a Megatron-LM checkout (no megatron/training/ in it or above it); "
            f"clone https://github.com/NVIDIA/Megatron-LM at tag {tested_tags_text()} and set {ENV_VAR} to it"
        )
    return Checkout(directory, checkout_version(directory))


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
            f"Megatron-LM checkout (tag {tested_tags_text()}), e.g. /path/to/Megatron-LM/pretrain_gpt.py, "
            f"or set {ENV_VAR}=/path/to/Megatron-LM"
        )
    if not Path(root, _TRAINING).is_dir():
        raise MegatronLMCheckoutError(
            f"{ENV_VAR}={root} is not a Megatron-LM checkout (no megatron/training/ in it); "
            f"point it at a clone of https://github.com/NVIDIA/Megatron-LM at tag {tested_tags_text()}"
        )
    candidate = Path(root, script)
    if not candidate.is_file():
        raise MegatronLMCheckoutError(f"{script}: no such file, neither as given nor in {ENV_VAR}={root}")
    return candidate.resolve(), find_checkout(Path(root))
