"""Layout-independent checkpoints: one logical model, loadable into any layout or schedule.

A checkpoint stores the *full* (single-process) model under megatron-core's global parameter
names (:mod:`megatron_bitpipe.runtime.layout`), each logical parameter once whatever the
number of weight replicas (BitPipe's two), data-parallel copies, tied copies or TP blocks,
with its optimizer state (Adam or LAMB moments, Schedule-Free's ``z``/``y``, 1-bit LAMB's
frozen and fresh variances and coefficients; parameter-group state such as Schedule-Free's
step count and averaging weights in ``common.pt``). Any other layout of the same model (another pipeline size or
schedule, TP size or mode, data-parallel size, a single process) loads it by taking its own
blocks. See ``docs/checkpoints.md`` for the directory format.

Collectives: :func:`save_checkpoint` gathers TP blocks over each TP group and the index over
the job; :func:`load_checkpoint` reads files only (checks come first, so a mismatch fails on
every rank before anything is loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from ..optimizers import megatron_parts
from ..runtime.build import PipelineModel
from ..runtime.layout import full_shape, to_global_name, tp_block
from megatron.core.utils import unwrap_model
from .distributed import log
from .errors import CheckpointError
from .sharding import gather_full

__all__ = ["FORMAT", "CheckpointError", "TrainingState", "checkpoint_dir", "save_checkpoint", "load_checkpoint"]

FORMAT, VERSION = "megatron-bitpipe-logical", 1
TRACKER = "latest_checkpointed_iteration.txt"
METADATA, COMMON = "metadata.json", "common.pt"


@dataclass
class TrainingState:
    """Progress counters: completed iterations and training samples consumed by them."""

    iteration: int = 0
    consumed_train_samples: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory name for ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def layout_of(args: argparse.Namespace) -> Dict[str, object]:
    """What makes two runs' ranks correspond one to one (RNG states are restored only then)."""
    return {
        "world_size": args.world_size,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "schedule": args.schedule,
        "tensor_parallel_mode": args.tensor_parallel_mode,
    }


def _local_parameters(model: PipelineModel) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of every registered parameter of this rank's chunks, in the
    same order on every rank of a TP group."""
    for chunk, spec in zip(model.chunks, model.specs, strict=True):
        for local_name, param in unwrap_model(chunk).named_parameters():
            yield to_global_name(local_name, spec), param


class _Blocks:
    """Full tensor <-> this rank's block for the parameters of ``model`` (its TP group)."""

    def __init__(self, model: PipelineModel):
        self.tp = model.groups.tp

    def full_shape(self, param) -> Tuple[int, ...]:
        return tuple(full_shape(param, self.tp.size()))

    def block(self, full: torch.Tensor, param) -> torch.Tensor:
        return tp_block(full, param, self.tp.rank(), self.tp.size())

    def gather(self, local: torch.Tensor, param) -> torch.Tensor:
        return gather_full(local, param, self.tp)


def _optimizer_slots(optimizer) -> Dict[int, Tuple[torch.optim.Optimizer, torch.Tensor]]:
    """``id(model parameter) -> (torch optimizer, main parameter)`` of a megatron optimizer.

    The main parameter is the fp32 copy of mixed-precision optimizers and the model
    parameter itself otherwise; its entry of ``optimizer.state`` holds the optimizer state.
    """
    slots = {}
    for part in megatron_parts(optimizer):
        inner = part.optimizer
        if hasattr(part, "float16_groups"):
            for models, mains in zip(part.float16_groups, part.fp32_from_float16_groups):
                slots.update({id(m): (inner, main) for m, main in zip(models, mains)})
            for group in part.fp32_from_fp32_groups:
                slots.update({id(p): (inner, p) for p in group})
        else:
            for group in inner.param_groups:
                slots.update({id(p): (inner, p) for p in group["params"]})
    return slots


