#!/usr/bin/env python
"""Context-parallel attention race: the key/value all-gather vs the ring (``--cp-comm-type
all_gather`` / ``p2p``) on CPU ranks joined by gloo.

For each context-parallel size, one launch of ``cp`` processes runs
:class:`megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention` (causal, fp32, megatron's
layout ``[S / cp, b, heads, d]``, this rank's two chunks of megatron's split) forward +
backward with each exchange, alternately round after round (``A B A B ...``, both under the same
load). Per exchange and rank it reports: the median time of one forward + backward of the
layer; the peak bytes autograd keeps for the backward (``benchmarking.meters.LiveActivationMeter``:
every tensor saved while the forward ran, counted once per storage); the bytes this rank sends
per layer (forward + backward), counted at the calls: the all-gather's and reduce-scatter's
send share (``(cp - 1) / cp`` of the buffer) and every ``isend`` of ``batch_isend_irecv``. The
outputs and input gradients of the two are compared once (max abs difference).

Usage::

    python scripts/bench_context_parallel.py --cp 2,4 --seq-length 4096 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict

import torch
import torch.distributed as dist


class _SentBytes:
    """Bytes this rank sends through the calls the two exchanges make, while active."""

    def __init__(self):
        self.bytes = 0
        self._restore = []

    def __enter__(self):
        from megatron_bitpipe.optimus import collectives

        for name in (collectives._ALL_GATHER, collectives._REDUCE_SCATTER):
            original = getattr(dist, name)

            def counted(out, inp, *args, _original=original, _gather=name == collectives._ALL_GATHER, **kwargs):
                group = kwargs.get("group")
                size = dist.get_world_size(group)
                whole = out if _gather else inp
                self.bytes += whole.numel() * whole.element_size() * (size - 1) // size
                return _original(out, inp, *args, **kwargs)

            self._restore.append((name, original))
            setattr(dist, name, counted)
        batch = dist.batch_isend_irecv

        def counted_batch(ops, _original=batch):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if "isend" in op.op.__name__)
            return _original(ops)

        self._restore.append(("batch_isend_irecv", batch))
        dist.batch_isend_irecv = counted_batch
        return self

    def __exit__(self, *exc):
        for name, original in reversed(self._restore):
            setattr(dist, name, original)
        self._restore.clear()


def _layer(comm: str, heads: int, groups: int, head_dim: int, cp: int, group):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config
    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention

    config = tiny_gpt_config(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=groups,
        context_parallel_size=cp, cp_comm_type=comm,
    )  # fmt: skip
    pgs = ProcessGroupCollection(tp=dist.new_group([dist.get_rank()]), cp=group)
    return SdpaDotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type=comm, pg_collection=pgs)


def run_rank(seq: int, batch: int, heads: int, groups: int, head_dim: int, rounds: int) -> Dict:
    from megatron_bitpipe.benchmarking.meters import LiveActivationMeter
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    torch.manual_seed(rank)
    local = seq // cp
    q = torch.randn(local, batch, heads, head_dim, requires_grad=True)
    k = torch.randn(local, batch, groups, head_dim, requires_grad=True)
    v = torch.randn(local, batch, groups, head_dim, requires_grad=True)
    grad = torch.randn(local, batch, heads * head_dim)
    layers = {comm: _layer(comm, heads, groups, head_dim, cp, group) for comm in ("all_gather", "p2p")}
    times = {comm: [] for comm in layers}
    out = {}
    for index in range(rounds + 1):  # round 0 warms up and measures bytes and memory
        for comm, layer in layers.items():
            for t in (q, k, v):
                t.grad = None
            dist.barrier(group)
            meter, sent = LiveActivationMeter(), _SentBytes()
            start = time.perf_counter()
            with sent:
                with meter:
                    context = layer(q, k, v, None)
                context.backward(grad)
            elapsed = time.perf_counter() - start
            if index == 0:
                out[comm] = dict(
                    peak_saved_bytes=meter.peak_bytes, sent_bytes=sent.bytes,
                    result=[context.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()],
                )  # fmt: skip
            else:
                times[comm].append(elapsed)
    difference = max((a - b).abs().max().item() for a, b in zip(out["all_gather"]["result"], out["p2p"]["result"]))
    return {
        comm: dict(
            ms=1e3 * statistics.median(times[comm]), peak_saved_bytes=out[comm]["peak_saved_bytes"],
            sent_bytes=out[comm]["sent_bytes"], max_abs_difference=difference,
        )
        for comm in layers
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", default="2,4", help="context-parallel sizes, comma-separated")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the rows and the load average here")
    args = parser.parse_args(argv)

    from megatron_bitpipe.cpu.launcher import launch

    rows = []
    load = os.getloadavg()
    for cp in (int(c) for c in args.cp.split(",")):
        ranks = launch(
            run_rank, cp, args.seq_length, args.micro_batch_size, args.num_attention_heads, args.num_query_groups,
            args.head_dim, args.rounds, timeout=1800,
        )  # fmt: skip
        for comm in ("all_gather", "p2p"):
            per_rank = [r[comm] for r in ranks]
            rows.append(dict(
                cp=cp, comm=comm, ms=max(r["ms"] for r in per_rank),
                peak_saved_mib=max(r["peak_saved_bytes"] for r in per_rank) / 2**20,
                sent_mib=max(r["sent_bytes"] for r in per_rank) / 2**20,
                max_abs_difference=max(r["max_abs_difference"] for r in per_rank),
            ))  # fmt: skip
    load = [max(a, b) for a, b in zip(load, os.getloadavg())]
    print(f"S {args.seq_length}, b {args.micro_batch_size}, {args.num_attention_heads} heads / "
          f"{args.num_query_groups} groups of {args.head_dim}, fp32; load average (max of start/end) {load[0]:.1f}")  # fmt: skip
    print("| CP | --cp-comm-type | F+B ms (median, slowest rank) | saved for backward MiB | sent per layer MiB | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['comm']} | {r['ms']:.1f} | {r['peak_saved_mib']:.2f} | {r['sent_mib']:.2f} | {r['max_abs_difference']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, load_average=load, args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
