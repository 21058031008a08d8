"""Checks in front of Megatron-LM's ``load_checkpoint`` (tag core_v0.16.1): never a silent or
partial load.

Megatron-LM's loader exits with status 0 when a rank's legacy checkpoint file is missing,
raises ``KeyError`` when the number of model chunks per rank differs from the saving run's,
and, with ``--no-load-optim`` and more chunks per rank than the checkpoint has, reports a
successful load while loading no weights. :func:`check_checkpoint` runs first, on every rank,
and stops the job (status 1 on every rank, one message from rank 0) when ``--load`` names a
checkpoint this run cannot load completely:

* tracker file unreadable, or naming a missing directory; ``--exit-on-missing-checkpoint``
  with no checkpoint at all (Megatron-LM would exit with status 0);
* an unknown format, or megatron-bitpipe's earlier logical format (convert it);
* ``torch_dist``: missing or truncated shard files; model flags that differ from the saving
  run's (its stored arguments); any tensor this run's model chunks ask for that is missing or
  has another global shape; optimizer state of the other kind (with or without
  ``--use-distributed-optimizer``: Megatron-LM reads only its own), of a mixture-of-experts
  model at expert parallelism 1 into one at > 1 or the other way round (megatron-core's
  experts have an optimizer of their own only at > 1), or in a form tied to the
  saving layout (``dp_reshardable``) when the layout differs; random generator states that
  Megatron-LM's loader would ask for under a key the checkpoint lacks (core_v0.16.1 shards
  them per data-parallel rank with expert parallelism > 1 only: a resume at another
  expert-parallel size in the same tensor and pipeline sizes needs ``--no-load-rng``);
* legacy ``torch`` files: with a schedule this package's plan executor runs (``bitpipe``) at
  all; otherwise this rank's file missing, or holding another number of model chunks.

Without a checkpoint in ``--load`` Megatron-LM starts from scratch with its warning, as before.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import torch
import torch.distributed as dist

from ..checkpoint_checks import (
    checkpoint_format,
    find_checkpoint,
    format_problem,
    missing_files,
    model_flag_problems,
    raise_if_any,
    request_problems,
)
from ..checkpoint_rules import CheckpointError
from ..run_config import RunConfig

__all__ = ["check_checkpoint", "check_or_exit"]


def _model_keys(count: int) -> List[str]:
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def _legacy_problems(config: RunConfig, model: list, directory: str, iteration, release: bool) -> List[str]:
    """Why this rank cannot load Megatron-LM's legacy per-rank files (empty if it can)."""
    from megatron.training.checkpointing import get_checkpoint_name

    if config.executes_plan:
        return [
            "it is a legacy --ckpt-format torch checkpoint (per-rank files of one layout), which --pipeline-schedule "
            f"{config.schedule.schedule} does not read; resume it with the layout that saved it and save with --ckpt-format torch_dist"
        ]
    filename = get_checkpoint_name(os.path.dirname(directory), iteration, release)
    if not os.path.isfile(filename):
        return [
            f"this rank's file {os.path.relpath(filename, directory)} is missing (saved with another tensor or pipeline "
            "size? legacy torch checkpoints load only into their own layout; torch_dist ones load into any)"
        ]
    saved = torch.load(filename, map_location="cpu", weights_only=False, mmap=True)
    present = sorted(key for key in saved if key == "model" or (key.startswith("model") and key[5:].isdigit()))
    if present != sorted(_model_keys(len(model))):
        return [f"it holds {', '.join(present) or 'no model'} per rank, this run has {len(model)} model chunk(s) per rank"]
    return []


def _optimizer_problems(args: argparse.Namespace, saved_args, metadata: dict, release: bool) -> List[str]:
    """Whether Megatron-LM can read the checkpoint's optimizer state into this run's optimizer."""
    if release or args.finetune or args.no_load_optim or getattr(saved_args, "no_save_optim", False):
        return []
    sharding = metadata.get("distrib_optim_sharding_type")
    distributed = bool(args.use_distributed_optimizer)
    if (sharding is not None) != distributed:
        saved_with = "with" if sharding is not None else "without"
        return [
            f"its optimizer state was saved {saved_with} --use-distributed-optimizer, which Megatron-LM's loader reads only "
            f"into the same kind of optimizer (load the weights with --no-load-optim, or resume with megatron-bitpipe's "
            "scripts/pretrain_gpt.py, which reads either)"
        ]
    ours, theirs = args.expert_model_parallel_size, getattr(saved_args, "expert_model_parallel_size", 1)
    if getattr(args, "num_experts", None) and (ours > 1) != (theirs > 1):
        return [
            f"its optimizer state was saved at expert parallelism {theirs} and this run has {ours}: megatron-core keeps "
            "the experts in an optimizer of their own only with expert parallelism > 1 (at 1 they join the dense "
            "optimizer), and Megatron-LM's loader reads the state only into the same optimizers (resume at an expert "
            "parallelism on the same side of 1, or load the weights with --no-load-optim)"
        ]
    if sharding == "dp_reshardable":
        fields = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "pipeline_schedule")
        theirs = tuple(getattr(saved_args, f, None) for f in fields)
        mine = tuple(getattr(args, f, None) for f in fields)
        if theirs != mine:
            return [
                "its distributed-optimizer state is 'dp_reshardable', which only its saving layout reads "
                f"(tensor, pipeline, virtual pipeline size, schedule: {theirs} there, {mine} here); save with "
                "--dist-ckpt-optim-fully-reshardable, or load the weights with --no-load-optim"
            ]
    return []


