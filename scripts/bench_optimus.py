#!/usr/bin/env python
"""Optimus 2D vs megatron-core 1-D tensor parallelism on one GPT layer, measured on CPU ranks.

For the same GPT layer sizes on p = q*q gloo ranks (default 4), runs one transformer
layer's forward and backward in three modes and measures, per rank:

* ``optimus2d`` — Optimus 2D on a q×q mesh (this package's layer spec, ``[s, b/q, h/q]``,
  which recomputes norm outputs, the MLP activation and the attention dropout in backward);
* ``tp``        — megatron-core TP=p without sequence parallelism (local layer spec);
* ``tp+sp``     — megatron-core TP=p with sequence parallelism.

The core attention computes the same in all modes: megatron-core's unfused
DotProductAttention (``--attention local``; for ``optimus2d`` its subclass
``OptimusDotProductAttention``, which keeps a bool dropout mask and recomputes the dropped-out
probabilities) or torch's scaled_dot_product_attention (``--attention sdpa``, the flash
kernel when dropout is 0).

Measured quantities (see :mod:`megatron_bitpipe.benchmarking.meters`):

* **activations**: bytes of distinct storages autograd saves during the layer's forward
  (parameters excluded) — what the layer keeps alive until its backward;
* **comm**: every collective the rank issues in forward + backward, as bytes received per
  rank with bandwidth-optimal algorithms (ring all-reduce 2(p−1)/p·n, others (p−1)/p·n),
  plus the raw payload and the number of calls.

The first forward/backward is a warm-up; the second is measured. Prints a Markdown table
(``--breakdown``: and the saved storages of each mode).
Usage: ``python scripts/bench_optimus.py [--seq-length 512 --micro-batch-size 8 ...]``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections import Counter

import torch
import torch.distributed as dist

MODES = ("optimus2d", "tp", "tp+sp")


class SdpaCoreAttention(torch.nn.Module):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (causal).

    Same interface as megatron-core's ``DotProductAttention`` (``[s, b, heads, head_dim]``
    in, ``[s, b, heads * head_dim]`` out); with dropout 0 torch picks its flash kernel, which
    keeps only q, k, v, the output and the log-sum-exp for backward (as flash attention on
    a GPU does), instead of the ``[b, heads, s, s]`` probabilities. Benchmark-only: the same
    class serves all three modes.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        with get_cuda_rng_tracker().fork():
            context = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
                scale=self.softmax_scale,
            )
        return context.permute(2, 0, 1, 3).flatten(2)


class _SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm for sequence-parallel layers (megatron's wrapper refuses SP without
    apex/TE): same math and saved tensors; parameters flagged ``sequence_parallel`` so that
    megatron's ``finalize_model_grads`` would all-reduce their gradients."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = True


def _layer_and_input(mode: str, sizes: dict):
    """(layer, local input shape) for ``mode`` on this rank."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_bitpipe.optimus.mesh import build_optimus_mesh
    from megatron_bitpipe.optimus.spec import get_optimus_gpt_layer_spec
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    world = dist.get_world_size()
    tp_group = dist.new_group(list(range(world)))
    own_rank_only = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    pg_collection = ProcessGroupCollection(tp=tp_group, cp=own_rank_only, pp=own_rank_only)
    config = tiny_gpt_config(
        num_layers=1,
        hidden_size=sizes["hidden"],
        num_attention_heads=sizes["heads"],
        ffn_hidden_size=sizes["ffn"],
        tensor_model_parallel_size=world,
        sequence_parallel=mode == "tp+sp",
        hidden_dropout=sizes["dropout"],
        attention_dropout=sizes["dropout"],
    )
    s, b, h = sizes["seq"], sizes["batch"], sizes["hidden"]
    sdpa = sizes["attention"] == "sdpa"
    if mode == "optimus2d":
        mesh = build_optimus_mesh(tp_group)
        spec = get_optimus_gpt_layer_spec(mesh, *([SdpaCoreAttention] if sdpa else []))
        shape = (s, b // mesh.side, h // mesh.side)
    else:
        spec = get_gpt_layer_local_spec()
        core_attention = SdpaCoreAttention if sdpa else DotProductAttention
        spec.submodules.self_attention.submodules.core_attention = core_attention
        if config.sequence_parallel:
            norm = ModuleSpec(module=_SequenceParallelLayerNorm)
            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        shape = (s // world if config.sequence_parallel else s, b, h)
    layer = build_module(spec, config=config, layer_number=1, pg_collection=pg_collection)
    return layer, shape


def _measure(mode: str, sizes: dict) -> dict:
    """One rank's activation bytes and collective traffic for a layer forward + backward."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.benchmarking.meters import CollectiveMeter, SavedActivationMeter

    enable_cpu_megatron()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, tp_rank=dist.get_rank(), ep_rank=0, etp_rank=0)
    parallel_state._set_global_memory_buffer()
    layer, shape = _layer_and_input(mode, sizes)
    layer.train()
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in ("warm-up", "measured"):
        hidden = torch.randn(shape, generator=generator, requires_grad=True)
        grad = torch.randn(shape, generator=generator)
        layer.zero_grad(set_to_none=True)
        with CollectiveMeter() as comm:
            with SavedActivationMeter(layer.parameters()) as activations:
                output, _ = layer(hidden, attention_mask=None)
            output.backward(grad)
    return {
        "activation_bytes": activations.bytes,
        "storages": [(size, str(dtype).replace("torch.", "")) for size, dtype in activations.storages],
        "wire_bytes": comm.wire_bytes(),
        "payload_bytes": comm.payload_bytes(),
        "calls": dict(Counter(call.op for call in comm.calls)),
    }


def _model_elements(sizes: dict) -> dict:
    """Expected elements received per rank (the meter's (p−1)/p factors), for comparison.

    optimus2d: per SUMMA linear in→out, 3 activation-sized and 3 weight-sized block streams
    (forward: all-gather A and W; dA: all-gather W, reduce-scatter dA; dW: all-gather A,
    reduce-scatter dW),
    i.e. (21·bsh + 36·h²)/q for ffn = 4h (docs/optimus.md); norms and bias grads not counted.
    tp: 4 all-reduces of bsh. tp+sp: 4 all-gathers/reduce-scatters forward, 4 backward and
    the 2 re-gathers of the column-parallel inputs for their weight gradients.
    """
    b, s, h, f, p = sizes["batch"], sizes["seq"], sizes["hidden"], sizes["ffn"], sizes["tp"]
    q = math.isqrt(p)
    bsh = b * s * h
    share = (q - 1) / q
    # per SUMMA linear (in→out): fwd 2 all-gathers (activation, weight), bwd dA: weight
    # all-gather + activation reduce-scatter, dB: activation all-gather + weight reduce-scatter
    linears = [(h, 3 * h), (h, h), (h, f), (f, h)]
    summa = sum(share * (3 * b * s * i / q + 3 * i * o / q) for i, o in linears)
    tp_share = (p - 1) / p
    return {"optimus2d": summa, "tp": 4 * 2 * tp_share * bsh, "tp+sp": 10 * tp_share * bsh}


def _table(results: dict, sizes: dict) -> str:
    mib = 2**20
    base = max(r["activation_bytes"] for r in results["tp"])
    model = _model_elements(sizes)
    lines = [
        "| mode | activations / rank (MiB) | vs tp | comm received / rank (MiB) "
        "| model (MiB) | payload (MiB) | collectives |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        per_rank = results[mode]
        activations = max(r["activation_bytes"] for r in per_rank)
        wire = sum(r["wire_bytes"] for r in per_rank) / len(per_rank)
        payload = sum(r["payload_bytes"] for r in per_rank) / len(per_rank)
        calls = ", ".join(f"{op} {n}" for op, n in sorted(per_rank[0]["calls"].items()))
        lines.append(
            f"| {mode} | {activations / mib:.2f} | {activations / base:.2f} | {wire / mib:.2f} "
            f"| {model[mode] * 4 / mib:.2f} | {payload / mib:.2f} | {calls} |"
        )
    return "\n".join(lines)


def _breakdown(results: dict) -> str:
    """What rank 0 of each mode keeps for backward: distinct storages grouped by size."""
    lines = ["| mode | saved storages on rank 0: MiB (dtype) x count |", "|---|---|"]
    for mode in MODES:
        counts = Counter(results[mode][0]["storages"])
        parts = [
            f"{size / 2**20:.2f} ({dtype}) x {n}"
            for (size, dtype), n in sorted(counts.items(), reverse=True)
            if size >= 2**16
        ]
        lines.append(f"| {mode} | {', '.join(parts)} |")
    return "\n".join(lines) + "\n\n(storages under 64 KiB, e.g. norm statistics, not listed)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=4,
        help="ranks; q*q for optimus2d (q = sqrt)",
    )
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    parser.add_argument(
        "--attention",
        choices=("local", "sdpa"),
        default="local",
        help="core attention of every mode: megatron-core's unfused DotProductAttention, or "
        "torch scaled_dot_product_attention (flash kernel when dropout is 0)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also list the storages each mode keeps for backward (rank 0)",
    )
    args = parser.parse_args(argv)
    sizes = {
        "tp": args.tensor_model_parallel_size,
        "seq": args.seq_length,
        "batch": args.micro_batch_size,
        "hidden": args.hidden_size,
        "heads": args.num_attention_heads,
        "ffn": args.ffn_hidden_size or 4 * args.hidden_size,
        "dropout": args.dropout,
        "attention": args.attention,
    }
    if sizes["seq"] % sizes["tp"]:
        parser.error("--seq-length must be divisible by --tensor-model-parallel-size (tp+sp mode)")
    from megatron_bitpipe.optimus.validation import check_optimus_settings
    from megatron_bitpipe.cpu.launcher import launch

    try:
        check_optimus_settings(
            sizes["tp"],
            divisible_by_side={
                "--micro-batch-size": sizes["batch"],
                "--hidden-size": sizes["hidden"],
                "--num-attention-heads": sizes["heads"],
                "--ffn-hidden-size": sizes["ffn"],
            },
            unsupported={},
        )
    except ValueError as error:
        parser.error(str(error))

    results = {mode: launch(_measure, sizes["tp"], mode, sizes) for mode in MODES}
    command = "python scripts/bench_optimus.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    print(f"`{command.strip()}` — one GPT layer, fp32, {sizes['tp']} CPU ranks, sizes {sizes}\n")
    print(_table(results, sizes))
    if args.breakdown:
        print()
        print(_breakdown(results))


if __name__ == "__main__":
    main()
