#!/usr/bin/env python
"""Measure a cost file for the schedule simulator on a GPU.

Times the forward and the backward of one device share of a megatron-core GPT model —
``--num-layers`` transformer layers (Transformer Engine layers when transformer-engine is
importable and ``--transformer-impl transformer_engine``, megatron-core's local layers
otherwise) — for one micro-batch of ``[--seq-length, --micro-batch-size, --hidden-size]`` in
fp32, ``--bf16`` or ``--fp16``. Communication:

* with two or more GPUs, NCCL between GPU 0 and GPU 1: the one-way time of a pipeline
  message (a 4-byte and an ``[s, b, h]`` message give latency and bandwidth) and the
  all-reduce of the device share's gradients over the pair (measured on at most 1 GiB),
  whose bus bandwidth is the file's ``sync_bandwidth``;
* with one GPU, from ``--p2p-latency-ms``, ``--p2p-bandwidth-gbs`` and
  ``--allreduce-bandwidth-gbs``.

The file's ``grad_bytes`` are the device share's gradient bytes; the simulator times
each chunk's all-reduce from them for its group (replicas x ``--data-parallel-size``).

Writes ``--output`` (default ``costs.json``): one JSON object whose keys are exactly the
fields of :class:`megatron_bitpipe.schedules.CostModel` (milliseconds, bytes, bytes/ms),
which ``python -m megatron_bitpipe.schedules simulate --costs FILE``,
``scripts/bench_emulated.py --costs FILE`` and ``scripts/predict_throughput.py --costs FILE``
read. What was measured and how is printed.

Example (the GPT configuration of the BitPipe README, 96 layers on 8 stages)::

    python scripts/calibrate_gpu.py --num-layers 12 --hidden-size 3072 --num-attention-heads 32 \\
        --seq-length 1024 --micro-batch-size 1 --fp16 --output gpt_costs.json

Needs a CUDA GPU; without one it stops with exit status 2 before doing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict
from typing import Callable, Dict, List, Optional

from megatron_bitpipe.schedules.simulate import CostModel

NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured"
MAX_ALLREDUCE_BYTES = 1 << 30


def cost_model(t_forward: float, t_backward: float, comm: Dict[str, float], grad_bytes: float) -> CostModel:
    """The CostModel of one measurement: compute (ms), ``comm`` = {latency_ms, bytes,
    bandwidth (bytes/ms), sync_bandwidth (bytes/ms)}, the device share's gradient bytes.
    Raises ValueError for negative values."""
    return CostModel(
        t_forward=t_forward,
        t_backward=t_backward,
        t_p2p=comm["latency_ms"],
        p2p_bytes=comm["bytes"],
        p2p_bandwidth=comm["bandwidth"],
        grad_bytes=grad_bytes,
        sync_bandwidth=comm["sync_bandwidth"],
    )


def write_cost_file(path: str, costs: CostModel) -> None:
    """Write ``costs`` as a JSON object with exactly CostModel's fields."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({k: v for k, v in asdict(costs).items() if v is not None}, handle, indent=2)
        handle.write("\n")


def assumed_communication(args: argparse.Namespace, message_bytes: int) -> Dict[str, float]:
    """p2p and all-reduce terms from the flags (one GPU: nothing to measure between GPUs)."""
    return {
        "latency_ms": args.p2p_latency_ms,
        "bytes": float(message_bytes),
        "bandwidth": args.p2p_bandwidth_gbs * 1e6,
        "sync_bandwidth": args.allreduce_bandwidth_gbs * 1e6,
        "source": (
            f"assumed: p2p {args.p2p_latency_ms:g} ms + {args.p2p_bandwidth_gbs:g} GB/s, "
            f"all-reduce bus bandwidth {args.allreduce_bandwidth_gbs:g} GB/s"
        ),
    }