def _rng_problems(args: argparse.Namespace, saved_args, saved: dict, release: bool) -> List[str]:
    """Whether the random generator states Megatron-LM's loader will ask for are in the
    torch_dist checkpoint (``saved``: its sharded metadata). It asks for them when the tensor and pipeline
    sizes are the saving run's (else it ignores them, saying so), under the key its
    ``get_rng_state`` gives this rank; at core_v0.16.1 that key holds the data-parallel rank
    only with expert parallelism > 1, so a resume at another expert-parallel size (1 and > 1)
    would not find them. Collective (``get_rng_state`` gathers over data parallelism with
    ``--data-parallel-random-init``)."""
    from megatron.core import mpu
    from megatron.training.checkpointing import get_rng_state

    same_sizes = all(
        getattr(saved_args, field, 1) == getattr(args, field) for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    )
    if release or args.finetune or args.no_load_rng or getattr(saved_args, "no_save_rng", False) or not same_sizes:
        return []
    wanted = get_rng_state("torch_dist", mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group())
    if wanted.unique_key in saved:
        return []
    theirs = next((key for key in saved if key.split("/")[0] == wanted.key), None)
    return [
        f"its random generator states are sharded as {theirs} and this layout asks for {wanted.unique_key} "
        f"(expert parallelism {getattr(saved_args, 'expert_model_parallel_size', 1)} there, {args.expert_model_parallel_size} "
        "here: Megatron-LM shards them per data-parallel rank with expert parallelism > 1 only); resume with --no-load-rng"
    ]


def check_checkpoint(args: argparse.Namespace, config: RunConfig, model: list, load_arg: str = "load") -> None:
    """CheckpointError (the same on every rank) if ``--load`` names a checkpoint this run
    (Megatron-LM's arguments ``args``, the decisions ``config`` made of them) cannot load
    completely; see the module docstring. Collective when a checkpoint is found."""
    from megatron.core import dist_checkpointing, mpu
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from megatron.core.utils import unwrap_model

    root = getattr(args, load_arg, None)
    if root is None:
        return
    found = find_checkpoint(root, getattr(args, "ckpt_step", None))
    if found is None:
        if getattr(args, "exit_on_missing_checkpoint", False) and not getattr(args, "pretrained_checkpoint", None):
            raise CheckpointError(f"no checkpoint in --{load_arg.replace('_', '-')} {root}, and --exit-on-missing-checkpoint is set")
        return
    directory, iteration, release = found
    found_format = checkpoint_format(directory)
    if found_format == "torch":
        raise_if_any(_legacy_problems(config, model, directory, iteration, release), directory, "cannot be loaded")
        return
    if found_format == "torch_dist" and args.ckpt_format != "torch_dist" and not getattr(args, "auto_detect_ckpt_format", False):
        raise_if_any([f"it is a torch_dist checkpoint and this run has --ckpt-format {args.ckpt_format} (pass "
                      "--ckpt-format torch_dist or --auto-detect-ckpt-format)"], directory, "cannot be loaded")
    problem = format_problem(directory, found_format)
    raise_if_any([problem] if problem else missing_files(directory), directory, "cannot be read")
    common = dist_checkpointing.load_common_state_dict(directory)
    saved_args = common.get("args")
    raise_if_any(model_flag_problems(saved_args, args), directory, "holds a different model")
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    request_metadata = {**metadata, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    chunks = unwrap_model(model)
    request = {key: chunk.sharded_state_dict(metadata=request_metadata) for key, chunk in zip(_model_keys(len(chunks)), chunks)}
    saved = load_sharded_metadata(directory)
    problems = request_problems(request, saved)
    problems += _optimizer_problems(args, saved_args, metadata, release)
    problems += _rng_problems(args, saved_args, saved, release)
    raise_if_any(problems, directory, "does not fit this model")


def check_or_exit(config: RunConfig, model: list, load_arg: str = "load") -> None:
    """:func:`check_checkpoint` for Megatron-LM's arguments; a failed check prints one error
    (rank 0) and exits with status 1 on every rank."""
    from megatron.training import get_args

    try:
        check_checkpoint(get_args(), config, model, load_arg)
    except CheckpointError as error:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"megatron_bitpipe: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
