"""Model ``k`` of a fused-array checkpoint as an ordinary GPT or BERT checkpoint (``scripts/hfta_extract.py``).

A fused ``torch_dist`` checkpoint stores every weight with the model dimension: ``[B, ...]``,
or ``[layers, B, ...]`` for the decoder (BERT: encoder) layers' weights (megatron stacks a block's layers along a
leading axis). :func:`extract_model` takes slice ``k`` of each and writes a checkpoint of the
unfused model: the same tensor names (and the linears' empty ``_extra_state`` entries), and the saving run's arguments with ``--lr`` model
``k``'s rate and no HFTA flags, iteration and sample counters kept. It holds the weights only (no
optimizer state, learning-rate schedule or random state): ``pretrain_gpt.py --load DIR`` (``pretrain_bert.py``) needs
``--no-load-optim`` (continue training model ``k`` with a fresh optimizer) or ``--finetune``.

Collective over the default process group (one rank is enough: every tensor is read whole; with
several, each reads them all and rank 0 writes). Checkpoints of any tensor-parallel size: the
tensors are read whole.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from ..checkpoint_checks import CHECKPOINT_VERSION, TRACKER, checkpoint_dir, find_checkpoint, without_deprecation_notes

__all__ = ["extract_model", "model_axis"]

_LAYERS = ("decoder.layers.", "encoder.layers.")  # GPT's, BERT's


def model_axis(key: str) -> int:
    """The model dimension of checkpoint tensor ``key``: 1 behind the layer axis of the decoder
    (encoder) layers' weights, else 0."""
    return 1 if key.startswith(_LAYERS) else 0


def extract_model(load: str, k: int, save: str, step: Optional[int] = None) -> str:
    """Write model ``k`` of the fused checkpoint under ``load`` (iteration ``step``, default
    the latest) as an ordinary checkpoint under ``save``; returns its directory. ValueError for
    a checkpoint without a fused array or a ``k`` out of range. megatron-core's calls of
    deprecated torch checkpoint APIs warn nothing, as in training."""
    with without_deprecation_notes():
        return _extract_model(load, k, save, step)


def _extract_model(load: str, k: int, save: str, step: Optional[int]) -> str:
    found = find_checkpoint(load, step)
    if found is None:
        raise ValueError(f"no checkpoint under {load}" + ("" if step is None else f" at iteration {step}"))
    source = found[0]
    common = dist_checkpointing.load_common_state_dict(source)
    saved = common["args"]
    b = getattr(saved, "hfta_models", None)
    if b is None:
        raise ValueError(f"{source} is not a checkpoint of a fused array (its run had no --hfta-models)")
    if not 0 <= k < b:
        raise ValueError(f"--model {k}: the array has models 0..{b - 1}")
    lrs = saved.hfta_lr or (saved.lr,) * b
    args = argparse.Namespace(**vars(saved))
    args.hfta_models, args.hfta_lr, args.hfta_seeds = None, None, None
    args.lr = lrs[k]  # --seed stays: it orders the data (model k's initial weights were seed hfta_seeds[k]'s)
    args.no_save_optim, args.no_save_rng = True, True
    tensors = dist_checkpointing.load_plain_tensors(source)
    replica = dist.get_rank()  # every rank holds every tensor whole: rank 0's copies are written
    model = {}
    for key, tensor in tensors.items():
        if not torch.is_tensor(tensor) or key.startswith(("optimizer.", "rng_state")) or key.endswith("_extra_state"):
            continue
        piece = tensor.select(model_axis(key), k).contiguous()
        if key.startswith(_LAYERS):  # one shard per layer, as megatron's block writes them
            for layer in range(piece.shape[0]):
                model[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                    key, piece[layer].clone(), (0, layer, piece.shape[0]), replica_id=replica, prepend_axis_num=1
                )
        else:
            model[key] = ShardedTensor.from_rank_offsets(key, piece, replica_id=replica)
    for key, entry in load_sharded_metadata(source).items():  # the linears' (empty) extra states
        if isinstance(entry, ShardedObject) and entry.key.endswith("_extra_state"):
            model[key] = ShardedObject(entry.key, None, entry.global_shape, entry.global_offset, replica_id=replica)
    iteration = int(common["iteration"])
    directory = checkpoint_dir(save, iteration)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "num_floating_point_operations_so_far": 0, "model": model}
    dist_checkpointing.save(state, directory, content_metadata=dist_checkpointing.load_content_metadata(preloaded_state_dict=common))
    if dist.get_rank() == 0:
        with open(os.path.join(save, TRACKER), "w", encoding="utf-8") as tracker:
            tracker.write(f"{iteration}\n")
    dist.barrier()
    return directory