def _group_of(inner: torch.optim.Optimizer, main: torch.Tensor) -> dict:
    return next(g for g in inner.param_groups if any(p is main for p in g["params"]))


def _per_parameter_step(inner: torch.optim.Optimizer) -> bool:
    """torch's Adam/AdamW and this package's optimizers count steps per parameter; apex/TE
    fused Adam per parameter group."""
    return type(inner).__module__.startswith(("torch.optim", "megatron_bitpipe"))


def _state_entry(inner, main, param, blocks: _Blocks) -> Dict[str, object]:
    """The optimizer state of one logical parameter: tensors shaped like the parameter
    (moments, Schedule-Free's ``z``/``y``, ...) as full tensors, scalars as numbers."""
    state = inner.state.get(main, {})
    entry: Dict[str, object] = {}
    for key, value in state.items():
        if key == "step":
            entry[key] = int(value)
        elif torch.is_tensor(value) and value.shape == main.shape and value.dim() > 0:
            entry[key] = blocks.gather(value, param)
        elif torch.is_tensor(value):
            entry[key] = value.item()
        else:
            entry[key] = value
    if "step" not in entry and "step" in _group_of(inner, main):
        entry["step"] = int(_group_of(inner, main)["step"])
    return entry


_WEIGHTS = ("param", "main_param")


