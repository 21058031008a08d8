"""Checkpoints of the pretrain scripts: megatron-core distributed checkpoints (``torch_dist``).

A checkpoint is what Megatron-LM's ``pretrain_gpt.py`` writes with ``--ckpt-format torch_dist``
(its default): ``dist_checkpointing.save`` of a state dict with Megatron-LM's top-level
keys (``args``, ``checkpoint_version``, ``iteration``, ``model`` / ``model0``..., ``optimizer``,
``opt_param_scheduler``, ``rng_state``) in Megatron-LM's directory layout
(``iter_0000010/``, ``latest_checkpointed_iteration.txt``). Every tensor is saved under the
name of the single-process model, once (:mod:`megatron_bitpipe.model.sharded_state`: weight
replicas and tied copies are replicas), so any layout loads it — another schedule (BitPipe,
split backward, 1F1B, interleaved, none), pipeline, tensor (1-D or Optimus 2D) or
data-parallel size, with or without the distributed optimizer (:mod:`.optimizer_state`) —
and Megatron-LM's own scripts load it too, and write checkpoints these scripts load.

:func:`load_checkpoint` never loads partially: every check
(:mod:`megatron_bitpipe.checkpoint_checks`: format, files, model flags, every requested tensor's presence and
shape, the learning-rate schedule) runs and is agreed on by all ranks before anything is
copied, and a failure raises the same :class:`CheckpointError` on every rank. See
``docs/checkpoints.md``.
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model

from .. import megatron_compat
from ..run_config import RunConfig
from ..model.build import PipelineModel
from ..execution.distributed_optimizer import SHARDING_TYPE
from ..execution.forward_backward import finish_param_gathers
from . import optimizer_state
from ..checkpoint_checks import (
    CHECKPOINT_VERSION,
    TRACKER,
    checkpoint_dir,
    checkpoint_format,
    find_checkpoint,
    format_problem,
    incomplete_saves,
    missing_files,
    model_flag_problems,
    raise_if_any,
    request_problems,
    without_deprecation_notes,
)
from .distributed import log
from .load_plan import LoadFlags, LoadPlan, SavedCheckpoint, plan_load
from ..checkpoint_rules import CheckpointError

__all__ = [
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "TrainingState",
    "checkpoint_dir",
    "save_checkpoint",
    "load_checkpoint",
    "rank_layout",
    "without_deprecation_notes",
]


def rank_layout(run: RunConfig) -> Dict[str, object]:
    """What fixes which rank holds which part of which replica: per-rank state saved beside a
    checkpoint (ABS-SGD's gradients in flight, the decentralized modes' replicas) resumes only
    in the same layout."""
    layout = run.layout
    return {
        "world_size": layout.world,
        "tensor_model_parallel_size": layout.tensor,
        "pipeline_model_parallel_size": layout.pipeline,
        "data_parallel_size": layout.data,
        "schedule": run.schedule_name,
        "tensor_parallel_mode": layout.tensor_parallel_mode,
    }

@dataclass
class TrainingState:
    """Progress counters: completed iterations and training samples consumed by them."""

    iteration: int = 0
    consumed_train_samples: int = 0


def content_metadata(optimizer) -> Dict[str, object]:
    """How the state dict is laid out (stored in the checkpoint; Megatron-LM's keys and values):
    the distributed optimizer's form where ``optimizer`` is megatron's distributed one."""
    metadata: Dict[str, object] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer_state.is_distributed(optimizer):
        metadata["distrib_optim_sharding_type"] = SHARDING_TYPE
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def _megatron_lm_args(args: argparse.Namespace, run: RunConfig) -> argparse.Namespace:
    """A copy of the run's flags with the decision Megatron-LM keeps in its namespace and
    checkpoints compare (``padded_vocab_size``), as Megatron-LM's namespace holds them."""
    full = argparse.Namespace(**vars(args))
    full.padded_vocab_size = run.padded_vocab_size
    return full


def _saved_args(args: argparse.Namespace, run: RunConfig, state: TrainingState, task) -> argparse.Namespace:
    """The run's arguments as Megatron-LM stores them (it reads progress counters and checks
    model flags from them)."""
    saved = _megatron_lm_args(args, run)
    saved.consumed_train_samples = state.consumed_train_samples
    saved.skipped_train_samples = 0
    saved.consumed_valid_samples = 0
    saved.add_position_embedding = True
    saved.task = task.name
    return saved


def _model_state(model: PipelineModel, metadata: dict) -> Dict[str, dict]:
    """``model`` (one chunk) or ``model0``, ``model1``... : each chunk's sharded state dict."""
    chunks = [unwrap_model(chunk) for chunk in model.chunks]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    return {key: chunk.sharded_state_dict(metadata=metadata) for key, chunk in zip(keys, chunks)}


def _rng_state() -> dict:
    """This rank's generators, under Megatron-LM's names."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    return state


def _rng_object(model: PipelineModel) -> ShardedObject:
    """Megatron-LM's ``rng_state``: one entry per (pipeline rank, tensor rank); the data- and
    context-parallel ranks of one are replicas (the rank in data x context parallel, as Megatron-LM's)."""
    groups = model.groups
    return ShardedObject(
        "rng_state",
        [_rng_state()],
        (groups.grid.pp, groups.grid.tp),
        (groups.pp_rank, groups.tp_rank),
        replica_id=groups.rank_pgs.dp_cp.rank(),
    )


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def save_checkpoint(
    root: str, state: TrainingState, model: PipelineModel, optimizer, scheduler, args, run: RunConfig, task,
    shards_written: Optional[Callable[[], None]] = None,
) -> str:
    """Write the checkpoint of ``state.iteration`` under ``root``; returns its directory.

    Collective over the job. Without ``--no-save-optim`` the optimizer state (in its sharded
    form) and the learning-rate schedule are included, without ``--no-save-rng`` every
    rank's random generators. The order makes a save atomic for ``--load``: every rank writes
    its shards (and rank 0 ``common.pt``); then the tensor index (``.metadata``) and
    ``metadata.json`` are written once every rank has; then, after a barrier, rank 0 replaces
    ``latest_checkpointed_iteration.txt`` (write and rename). A save interrupted anywhere
    before that leaves the tracker on the previous checkpoint, and its own directory without
    ``metadata.json``, which :func:`load_checkpoint` refuses as incomplete. ``shards_written``
    is called on each rank between its shards and the index (the fault injection's point).
    """
    directory = checkpoint_dir(root, state.iteration)
    finish_param_gathers(model.chunks)  # --overlap-param-gather: the weights after the step
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    metadata = content_metadata(optimizer)
    sharded = {**metadata, "dp_cp_group": model.groups.rank_pgs.dp_cp}
    state_dict = {
        "args": _saved_args(args, run, state, task),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        "num_floating_point_operations_so_far": 0,
        **_model_state(model, sharded),
    }
    if run.checkpointing.save_optim:
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=sharded)
        state_dict["opt_param_scheduler"] = scheduler.state_dict()
    if run.checkpointing.save_rng:
        state_dict["rng_state"] = _rng_object(model)
    with without_deprecation_notes():
        # megatron-core's synchronous save, as its request: write the shards, then finalise
        request = megatron_compat.sharded_save_request(state_dict, directory, content_metadata=metadata)
        if shards_written is not None:
            request.finalize_fns.insert(0, shards_written)
        request.execute_sync()
    dist.barrier()  # every rank's shards, the index and metadata.json are written
    if dist.get_rank() == 0:
        tracker = os.path.join(root, TRACKER)
        with open(tracker + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{state.iteration}\n")
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    return directory


# -- loading --------------------------------------------------------------------------------


def _schedule_problems(saved: dict, scheduler, run: RunConfig, saved_args) -> List[str]:
    """Differences between the checkpoint's learning-rate / weight-decay schedule and this
    run's flags, in the flags' terms (lengths in samples and iterations)."""
    if run.checkpointing.schedule_unchecked:
        return []
    batch = run.batches.global_batch_size
    their_batch = getattr(saved_args, "global_batch_size", batch) or batch

    def samples(count, per_iteration):
        return f"{count} samples ({count / per_iteration:g} iterations of {per_iteration})"

    problems = []
    for flag, mine, theirs, unit in (
        ("--lr", scheduler.max_lr, saved["max_lr"], None),
        ("--min-lr", scheduler.min_lr, saved["min_lr"], None),
        ("--lr-decay-style", scheduler.lr_decay_style, saved["lr_decay_style"], None),
        ("--lr-warmup-iters", scheduler.lr_warmup_steps, saved["lr_warmup_steps"], "warms up the learning rate over"),
        ("--lr-decay-iters (default --train-iters)", scheduler.lr_decay_steps, saved["lr_decay_steps"], "decays the learning rate over"),
        ("--weight-decay", (scheduler.start_wd, scheduler.end_wd), (saved["start_wd"], saved["end_wd"]), None),
    ):
        if mine == theirs:
            continue
        if unit is None:
            problems.append(f"{flag} is {theirs!r} there, {mine!r} here")
        else:
            problems.append(f"{flag}: the checkpoint {unit} {samples(theirs, their_batch)}, this run over {samples(mine, batch)}")
    if _weight_decay_varies(scheduler) and scheduler.wd_incr_steps != saved["wd_incr_steps"]:
        problems.append(
            f"--train-iters: the checkpoint changes the weight decay over {samples(saved['wd_incr_steps'], their_batch)}, "
            f"this run over {samples(scheduler.wd_incr_steps, batch)}"
        )
    return problems


def _weight_decay_varies(scheduler) -> bool:
    return scheduler.wd_incr_style != "constant" and scheduler.start_wd != scheduler.end_wd


def _load_schedule(scheduler, saved: dict) -> None:
    """megatron's ``load_state_dict``; a constant weight decay does not depend on its length
    (``--train-iters``), so a longer run resumes without schedule flags."""
    saved = dict(saved)
    if not (_weight_decay_varies(scheduler) or scheduler.use_checkpoint_opt_param_scheduler):
        saved["wd_incr_steps"] = scheduler.wd_incr_steps
    scheduler.load_state_dict(saved)


def _no_checkpoint(root: str, run: RunConfig) -> None:
    incomplete = incomplete_saves(root)
    why = f"no checkpoint in --load {root} ({TRACKER} missing"
    why += f"; {', '.join(incomplete)} never completed)" if incomplete else ")"
    if run.checkpointing.exit_on_missing:
        raise CheckpointError(f"{why}, and --exit-on-missing-checkpoint is set")
    log(f"WARNING: {why}: starting from iteration 0")


def load_checkpoint(root: str, model: PipelineModel, optimizer, scheduler, args, run: RunConfig, task) -> Optional[TrainingState]:
    """Load the checkpoint ``--load root`` names (``--ckpt-step``: that iteration) into this
    run; None, after one warning, if ``root`` holds none.

    Collective over the job. Loads the weights; unless ``--finetune`` (or a release
    checkpoint) also the progress counters, and unless ``--no-load-optim`` / ``--finetune``
    the optimizer state and the learning-rate schedule (``--override-opt_param-scheduler``,
    ``--use-checkpoint-opt_param-scheduler``); the random generators unless
    ``--no-load-rng`` / ``--finetune`` and only where pipeline and tensor sizes are the
    saving run's (ranks correspond), as Megatron-LM does. CheckpointError, on every rank and
    before anything is loaded, for a checkpoint that exists but does not fit.
    """
    found = find_checkpoint(root, run.checkpointing.step)
    if found is None:
        _no_checkpoint(root, run)
        return None
    directory, _, release = found
    problem = format_problem(directory, checkpoint_format(directory))
    raise_if_any([problem] if problem else missing_files(directory), directory, "cannot be read")
    common = dist_checkpointing.load_common_state_dict(directory)
    saved_args = common.get("args")
    checkpoint = SavedCheckpoint.from_common(common, release, task.name)
    same_task = checkpoint.task == task.name
    model_problems = model_flag_problems(saved_args, _megatron_lm_args(args, run), task.model_flags()) if same_task else []
    plan = plan_load(checkpoint, LoadFlags.from_run(run, args), task.name, model_problems,
                     lambda: _schedule_problems(common["opt_param_scheduler"], scheduler, run, saved_args))
    for refusal in plan.refusals:  # the same refusals on every rank: each check is one collective everywhere
        raise_if_any(list(refusal.problems), directory, refusal.heading)

    saved_metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    groups_metadata = {"dp_cp_group": model.groups.rank_pgs.dp_cp}
    saved = load_sharded_metadata(directory)
    request = _model_state(model, {**saved_metadata, **groups_metadata})
    optimizer_load = None
    if plan.optimizer:
        optimizer_load = optimizer_state.OptimizerLoad(
            optimizer, dict(request), common, saved_metadata, {**content_metadata(optimizer), **groups_metadata}, saved
        )
        request.update(optimizer_load.request)
    if plan.rng:
        request["rng_state"] = _rng_object(model)
    raise_if_any(request_problems(request, saved), directory, "does not fit this model")

    with without_deprecation_notes():
        loaded = dist_checkpointing.load(request, directory)
    for key, chunk in zip(_model_state_keys(model), model.chunks):
        unwrap_model(chunk).load_state_dict(loaded[key], strict=True)
    if optimizer_load is not None:
        optimizer_load.apply(loaded)
        _load_schedule(scheduler, common["opt_param_scheduler"])
        optimizer_state.use_run_hyperparameters(optimizer, scheduler)
    elif run.precision.name != "fp32":
        optimizer.reload_model_params()  # fp32 main weights from the loaded weights
    if plan.rng:
        _set_rng_state(loaded["rng_state"][0])
    _report(directory, common, saved_args, plan, run)
    if plan.finetune:
        return TrainingState()
    return TrainingState(int(common["iteration"]), int(getattr(saved_args, "consumed_train_samples", 0)))


def _model_state_keys(model: PipelineModel) -> List[str]:
    count = len(model.chunks)
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def _report(directory, common, saved_args, plan: LoadPlan, run: RunConfig) -> None:
    finetune, load_optimizer, load_rng = plan.finetune, plan.optimizer, plan.rng
    parts = ["weights"]
    if not finetune:
        parts.append(f"iteration {common['iteration']}, {getattr(saved_args, 'consumed_train_samples', 0)} samples consumed")
    if load_optimizer:
        parts.append("optimizer state and learning-rate schedule")
    if load_rng:
        parts.append("random generators")
    log(f"loaded {directory}: " + "; ".join(parts))
    skipped = []
    if finetune:
        skipped.append("--finetune: iteration 0, fresh optimizer, schedule and generators")
    elif not load_optimizer:
        skipped.append("--no-load-optim: fresh optimizer state and learning-rate schedule")
    if not load_rng and not finetune:
        skipped.append("random generators not restored" + (" (--no-load-rng)" if run.checkpointing.no_load_rng else " (other pipeline or tensor size, or not saved)"))
    if skipped:
        log("  " + "; ".join(skipped))