def layer_config(args: argparse.Namespace, dtype):
    """megatron-core TransformerConfig of the measured layers (no parallelism)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        transformer_impl=args.transformer_impl,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Kernels that need apex or megatron's compiled extensions stay off.
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def measure_compute(config, pg_collection, args: argparse.Namespace, timer: Callable, device) -> Dict[str, float]:
    """Median forward and backward time (ms) of a TransformerBlock of ``config.num_layers``
    layers on one micro-batch, and its parameter count.

    ``timer(fn)`` runs ``fn`` and returns its duration in ms (CUDA events on a GPU).
    """
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_bitpipe.runtime.model import default_gpt_layer_spec

    block = TransformerBlock(
        config, default_gpt_layer_spec(config), post_layer_norm=False, pg_collection=pg_collection
    ).to(device)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    hidden = torch.randn(shape, dtype=config.params_dtype, device=device, requires_grad=True)
    grad = torch.randn(shape, dtype=config.params_dtype, device=device)
    forward, backward = [], []
    for iteration in range(args.warmup + args.iters):
        outputs = []
        t_forward = timer(lambda: outputs.append(block(hidden, attention_mask=None)))
        t_backward = timer(lambda: outputs[0].backward(grad))
        block.zero_grad(set_to_none=True)
        hidden.grad = None
        if iteration >= args.warmup:
            forward.append(t_forward)
            backward.append(t_backward)
    return {
        "t_forward": statistics.median(forward),
        "t_backward": statistics.median(backward),
        "parameters": sum(p.numel() for p in block.parameters()),
        "layer_impl": type(block.layers[0].self_attention.linear_qkv).__name__,
    }


def _cuda_timer(fn) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _nccl_probe(rank: int, port: int, message_bytes: int, gradient_bytes: int, iters: int, results) -> None:
    """Spawned on GPUs 0 and 1: p2p one-way times (4 bytes, one message) and all-reduce."""
    import time

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def ping_pong_ms(message) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                dist.send(message, 0)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / (2 * iters)

    def one_way_ms(nbytes: int) -> float:
        message = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device="cuda")
        ping_pong_ms(message)  # warm-up: NCCL sets up the connection on first use
        return ping_pong_ms(message)

    small, large = one_way_ms(4), one_way_ms(message_bytes)
    measured_bytes = min(gradient_bytes, MAX_ALLREDUCE_BYTES)
    buffer = torch.zeros(measured_bytes // 2, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(1 + iters):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    if rank == 0:
        results.put((small, large, statistics.median(times[1:]) * gradient_bytes / measured_bytes))
    dist.destroy_process_group()


def measured_communication(message_bytes: int, gradient_bytes: int, iters: int) -> Dict[str, float]:
    """NCCL between GPUs 0 and 1 (see the module docstring)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        _nccl_probe, args=(port, message_bytes, gradient_bytes, iters, results), nprocs=2, start_method="spawn"
    )
    small, large, pair_allreduce_ms = results.get()
    bandwidth = (message_bytes - 4) / max(large - small, 1e-6)
    return {
        "latency_ms": small,
        "bytes": float(message_bytes),
        "bandwidth": bandwidth,
        "sync_bandwidth": gradient_bytes / max(pair_allreduce_ms, 1e-6),  # bus bandwidth of a 2-rank ring
        "source": "measured with NCCL between GPU 0 and GPU 1",
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, required=True, help="layers of one device share (L / D)")
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--num-attention-heads", type=int, required=True)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                        help="default: transformer_engine if importable, else local")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--p2p-latency-ms", type=float, default=0.02, help="used with fewer than 2 GPUs")
    parser.add_argument("--p2p-bandwidth-gbs", type=float, default=100.0, help="used with fewer than 2 GPUs")
    parser.add_argument("--allreduce-bandwidth-gbs", type=float, default=100.0, help="used with fewer than 2 GPUs")
    parser.add_argument("--output", default="costs.json", help="cost file to write")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for sizes megatron-core would reject."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup: must be >= 0")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError("--num-attention-heads: must divide --hidden-size")
    if min(args.p2p_latency_ms, args.p2p_bandwidth_gbs, args.allreduce_bandwidth_gbs) < 0 or not (
        args.p2p_bandwidth_gbs and args.allreduce_bandwidth_gbs
    ):
        raise ValueError("--p2p-*/--allreduce-bandwidth-gbs: latency >= 0, bandwidths > 0")


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error))
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: {NO_GPU}\n")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if gpt_layer_specs.HAVE_TE else "local"
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    compute = measure_compute(layer_config(args, dtype), None, args, _cuda_timer, torch.device("cuda"))
    dist.destroy_process_group()

    element = torch.tensor([], dtype=dtype).element_size()
    message_bytes = args.seq_length * args.micro_batch_size * args.hidden_size * element
    gradient_bytes = compute["parameters"] * element
    if torch.cuda.device_count() >= 2:
        comm = measured_communication(message_bytes, gradient_bytes, args.iters)
    else:
        comm = assumed_communication(args, message_bytes)
    costs = cost_model(compute["t_forward"], compute["t_backward"], comm, gradient_bytes)
    write_cost_file(args.output, costs)
    print(
        f"{torch.cuda.get_device_name(0)}, {args.transformer_impl} layers ({compute['layer_impl']}), {dtype}: "
        f"{args.num_layers} layers, h={args.hidden_size}, s={args.seq_length}, b={args.micro_batch_size}, "
        f"{compute['parameters'] / 1e6:.1f}M parameters"
    )
    print(f"forward {costs.t_forward:.3f} ms, backward {costs.t_backward:.3f} ms (median of {args.iters})")
    print(
        f"communication {comm['source']}: p2p {costs.message_time:.4f} ms per message, gradient all-reduce of "
        f"the device share over a replica pair {costs.sync_time(1.0, 2):.3f} ms"
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
