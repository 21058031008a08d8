"""Whether a checkpoint directory can be loaded, checked before anything is loaded.

Shared by the pretrain scripts' loader (:mod:`megatron_bitpipe.training.checkpoint`) and the
guard in front of Megatron-LM's (:mod:`megatron_bitpipe.megatron_lm.checkpointing`):

* :func:`find_checkpoint` — Megatron-LM's tracker file (``latest_checkpointed_iteration.txt``)
  or ``--ckpt-step`` picks the iteration directory; None when ``--load`` holds no checkpoint;
* :func:`checkpoint_format` — what the directory holds: megatron-core's distributed
  checkpoint (``torch_dist``), Megatron-LM's legacy per-rank files (``torch``), a
  ``torch.distributed.checkpoint`` directory (``torch_dcp``), megatron-bitpipe's earlier
  logical format (``logical``), or nothing known;
* :func:`missing_files` — the shard files a ``torch_dist`` checkpoint's index names but the
  directory lacks (or holds truncated);
* :func:`model_flag_problems` — the model-shape flags that differ from the checkpoint's
  (its saved arguments, ours or Megatron-LM's; :data:`~.checkpoint_rules.MODEL_SHAPE_FLAGS`);
* :func:`request_problems` — every tensor or object a load would ask for that the checkpoint
  lacks or holds in another global shape;
* :func:`raise_if_any` — every rank raises the same :class:`CheckpointError` if any rank
  found a problem (one collective), so a mismatch seen by some ranks stops all of them
  before training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from . import megatron_compat
from .checkpoint_rules import MODEL_SHAPE_FLAGS, CheckpointError

__all__ = [
    "CHECKPOINT_VERSION",
    "TRACKER",
    "checkpoint_dir",
    "find_checkpoint",
    "checkpoint_format",
    "missing_files",
    "interrupted_save",
    "complete_checkpoints",
    "COMMON_STATE_KEY",
    "model_flag_problems",
    "request_problems",
    "raise_if_any",
]

TRACKER = "latest_checkpointed_iteration.txt"
#: ``checkpoint_version`` of Megatron-LM's state dicts (3.0 since megatron-core models)
CHECKPOINT_VERSION = 3.0
LOGICAL_FORMAT = "megatron-bitpipe-logical"

def checkpoint_dir(root: str, iteration: Optional[int], release: bool = False) -> str:
    """Megatron-LM's directory of ``iteration`` under ``root`` (``release`` for a release checkpoint)."""
    return os.path.join(root, "release" if release else f"iter_{iteration:07d}")


def find_checkpoint(root: str, step: Optional[int] = None) -> Optional[Tuple[str, Optional[int], bool]]:
    """``(directory, iteration, release)`` of the checkpoint ``--load root`` names.

    ``step`` (``--ckpt-step``) picks an iteration; otherwise the tracker file does (an
    iteration, or ``release``). None when there is no tracker file and no ``step`` (nothing
    to resume: Megatron's convention is to start from scratch). CheckpointError when the
    tracker is unreadable or names a directory that does not exist.
    """
    tracker = os.path.join(root, TRACKER)
    release = False
    if step is None:
        if not os.path.isfile(tracker):
            return None
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        release = text == "release"
        if not (release or text.isdigit()):
            raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, neither an iteration nor 'release'")
        step = None if release else int(text)
    directory = checkpoint_dir(root, step, release)
    if not os.path.isdir(directory):
        raise CheckpointError(f"--load {root}: the checkpoint of {'release' if release else f'iteration {step}'} ({directory}) does not exist")
    return directory, step, release


def incomplete_saves(root: str) -> List[str]:
    """``iter_*`` directories under ``root`` (meaningful when it has no tracker: saves that never finished)."""
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root) if name.startswith("iter_") and os.path.isdir(os.path.join(root, name)))


def checkpoint_format(directory: str) -> Optional[str]:
    """``"torch_dist"``, ``"torch"``, ``"torch_dcp"``, ``"logical"`` or None (unknown)."""
    metadata = os.path.join(directory, "metadata.json")
    if os.path.isfile(metadata):
        try:
            with open(metadata, encoding="utf-8") as f:
                content = json.load(f)
        except (OSError, ValueError):
            return None
        if isinstance(content, dict) and content.get("sharded_backend") == "torch_dist":
            return "torch_dist"
        if isinstance(content, dict) and content.get("format") == LOGICAL_FORMAT:
            return "logical"
        return None
    names = os.listdir(directory)
    if any(name.startswith("mp_rank_") for name in names):
        return "torch"
    if ".metadata" in names:
        return "torch_dcp"
    return None


def interrupted_save(directory: str) -> bool:
    """Whether ``directory`` holds a ``torch_dist`` save that never finished: shard files or
    ``common.pt`` written, but not ``metadata.json``, which megatron-core writes last."""
    names = os.listdir(directory)
    started = "common.pt" in names or any(name.endswith(".distcp") for name in names)
    return started and "metadata.json" not in names


def complete_checkpoints(root: str) -> List[int]:
    """The iterations of the ``iter_*`` directories under ``root`` whose save finished (``metadata.json`` written)."""
    done = []
    for name in incomplete_saves(root):
        if os.path.isfile(os.path.join(root, name, "metadata.json")) and name[len("iter_"):].isdigit():
            done.append(int(name[len("iter_"):]))
    return sorted(done)