def _set_optimizer_state(inner, main, entry: dict, block) -> None:
    state = inner.state[main]
    for key, value in entry.items():
        if key in _WEIGHTS or key == "step":
            continue
        if torch.is_tensor(value):
            state[key] = block(value).to(device=main.device, dtype=main.dtype).clone()
        else:
            state[key] = value
    if "step" not in entry:
        return
    group = _group_of(inner, main)
    if _per_parameter_step(inner):
        on_device = group.get("capturable", False) or group.get("fused", False)
        state["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32, device=main.device if on_device else "cpu")
    else:
        group["step"] = entry["step"]


def _group_states(optimizer) -> List[List[dict]]:
    """Per megatron part, per parameter group: the group entries that are optimizer state
    (the torch optimizer's ``group_state``, e.g. Schedule-Free's step count and averaging
    weights); the same groups exist in every layout."""
    return [
        [{key: group[key] for key in getattr(part.optimizer, "group_state", ())} for group in part.optimizer.param_groups]
        for part in megatron_parts(optimizer)
    ]


def _set_group_states(optimizer, saved: List[List[dict]]) -> None:
    for part, groups in zip(megatron_parts(optimizer), saved, strict=True):
        for group, values in zip(part.optimizer.param_groups, groups, strict=True):
            group.update(values)


def _layout_states(optimizer) -> Dict[int, object]:
    """Per megatron part: this rank's layout-dependent optimizer state (1-bit LAMB's error
    feedback)."""
    return {
        index: part.optimizer.error_feedback_state()
        for index, part in enumerate(megatron_parts(optimizer))
        if hasattr(part.optimizer, "error_feedback_state")
    }


def _set_layout_states(optimizer, saved: Optional[Dict[int, object]]) -> List[int]:
    """Restore :func:`_layout_states` (None: reset them); the parts whose state was reset."""
    reset = []
    for index, part in enumerate(megatron_parts(optimizer)):
        if hasattr(part.optimizer, "load_error_feedback_state"):
            if not part.optimizer.load_error_feedback_state(None if saved is None else saved.get(index)):
                reset.append(index)
    return reset


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _grad_scalers(optimizer):
    return [getattr(part, "grad_scaler", None) for part in megatron_parts(optimizer)]


def _rank_file(kind: str, rank: int) -> str:
    return f"{kind}_rank{rank:05d}.pt"


def save_checkpoint(root: str, state: TrainingState, model: PipelineModel, optimizer, scheduler, args, task) -> str:
    """Write the checkpoint of ``state.iteration`` under ``root``; returns its directory.

    Collective over the job. Each logical parameter is written by one rank: data-parallel
    rank 0, TP rank 0 after gathering the blocks, and only the first replica's copy (copies
    are marked ``shared``: BitPipe's second replica, megatron's tied output layer).
    ``latest_checkpointed_iteration.txt`` is updated last, so an interrupted save never
    becomes the checkpoint ``--load`` picks.
    """
    directory = checkpoint_dir(root, state.iteration)
    rank, groups = dist.get_rank(), model.groups
    os.makedirs(directory, exist_ok=True)
    slots, blocks = _optimizer_slots(optimizer), _Blocks(model)
    entries = {}
    with torch.no_grad():
        for name, param in _local_parameters(model):
            if groups.dp_rank != 0 or getattr(param, "shared", False):
                continue
            inner, main = slots[id(param)]
            entry = {"param": blocks.gather(param.detach(), param)}
            if main is not param:
                entry["main_param"] = blocks.gather(main.detach(), param)
            entry.update(_state_entry(inner, main, param, blocks))
            if groups.tp_rank == 0:
                entries[name] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in entry.items()}
    index = {}
    if entries:
        filename = _rank_file("model", rank)
        torch.save(entries, os.path.join(directory, filename))
        index = {n: {"file": filename, "shape": list(e["param"].shape), "dtype": str(e["param"].dtype)} for n, e in entries.items()}
    torch.save(_rng_state(), os.path.join(directory, _rank_file("rng", rank)))
    layout_states = _layout_states(optimizer)
    if layout_states:
        torch.save(layout_states, os.path.join(directory, _rank_file("optimizer", rank)))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, index)
    if rank == 0:
        merged = {}
        for part in parts:
            duplicated = merged.keys() & part.keys()
            if duplicated:
                raise RuntimeError(f"parameters written twice: {sorted(duplicated)}")
            merged.update(part)
        scalers = [s.state_dict() if s is not None else None for s in _grad_scalers(optimizer)]
        common = {"scheduler": scheduler.state_dict(), "grad_scalers": scalers, "optimizer_groups": _group_states(optimizer)}
        torch.save(common, os.path.join(directory, COMMON))
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "task": task.name,
            "optimizer": args.optimizer,
            "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "model": task.model_signature(args),
            "layout": layout_of(args),
            "parameters": dict(sorted(merged.items())),
        }
        with open(os.path.join(directory, METADATA), "w", encoding="utf-8") as f:
            json.dump(metadata, f, indent=1)
    dist.barrier()
    if rank == 0:
        tracker = os.path.join(root, TRACKER)
        with open(tracker + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{state.iteration}\n")
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    return directory


def _read_metadata(root: str, iteration: Optional[int]) -> Optional[Tuple[str, dict]]:
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.isfile(tracker):
            return None
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if not text.isdigit():
            raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration")
        iteration = int(text)
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"--load {root}: no checkpoint of iteration {iteration} ({directory} does not exist)")
    try:
        with open(os.path.join(directory, METADATA), encoding="utf-8") as f:
            metadata = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"--load {root}: {directory} has no {METADATA} (not a megatron-bitpipe checkpoint)") from None
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise CheckpointError(f"--load {root}: {directory} is not a {FORMAT} v{VERSION} checkpoint")
    return directory, metadata


