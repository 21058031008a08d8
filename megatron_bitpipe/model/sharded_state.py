"""Distributed-checkpoint (``sharded_state_dict``) view of model chunks of any placement.

megatron-core's ``dist_checkpointing`` saves and loads ``ShardedTensor``\\ s: a key naming the
global (single-process) tensor, this rank's block of it, and a ``replica_id`` that is all
zeros on exactly one copy of each block in the job (the copy that is written). A chunk's own
``sharded_state_dict`` already uses global keys, whatever the placement: layer keys come from
the layers' global numbers (:func:`megatron_bitpipe.model.chunks.chunk_config`), tensor
parallel blocks carry their offsets, and data- and context-parallel copies their rank in data x
context parallel (megatron-core's ``dp_cp_group``). Three
things are the placement's and are added here, by :func:`attach_sharded_state_dicts`:

* **Weight replicas.** The chunks of every pipeline but the first (BitPipe's pipeline B,
  Chimera's second pipeline) hold copies of pipeline 0's stages: the first ``replica_id``
  coordinate of all their entries is the pipeline index, so only pipeline 0 writes, and
  loading fills both replicas with the same values.
* **Routed experts' replicas.** An MoE layer's routed experts are one tensor per weight,
  indexed by the global expert number (megatron's ``SequentialMLP``; this rank's experts are
  :attr:`megatron_bitpipe.model_partition.ChunkLayers.experts`). The copies of an expert are
  the data-parallel ranks of one expert-parallel rank: the last ``replica_id`` coordinate of
  its entries is this rank's place among them (its rank in ``rank_pgs.expt_dp``, one
  pipeline's copies; the pipeline index is the first coordinate, as for every entry), so
  each expert is written once — megatron's own coordinate is the rank in the chunk's expert
  grad-sync group, which spans both pipelines of BitPipe.
* **Tied output layer.** A head chunk whose ``output_layer.weight`` is the word embedding of
  another chunk (BitPipe's V: the embedding chunk on the same rank, see
  :mod:`megatron_bitpipe.model.chunks`) has no entry of its own: the embedding chunk's
  entry covers that one Parameter. A head chunk holding megatron's copy of the embedding
  (looped placements, last stage) maps it to ``embedding.word_embeddings.weight`` as a
  replica, as megatron-core does, with the chunk's own groups rather than megatron's
  global data-parallel state.

Hence a checkpoint holds each logical tensor once, under the names of the single-process
model, whatever the schedule, pipeline, tensor- or data-parallel layout that wrote it, and
any layout reads it back. The per-instance ``sharded_state_dict`` is what megatron-core's
optimizers and Megatron-LM's checkpointing call on the (unwrapped) chunks.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Sequence, Tuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedStateDict
from megatron.core.utils import unwrap_model

from ..execution.groups import PipelineGroups
from ..model_partition import ChunkSpec

__all__ = ["attach_sharded_state_dicts", "chunk_sharded_state_dict"]

_HEAD = "output_layer.weight"
_WORD_EMBEDDING = "embedding.word_embeddings.weight"
#: in the key of every routed expert's entry (megatron's ``SequentialMLP``: ``...mlp.experts.experts.<name>``)
_ROUTED_EXPERT = ".experts.experts."


def _replica_id(replica_id, pipeline: int) -> Tuple[int, ...]:
    """``replica_id`` with its first coordinate set to ``pipeline`` (a copy when > 0)."""
    coordinates = tuple(replica_id) if isinstance(replica_id, tuple) else (replica_id,)
    return (max(coordinates[0], pipeline),) + coordinates[1:]


@contextlib.contextmanager
def _head_as_own_weight(model: torch.nn.Module) -> Iterator[Optional[bool]]:
    """Let megatron build a tied head chunk's entries as if its output layer were untied.

    Yields None for chunks without a tied head of their own; else whether the head's weight is
    another chunk's Parameter (registered here only for the duration of the call).
    """
    layer = getattr(model, "output_layer", None)
    tied_head = model.share_embeddings_and_output_weights and model.post_process and not model.pre_process
    if layer is None or not tied_head:
        yield None
        return
    borrowed = _HEAD.split(".")[-1] not in layer._parameters
    model.share_embeddings_and_output_weights = False
    if borrowed:
        layer._parameters["weight"] = layer.__dict__["weight"]
    try:
        yield borrowed
    finally:
        model.share_embeddings_and_output_weights = True
        if borrowed:
            del layer._parameters["weight"]


def chunk_sharded_state_dict(
    model: torch.nn.Module,
    spec: ChunkSpec,
    groups: PipelineGroups,
    megatron_sharded_state_dict,
    prefix: str = "",
    sharded_offsets: tuple = (),
    metadata: Optional[dict] = None,
) -> ShardedStateDict:
    """``model``'s sharded state dict as a chunk of ``spec`` (see the module docstring).

    ``megatron_sharded_state_dict`` is the model class's own method, bound to ``model``.
    ``metadata['dp_cp_group']`` defaults to this rank's data x context parallel group (megatron's
    default reads its global parallel state): the context-parallel ranks of a block hold copies
    of it, as its data-parallel ranks do. Local: no communication.
    """
    metadata = dict(metadata or {})
    metadata.setdefault("dp_cp_group", groups.rank_pgs.dp_cp)
    with _head_as_own_weight(model) as borrowed:
        state = megatron_sharded_state_dict(prefix, sharded_offsets, metadata)
    head = f"{prefix}{_HEAD}"
    if borrowed:
        del state[head]  # the embedding chunk's entry covers this Parameter
    elif borrowed is False:
        # megatron's own tying: this head holds a copy of the first stage's embedding
        state[head].key = f"{prefix}{_WORD_EMBEDDING}"
        state[head].replica_id = _replica_id(state[head].replica_id, 1)
    for entry in nested_values(state):
        if not isinstance(entry, ShardedBase):
            continue
        if _ROUTED_EXPERT in entry.key:
            entry.replica_id = (*tuple(entry.replica_id)[:-1], groups.rank_pgs.expt_dp.rank())
        if spec.pipeline:
            entry.replica_id = _replica_id(entry.replica_id, spec.pipeline)
    return state


def attach_sharded_state_dicts(chunks: Sequence[torch.nn.Module], specs: Sequence[ChunkSpec], groups: PipelineGroups) -> None:
    """Give each (possibly wrapped) chunk's model the :func:`chunk_sharded_state_dict` of its spec.

    Installed on the model instance (the innermost module, which wrappers such as megatron's
    ``Float16Module`` and Megatron-LM's checkpointing call), with the class's own method kept
    as the base. Call once per chunk, after building and tying.
    """
    for chunk, spec in zip(chunks, specs, strict=True):
        model = unwrap_model(chunk)
        base = type(model).sharded_state_dict.__get__(model)
        model.sharded_state_dict = functools.partial(chunk_sharded_state_dict, model, spec, groups, base)