def format_problem(directory: str, found: Optional[str]) -> Optional[str]:
    """Why a directory of format ``found`` cannot be loaded as ``torch_dist`` (None if it can)."""
    if found == "torch_dist":
        return None
    if interrupted_save(directory):
        complete = complete_checkpoints(os.path.dirname(directory))
        others = f"the complete ones here are iterations {', '.join(map(str, complete))}" if complete else "there is no complete one here"
        return (
            f"{directory} is an incomplete checkpoint: its save never finished (shards written, metadata.json "
            f"missing: the job ended during the save); {others} (--ckpt-step N, or --load without --ckpt-step for "
            f"the one {TRACKER} names)"
        )
    if found == "logical":
        return (
            f"{directory} is a checkpoint in megatron-bitpipe's earlier logical format; convert it with "
            f"python scripts/convert_checkpoint.py {os.path.dirname(directory)} NEW_DIR"
        )
    if found is None:
        return f"{directory} holds no checkpoint in a known format (no metadata.json, .metadata or mp_rank_* files)"
    return f"{directory} is a {found!r} checkpoint; only megatron-core's distributed checkpoints (--ckpt-format torch_dist) are read"


#: key of the non-tensor state inside a distributed checkpoint's index (megatron-core 0.19
#: stores it there instead of in ``common.pt``)
COMMON_STATE_KEY = "common_state"


def missing_files(directory: str) -> List[str]:
    """Files a ``torch_dist`` checkpoint needs that are absent or shorter than its index says.

    Reads ``torch.distributed.checkpoint``'s index (``.metadata``). The non-tensor state
    (arguments, iteration, schedule) is megatron's ``common.pt`` (megatron-core 0.16) or an
    object in the index itself (0.19: :data:`COMMON_STATE_KEY`).
    """
    from torch.distributed.checkpoint import FileSystemReader

    problems = []
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except (OSError, ValueError, RuntimeError) as error:
        return [f"its tensor index (.metadata) cannot be read: {error}"]
    in_index = any(key.startswith(f"{COMMON_STATE_KEY}/") for key in metadata.state_dict_metadata)
    if os.path.isfile(os.path.join(directory, "common.pt")):
        pass  # megatron-core 0.16's layout, read by every version
    elif not in_index:
        problems.append("common.pt is missing")
    elif not megatron_compat.reads_common_state_in_index():
        problems.append(
            "its plain values (arguments, iteration) are stored in its index, as megatron-core 0.19 saves them; "
            "this megatron-core reads them from common.pt only: load it with megatron-core 0.19"
        )
    storage = metadata.storage_data
    needed: Dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"shard file {name} is missing")
        elif os.path.getsize(path) < size:
            problems.append(f"shard file {name} is truncated ({os.path.getsize(path)} of {size} bytes)")
    return problems


def model_flag_problems(
    saved: Optional[argparse.Namespace], current: argparse.Namespace, flags: Dict[str, Callable] = MODEL_SHAPE_FLAGS
) -> List[str]:
    """``"--flag is X there, Y here"`` for every model-shape flag of ``flags`` (flag -> value
    of a namespace; :data:`~.checkpoint_rules.MODEL_SHAPE_FLAGS` by default) that differs.

    ``saved`` are the arguments stored in the checkpoint (None: it has none, nothing to
    compare; the tensor shapes are still checked). A flag ``saved`` cannot answer is skipped.
    """
    if saved is None:
        return []
    problems = []
    for flag, value in flags.items():
        try:
            theirs = value(saved)
        except AttributeError:
            continue
        mine = value(current)
        if theirs != mine:
            problems.append(f"{flag} is {theirs!r} there, {mine!r} here")
    return problems


def _requested(state: dict) -> Iterable:
    """Every ShardedTensor and ShardedObject of a sharded state dict, factories built."""
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory):
            yield from _requested({"built": value.build()})
        elif isinstance(value, (ShardedTensor, ShardedObject)):
            yield value


def request_problems(request: dict, saved: dict) -> List[str]:
    """What ``request`` (a sharded state dict) asks for that the checkpoint lacks.

    ``saved`` is the checkpoint's ``dist_checkpointing.load_sharded_metadata``: key ->
    ShardedTensor / ShardedObject (global shapes). Tensors must exist with the same global
    shape; objects (RNG states, extra states) must exist for this rank's place (their key and
    position among the saving run's).
    """
    problems = []
    for entry in _requested(request):
        key = entry.key
        if isinstance(entry, ShardedObject):
            if entry.unique_key not in saved:
                problems.append(f"{entry.unique_key} is missing")
            continue
        theirs = saved.get(key)
        if theirs is None:
            problems.append(f"{key} is missing")
        elif tuple(theirs.global_shape) != tuple(entry.global_shape):
            problems.append(f"{key} is {tuple(theirs.global_shape)} there, {tuple(entry.global_shape)} here")
    return problems


def raise_if_any(problems: List[str], directory: str, what: str) -> None:
    """Raise ``CheckpointError`` on every rank if any rank has ``problems`` (collective).

    The message names ``directory`` and lists each distinct problem once (first ones first,
    at most 12).
    """
    gathered: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    union = list(dict.fromkeys(p for rank_problems in gathered for p in rank_problems))
    if union:
        shown = union[:12] + ([f"... and {len(union) - 12} more"] if len(union) > 12 else [])
        raise CheckpointError(f"{directory} {what}: " + "; ".join(shown))


@contextlib.contextmanager
def without_deprecation_notes():
    """megatron-core's checkpoint strategies call torch APIs torch has deprecated (FutureWarning
    on every rank, nothing a user can act on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
