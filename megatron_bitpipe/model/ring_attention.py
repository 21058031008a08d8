"""Causal attention under context parallelism with the keys and values passed around the ring
(``--cp-comm-type p2p``), merged by log-sum-exp.

Each rank holds megatron's load-balanced part of the sequence (chunks ``r`` and ``2 cp - 1 - r``
of ``2 cp``, :mod:`.context_parallel`): its queries, keys and values are ``S / cp`` tokens long.
In the forward the rank's key/value block travels ``cp - 1`` times around the context-parallel
ring (step ``t``: rank ``r`` holds the block of rank ``(r - t) mod cp``, sends it to ``r + 1``
and receives the next from ``r - 1``, one ``batch_isend_irecv`` of both per step, issued before
the step's attention so the exchange runs under it). Each step's attention gives a partial
output and the log-sum-exp of its scores per query row; merging them
(``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``)
gives exactly the softmax over all the keys a row reads. Chunk pairs the causal mask discards
wholesale are not computed: at step 0 (its own block) a rank computes its first query chunk
against its first key chunk (masked on the diagonal) and its second query chunk against both
(masked on the second); at a step whose block comes from a lower rank, both query chunks
against the block's first chunk; from a higher rank, the second query chunk against both,
unmasked — the same work on every rank at every step.

The backward (:class:`RingAttention`, an autograd function of its own) recomputes each step's
probabilities from the saved inputs and the merged log-sum-exp (``P = exp(S - lse)``,
``dS = P (dP - rowsum(dO * O))``): the key/value blocks go around the ring again, and with
each the gradient of its keys and values, accumulated by every rank whose queries read it and
sent on after each step; after ``cp`` passes each rank holds its own block's gradient. Every
rank issues the same sequence of batches on the context-parallel group (strict p2p: one FIFO
per group, sends unbuffered; each batch pairs a send to the next rank with a receive from the
previous one, so no send waits on a receive queued behind it).

Shapes: queries ``[b, groups, heads / groups, S / cp, d]`` (GQA: head ``i`` reads group
``i // (heads / groups)``, as megatron does), keys and values ``[b, groups, S / cp, d]``.
Per layer and micro-batch a rank sends ``(cp - 1)`` key/value blocks (``2 S b groups d / cp``
elements each) in F and ``(cp - 1)`` blocks plus ``cp`` gradient blocks in B; it keeps its own
inputs, output and log-sum-exp for the backward, and at most two blocks in flight.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["RingAttention", "ring_attention", "ring_block_reads"]


def ring_block_reads(cp_size: int, rank: int, source: int) -> List[Tuple[int, Optional[slice], bool]]:
    """For each of ``rank``'s two local query chunks, what it reads of ``source``'s key block:
    ``(query chunk 0 or 1, the key chunks as a slice of local chunk indices or None, whether
    the last chunk read is the diagonal one and needs the causal mask)``. Chunk ``i`` (global)
    reads key chunk ``j`` wholly if ``j < i``, masked if ``j == i``, not at all if ``j > i``."""
    mine = (rank, 2 * cp_size - 1 - rank)
    theirs = (source, 2 * cp_size - 1 - source)
    out = []
    for local, i in enumerate(mine):
        read = [c for c, j in enumerate(theirs) if j <= i]
        span = None if not read else slice(read[0], read[-1] + 1)
        out.append((local, span, bool(read) and theirs[read[-1]] == i))
    return out


def _peers(group: dist.ProcessGroup) -> Tuple[int, int]:
    rank, size = group.rank(), group.size()
    return dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def _pass_on(tensor: torch.Tensor, group: dist.ProcessGroup):
    """Start sending ``tensor`` to the next rank of the ring and receiving its like from the
    previous one (one batch): ``(handles, the receive buffer)``."""
    following, previous = _peers(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, following, group), dist.P2POp(dist.irecv, received, previous, group)]
    return dist.batch_isend_irecv(ops), received


def _wait(handles) -> None:
    for handle in handles:
        handle.wait()


def _scores(q, k, chunk: int, causal: bool, scale: float) -> torch.Tensor:
    """``[b, g, r, c, n]`` scaled scores of ``c`` queries against ``n`` keys; with ``causal``
    the last ``c`` keys are the queries' own chunk, masked above the diagonal (``-inf``)."""
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    if causal:
        n = k.size(-2)
        keep = torch.ones(chunk, n, dtype=torch.bool, device=q.device).tril(diagonal=n - chunk)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


