"""Context parallelism for megatron-core's local layers: the sequence split and the core
attention's key/value exchange.

**The split** (megatron's load-balanced one, as ``get_batch_on_this_cp_rank`` makes it): a
sequence of ``S`` tokens is cut into ``2 * cp`` chunks of ``S / (2 cp)`` tokens; context-parallel
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, in that order, so under a causal mask every
rank attends to the same number of (query, key) pairs. :func:`cp_positions` gives a rank's global
token positions, :func:`split_for_context_parallel` cuts any per-token tensor (tokens, labels,
loss mask, position ids) to them, :func:`context_parallel_batch` a whole micro-batch. Every
tensor a rank holds is ``S / cp`` tokens long, and so is every activation it sends down the
pipeline: ``[S / cp, b, h]`` (``[S / (cp tp), b, h]`` with sequence parallelism).

**The attention** (:func:`gather_keys_values` + :func:`causal_chunk_masks`): each rank computes
the queries of its own tokens against the keys and values of the *whole* sequence. Keys and
values are all-gathered over the context-parallel group in the forward (``[S / cp, b, groups,
d]`` -> ``[S, b, groups, d]``, reordered to sequence order); in the backward their gradients are
reduce-scattered (summed over the ranks whose queries read them, each rank keeping its own
tokens' sum) — the exchange Llama 3's training used. Per layer and micro-batch a rank receives
``2 (cp - 1) / cp * S * b * groups * d`` elements in F and sends as many gradient elements in B;
activations per rank are ``S / cp`` tokens except the gathered keys and values (``2 S b groups
d`` elements per layer) the attention keeps for its backward. Queries of global chunk ``i`` read keys
``0 .. (i + 1) S / (2 cp)``, causally masked on the diagonal chunk (:func:`causal_chunk_masks`),
so no rank computes scores that the mask discards wholesale.

RoPE needs nothing here: megatron-core's ``RotaryEmbedding`` takes the rotary length times
``config.context_parallel_size`` and keeps this rank's two chunks of positions
(``get_pos_emb_on_this_cp_rank``, the same split), given the model's ``pg_collection.cp``.
Learned absolute position embeddings read the position ids, which the split cuts like tokens.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..optimus.collectives import all_gather_blocks, reduce_scatter_blocks

__all__ = [
    "cp_chunks",
    "cp_positions",
    "split_for_context_parallel",
    "context_parallel_batch",
    "gather_keys_values",
    "causal_chunk_masks",
]


def _chunk_length(seq_length: int, cp_size: int) -> int:
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp_size} "
            "(each context-parallel rank holds two equal chunks of every sequence)"
        )
    return seq_length // (2 * cp_size)


def cp_chunks(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The global chunk indices (of ``2 * cp_size``) rank ``cp_rank`` holds, in its local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global token positions context-parallel rank ``cp_rank`` of ``cp_size`` holds, in its
    local order: chunk ``cp_rank`` then chunk ``2 cp_size - 1 - cp_rank`` (``S / cp_size`` longs).
    ValueError if ``seq_length`` is not a multiple of ``2 * cp_size``."""
    chunk = _chunk_length(seq_length, cp_size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in cp_chunks(cp_size, cp_rank)])


def split_for_context_parallel(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """``tensor``'s slice along ``seq_dim`` (the sequence, ``S`` long) that context-parallel rank
    ``cp_rank`` holds (:func:`cp_positions`); ``tensor`` itself at ``cp_size = 1``."""
    if cp_size == 1:
        return tensor
    index = cp_positions(tensor.size(seq_dim), cp_size, cp_rank, device=tensor.device)
    return tensor.index_select(seq_dim, index).contiguous()


def context_parallel_batch(
    batch: Dict[str, Optional[torch.Tensor]], cp_group: Optional[dist.ProcessGroup], seq_dim: int = 1
) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's part of a micro-batch ``{name: [b, S] tensor or None}`` (tokens, labels, loss
    mask, position ids, ...): every tensor cut along ``seq_dim`` to this rank's positions in
    ``cp_group``; ``None`` entries stay ``None``. The batch itself without context parallelism
    (``cp_group`` None or of size 1)."""
    size = 1 if cp_group is None else cp_group.size()
    if size == 1:
        return dict(batch)
    rank = cp_group.rank()
    return {name: None if t is None else split_for_context_parallel(t, size, rank, seq_dim) for name, t in batch.items()}


class _GatherSequence(torch.autograd.Function):
    """All-gather over a group in the forward (``[n, ...]`` -> ``[size, n, ...]``, member
    ``j``'s input at index ``j``); reduce-scatter (sum) of the gradient in the backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_blocks(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_blocks(grad.contiguous(), ctx.group), None


def _sequence_order(cp_size: int, device) -> torch.Tensor:
    """For each global chunk ``i`` (of ``2 cp``), its block index in the gathered tensor, whose
    block ``2 j + h`` is rank ``j``'s local chunk ``h``."""
    order = [0] * (2 * cp_size)
    for j in range(cp_size):
        first, second = cp_chunks(cp_size, j)
        order[first], order[second] = 2 * j, 2 * j + 1
    return torch.tensor(order, device=device)


def gather_keys_values(
    key: torch.Tensor, value: torch.Tensor, cp_group: dist.ProcessGroup
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's keys and values from every rank's ``[S / cp, b, groups, d]`` ones:
    ``[S, b, groups, d]`` each, in sequence order. One all-gather of keys and values together
    (their gradients: one reduce-scatter, :class:`_GatherSequence`)."""
    cp_size = cp_group.size()
    both = _GatherSequence.apply(torch.stack((key, value), dim=1), cp_group)  # [cp, s_local, 2, b, g, d]
    chunk = key.size(0) // 2
    blocks = both.view(2 * cp_size, chunk, *both.shape[2:])
    ordered = blocks.index_select(0, _sequence_order(cp_size, key.device)).flatten(0, 1)
    return ordered[:, 0], ordered[:, 1]


def causal_chunk_masks(seq_length: int, cp_size: int, cp_rank: int, device) -> List[Tuple[slice, int, torch.Tensor]]:
    """For each of rank ``cp_rank``'s two chunks: ``(its rows of the local queries, the number
    of keys it reads, its mask)``. Chunk of global index ``i`` reads keys ``[0, (i + 1) c)``
    (``c = S / (2 cp)``); its boolean mask ``[c, (i + 1) c]`` is True where query position
    ``i c + q`` may attend key position ``k`` (``k <= i c + q``: SDPA's convention)."""
    chunk = _chunk_length(seq_length, cp_size)
    out = []
    for local, i in enumerate(cp_chunks(cp_size, cp_rank)):
        keys = (i + 1) * chunk
        mask = torch.ones(chunk, keys, dtype=torch.bool, device=device).tril(diagonal=i * chunk)
        out.append((slice(local * chunk, (local + 1) * chunk), keys, mask))
    return out

