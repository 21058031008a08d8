"""Layout-independent weights: map a model chunk's parameters to the full model's names.

A *full* (global) state dict is the one of the whole GPT model on one rank without tensor or
pipeline parallelism: ``embedding.*``, ``decoder.layers.{L}.*`` for global layer ``L``,
``decoder.final_layernorm.*``, ``output_layer.*`` (absent with tied embeddings); BERT's
(``encoder.*`` and its heads) likewise, see :mod:`megatron_bitpipe.model_partition`.
A *chunk* holds a contiguous range of layers plus, optionally, the embedding (pre_process)
and the final norm and output layer (post_process); megatron numbers its layers locally
(``decoder.layers.{l}``, ``l = L - first_layer``).
:class:`~megatron_bitpipe.model_partition.ChunkLayers` says which part a
chunk holds, whatever the placement (looped, V, bidirectional), so one full state dict
initialises any layout identically, and any layout's weights or gradients can be put
back together and compared with a single-process run.

Tied embeddings: a chunk that has the output layer but not the embedding keeps its own copy
of the word embeddings as ``output_layer.weight``; it maps to
``embedding.word_embeddings.weight``. Every copy of a full tensor (tied copies, data-parallel
replicas) must agree; :func:`merge_full` checks that.

The name mapping, the tensor-parallel blocks and :func:`chunk_layers_of` (re-exported) are
:mod:`megatron_bitpipe.model_partition`'s; megatron-core is imported only by the functions
that read a model or a config.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from ..model_partition import (
    ChunkLayers,
    chunk_layers_of,
    from_tp_blocks,
    is_tensor_parallel,
    to_global_name,
    to_local_name,
    tp_block,
)

__all__ = [
    "looped_chunk_layers",
    "chunk_layers_of",
    "chunk_state_dict",
    "load_full",
    "collect_full",
    "merge_full",
]


def looped_chunk_layers(
    config, pp_rank: int, vp_stage: Optional[int] = None, tied: bool = False
) -> ChunkLayers:
    """The chunk megatron builds for (``pp_rank``, ``vp_stage``) in the looped placement.

    Uses megatron's own offset and layer-count functions with the rank passed explicitly
    (no parallel_state), so it agrees with what GPTModel builds. Not for
    ``pipeline_model_parallel_layout``, which reads global state.
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp_size = config.pipeline_model_parallel_size
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    v = vp_stage or 0
    return ChunkLayers(
        first_layer=get_transformer_layer_offset(config, vp_stage, pp_rank),
        num_layers=get_num_layers_to_build(config, vp_stage, pp_rank),
        pre_process=(pp_rank == 0 and v == 0),
        post_process=(pp_rank == pp_size - 1 and v == vp_size - 1),
        tied=tied,
    )


def chunk_state_dict(full: Mapping[str, torch.Tensor], chunk: ChunkLayers) -> Dict[str, torch.Tensor]:
    """The entries of a full state dict that ``chunk`` holds, under the chunk's names."""
    out = {}
    for name, value in full.items():
        local = to_local_name(name, chunk)
        if local is not None:
            out[local] = value
    return out


def load_full(
    model: torch.nn.Module,
    full: Mapping[str, torch.Tensor],
    chunk: Optional[ChunkLayers] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Copy the full model's values into every parameter of ``model`` (in place).

    ``chunk`` defaults to :func:`chunk_layers_of`. With ``tp_group`` (size > 1),
    tensor-parallel parameters take their block. Raises KeyError if ``full`` lacks a value
    and ValueError on a shape mismatch; in-place copies keep DDP's buffer views valid.
    """
    from megatron.core.utils import unwrap_model

    chunk = chunk or chunk_layers_of(model)
    tp_rank, tp_size = (tp_group.rank(), tp_group.size()) if tp_group is not None else (0, 1)
    with torch.no_grad():
        for name, param in unwrap_model(model).named_parameters():
            value = tp_block(full[to_global_name(name, chunk)], param, tp_rank, tp_size)
            if value.shape != param.shape:
                raise ValueError(
                    f"{name}: full tensor gives {tuple(value.shape)}, parameter is {tuple(param.shape)}"
                )
            param.copy_(value)


def collect_full(
    model: torch.nn.Module,
    tensor_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda p: p,
    chunk: Optional[ChunkLayers] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Dict[str, torch.Tensor]:
    """``{full name: tensor_of(param)}`` for every parameter of ``model``, as CPU copies.

    ``tensor_of`` picks what to collect: the parameter (default), ``lambda p: p.main_grad``
    (megatron DDP's gradient), ``lambda p: p.grad``...; entries where it returns None are
    skipped. With ``tp_group`` (size > 1), tensor-parallel blocks are all-gathered, so this is
    a collective over the tp group and every tp rank gets the full tensors; Optimus 2-D
    blocks are reassembled by their ``optimus_layout``, which also checks that copies of
    column-replicated parameters are bit-identical.
    """
    from megatron.core.utils import unwrap_model

    chunk = chunk or chunk_layers_of(model)
    out = {}
    for name, param in unwrap_model(model).named_parameters():
        value = tensor_of(param)
        if value is None:
            continue
        value = value.detach()
        layout = getattr(param, "optimus_layout", None)
        if tp_group is not None and tp_group.size() > 1 and (layout or is_tensor_parallel(param)):
            blocks = [torch.empty_like(value) for _ in range(tp_group.size())]
            dist.all_gather(blocks, value.contiguous(), group=tp_group)
            value = from_tp_blocks(blocks, param)
        out[to_global_name(name, chunk)] = value.to("cpu", copy=True)
    return out


def merge_full(parts: Iterable[Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Union of partial full state dicts (e.g. one per rank and chunk).

    A name present in several parts (tied embedding copies, data-parallel or tensor-parallel
    replicas) must have bit-identical values; ValueError names the first that does not.
    """
    merged: Dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            if name in merged:
                if not torch.equal(merged[name], value):
                    diff = (merged[name] - value).abs().max().item()
                    raise ValueError(f"{name}: copies disagree (max |diff| {diff:.3g})")
            else:
                merged[name] = value
    return merged