def _check_model(directory: str, metadata: dict, model: PipelineModel, args, task) -> None:
    """CheckpointError naming every flag, then every parameter, that differs."""
    if metadata["task"] != task.name:
        raise CheckpointError(f"{directory} holds a {metadata['task']} model, this run trains {task.name}")
    if metadata.get("optimizer", "adam") != args.optimizer:
        raise CheckpointError(
            f"{directory} holds the state of --optimizer {metadata.get('optimizer', 'adam')}, this run uses --optimizer {args.optimizer}"
        )
    current = json.loads(json.dumps(task.model_signature(args)))
    saved = metadata["model"]
    flags = [f"{flag} is {saved.get(flag)!r} there, {value!r} here" for flag, value in current.items() if saved.get(flag) != value]
    if flags:
        raise CheckpointError(f"{directory} holds a different model: " + "; ".join(flags))
    index, blocks = metadata["parameters"], _Blocks(model)
    problems = []
    for name, param in _local_parameters(model):
        if name not in index:
            problems.append(f"parameter {name} is missing")
        elif tuple(index[name]["shape"]) != blocks.full_shape(param):
            problems.append(f"parameter {name} is {tuple(index[name]['shape'])} there, {blocks.full_shape(param)} here")
    if problems:
        raise CheckpointError(f"{directory} holds a different model: " + "; ".join(problems))


def load_checkpoint(
    root: str, model: PipelineModel, optimizer, scheduler, args, task, iteration: Optional[int] = None
) -> Optional[TrainingState]:
    """Load checkpoint ``iteration`` (default: the latest) under ``root`` into this run; None
    if there is no checkpoint at all (CheckpointError if the requested one is missing).

    Weights (fp32 main weights when the checkpoint has them), optimizer state and step
    counts, the learning-rate schedule and fp16 loss scale are loaded whatever the layout; the
    RNG states and 1-bit LAMB's error feedback only when the layout is the one that saved
    (otherwise the ranks do not correspond; a log line says so; the error feedback restarts
    from zero). Reads files only, no communication. A Schedule-Free run must load inside
    :func:`megatron_bitpipe.optimizers.averaged_weights` (checkpoints hold its averaged
    weights and, as state ``y``, the training weights).
    """
    found = _read_metadata(root, iteration)
    if found is None:
        log(f"no checkpoint in --load {root} ({TRACKER} missing): starting from iteration 0")
        return None
    directory, metadata = found
    _check_model(directory, metadata, model, args, task)
    index, shards = metadata["parameters"], {}
    slots, blocks = _optimizer_slots(optimizer), _Blocks(model)
    with torch.no_grad():
        for name, param in _local_parameters(model):
            filename = index[name]["file"]
            if filename not in shards:
                shards[filename] = torch.load(os.path.join(directory, filename), mmap=True, weights_only=True)
            entry = shards[filename][name]
            inner, main = slots[id(param)]
            value = blocks.block(entry.get("main_param", entry["param"]), param)
            param.copy_(value)
            if main is not param:
                main.copy_(value)
            _set_optimizer_state(inner, main, entry, lambda full, p=param: blocks.block(full, p))
    common = torch.load(os.path.join(directory, COMMON), weights_only=False)
    try:
        scheduler.load_state_dict(common["scheduler"])
    except AssertionError as error:
        raise CheckpointError(
            f"{directory}: the learning-rate flags (--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, "
            f"--lr-decay-style, --weight-decay) must match the checkpoint's: {error}"
        ) from None
    for scaler, saved in zip(_grad_scalers(optimizer), common["grad_scalers"]):
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)
    _set_group_states(optimizer, common["optimizer_groups"])
    same_layout = metadata["layout"] == json.loads(json.dumps(layout_of(args)))
    layout_file = os.path.join(directory, _rank_file("optimizer", dist.get_rank()))
    layout_states = torch.load(layout_file, weights_only=False) if same_layout and os.path.isfile(layout_file) else None
    if _set_layout_states(optimizer, layout_states):
        log(f"loading {directory}: 1-bit LAMB's error feedback restarts from zero (saved in another layout or not at all)")
    if same_layout:
        _set_rng_state(torch.load(os.path.join(directory, _rank_file("rng", dist.get_rank())), weights_only=False))
    else:
        log(f"loading {directory} into another layout ({metadata['layout']}): RNG states are not restored")
    log(f"loaded {directory}: iteration {metadata['iteration']}, {metadata['consumed_train_samples']} samples consumed")
    return TrainingState(metadata["iteration"], metadata["consumed_train_samples"])