class RingAttention(torch.autograd.Function):
    """Ring attention of this rank's queries over the whole sequence; see the module docstring.
    ``forward(q [b, g, r, s, d], k [b, g, s, d], v [b, g, s, d], group, scale) -> [b, g, r, s, d]``."""

    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        size, rank = group.size(), group.rank()
        chunk = q.size(-2) // 2
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        block = torch.stack((k, v))  # [2, b, g, s, d]
        for step in range(size):
            pending = _pass_on(block, group) if step < size - 1 else None
            for local, span, causal in ring_block_reads(size, rank, (rank - step) % size):
                if span is None:
                    continue
                rows = slice(local * chunk, (local + 1) * chunk)
                keys = slice(span.start * chunk, span.stop * chunk)
                scores = _scores(q[..., rows, :], block[0][..., keys, :], chunk, causal, scale)
                part_lse = torch.logsumexp(scores, dim=-1)
                part = torch.einsum("bgrqk,bgkd->bgrqd", torch.exp(scores - part_lse.unsqueeze(-1)), block[1][..., keys, :])
                merged = torch.logaddexp(lse[..., rows], part_lse)
                out[..., rows, :] = (
                    out[..., rows, :] * torch.exp(lse[..., rows] - merged).unsqueeze(-1)
                    + part * torch.exp(part_lse - merged).unsqueeze(-1)
                )
                lse[..., rows] = merged
            if pending is not None:
                _wait(pending[0])
                block = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size, rank = group.size(), group.rank()
        chunk = q.size(-2) // 2
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O): [b, g, r, s]
        grad_q = torch.zeros_like(q)
        block = torch.stack((k, v))
        grad_block = torch.zeros_like(block)  # the gradient of the block held, summed so far
        for step in range(size):
            pending = _pass_on(block, group) if step < size - 1 else None
            for local, span, causal in ring_block_reads(size, rank, (rank - step) % size):
                if span is None:
                    continue
                rows = slice(local * chunk, (local + 1) * chunk)
                keys = slice(span.start * chunk, span.stop * chunk)
                q_rows, do_rows = q[..., rows, :], grad_out[..., rows, :]
                key, value = block[0][..., keys, :], block[1][..., keys, :]
                probs = torch.exp(_scores(q_rows, key, chunk, causal, scale) - lse[..., rows].unsqueeze(-1))
                grad_block[1][..., keys, :] += torch.einsum("bgrqk,bgrqd->bgkd", probs, do_rows)
                grad_probs = torch.einsum("bgrqd,bgkd->bgrqk", do_rows, value)
                grad_scores = probs * (grad_probs - delta[..., rows].unsqueeze(-1)) * scale
                grad_q[..., rows, :] += torch.einsum("bgrqk,bgkd->bgrqd", grad_scores, key)
                grad_block[0][..., keys, :] += torch.einsum("bgrqk,bgrqd->bgkd", grad_scores, q_rows)
            handles, grad_block = _pass_on(grad_block, group)
            _wait(handles)
            if pending is not None:
                _wait(pending[0])
                block = pending[1]
        return grad_q, grad_block[0], grad_block[1], None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
    """megatron's layout in and out: ``[S / cp, b, heads, d]`` queries, ``[S / cp, b, groups, d]``
    keys and values (this rank's two chunks) -> ``[S / cp, b, heads * d]``, causal over the whole
    sequence (:class:`RingAttention`)."""
    s, b, heads, d = query.shape
    groups = key.size(2)
    q = query.reshape(s, b, groups, heads // groups, d).permute(1, 2, 3, 0, 4)
    k, v = (t.permute(1, 2, 0, 3) for t in (key, value))
    context = RingAttention.apply(q, k, v, group, scale)  # [b, g, r, s, d]
    return context.permute(3, 0, 1, 2, 4).reshape(s, b, heads * d)
